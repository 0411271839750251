"""The rank watchdogs' decisions (services/rank/watchdogs.py), the thread that acts on
them (services/rank/guard.py) and rank 0's stream ledger (services/rank/streams.py),
on a fake clock: no real seconds, no processes. tests/e2e/test_rank_watchdogs.py proves
the wiring on real ranks."""

from __future__ import annotations

import os

import pytest

from common.messages import Generate, Tokens
from common.rankspec import RankSettings
from services.rank.guard import Watchdogs
from services.rank.streams import StreamLedger
from services.rank.watchdogs import (
    LauncherWatchdog,
    LeaderWatchdog,
    PeerWatchdog,
    ProgressWatchdog,
    WatchdogConfigError,
    WatchdogSettings,
)

# -- settings -------------------------------------------------------------------------


def test_settings_come_from_the_spec_and_the_environment_wins():
    s = RankSettings(peer_abort_grace_s=3.0, progress_stall_s=60.0, signal_clear_timeout_s=4.0,
                     peer_probe_interval_s=0.2, lease_stale_s=9.0)
    w = WatchdogSettings.resolve(s, {})
    assert (w.abort_grace_s, w.progress_stall_s, w.signal_clear_timeout_s) == (3.0, 60.0, 4.0)
    assert (w.probe_interval_s, w.lease_stale_s, w.fail_tolerance) == (0.2, 9.0, 2)
    w = WatchdogSettings.resolve(s, {"LOCKSTEP_PEER_ABORT_GRACE": "0",
                                     "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "2.5",
                                     "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "1", "OTHER": "x"})
    assert (w.abort_grace_s, w.progress_stall_s, w.signal_clear_timeout_s) == (0.0, 2.5, 1.0)
    assert WatchdogSettings.resolve(RankSettings()) == WatchdogSettings()  # DESIGN 7 defaults
    for env in ({"LOCKSTEP_PEER_ABORT_GRACE": "soon"}, {"LOCKSTEP_PROGRESS_STALL_TIMEOUT": "-1"},
                {"LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "nan"}):
        with pytest.raises(WatchdogConfigError, match="LOCKSTEP_|must be"):
            WatchdogSettings.resolve(s, env)
    with pytest.raises(WatchdogConfigError, match="tolerance"):
        WatchdogSettings.resolve(RankSettings(peer_fail_tolerance=0))
    with pytest.raises(WatchdogConfigError, match="interval"):
        WatchdogSettings.resolve(RankSettings(peer_probe_interval_s=0))


# -- peer watchdog (rank 0) -----------------------------------------------------------


class Probed:
    """Drives a PeerWatchdog round by round; `answer` says who echoes each round."""

    def __init__(self, wd: PeerWatchdog, peers=(1, 2), interval: float = 1.0) -> None:
        self.wd, self.peers, self.interval = wd, list(peers), interval
        self.now = 0.0
        self.answered: dict[int, int] = {}
        self.nonce, _ = wd.round(self.now, self.peers, self.answered)

    def step(self, answering=None) -> list[str]:
        """The round in flight is answered by `answering` (default: every peer)."""
        for r in self.peers if answering is None else answering:
            self.answered[r] = self.nonce
        self.now += self.interval
        assert self.wd.due(self.now, self.interval)
        self.nonce, verdicts = self.wd.round(self.now, self.peers, self.answered)
        return [v.what for v in verdicts]


def test_flaky_single_probe_is_tolerated():
    p = Probed(PeerWatchdog(tolerance=2, grace_s=5.0))
    seen = [p.step(), p.step(answering=[1]), p.step(), p.step(answering=[2]), p.step()]
    assert seen == [[]] * 5 and p.wd.state == PeerWatchdog.OK


def test_alternating_failures_do_not_accumulate():
    p = Probed(PeerWatchdog(tolerance=2, grace_s=5.0))
    for _ in range(20):
        assert p.step(answering=[2]) == []  # rank 1 misses every other round
        assert p.step() == []
    assert p.wd.fails == {1: 0, 2: 0}


def test_two_failures_abort_then_recovery_keeps_running():
    p = Probed(PeerWatchdog(tolerance=2, grace_s=5.0))
    assert p.step(answering=[2]) == []
    assert p.step(answering=[2]) == ["abort"]  # 2 in a row → abort stage
    abort_at = p.now
    assert p.step(answering=[2]) == []  # still silent, within the grace
    assert p.step() == ["recovered"]  # SIGCONT: answers again
    assert p.wd.state == PeerWatchdog.OK and p.now - abort_at < 5.0
    for _ in range(10):
        assert p.step() == []
    # ... and a later loss is judged afresh: a new abort stage, then lost after the grace.
    assert p.step(answering=[1]) == [] and p.step(answering=[1]) == ["abort"]
    abort_at = p.now
    verdicts = []
    while not verdicts:
        verdicts = p.step(answering=[1])
    assert verdicts == ["lost"] and p.now - abort_at >= 5.0
    assert p.now - abort_at < 5.0 + p.interval
    assert not p.wd.due(p.now + 100, 1.0)  # lost is final


def test_without_a_grace_it_is_lost_at_the_tolerance():
    p = Probed(PeerWatchdog(tolerance=3, grace_s=0.0))
    assert p.step(answering=[]) == [] and p.step(answering=[]) == []
    assert p.step(answering=[]) == ["abort", "lost"]


def test_no_peers_never_fires():
    p = Probed(PeerWatchdog(tolerance=1, grace_s=0.0), peers=())
    assert all(p.step(answering=[]) == [] for _ in range(50))


def test_a_peer_is_judged_only_on_rounds_it_was_probed_in():
    wd = PeerWatchdog(tolerance=1, grace_s=0.0)
    n, _ = wd.round(0.0, [], {})
    n, v = wd.round(1.0, [1], {})  # rank 1 joined after round 1 was sent
    assert v == []
    _, v = wd.round(2.0, [1], {1: n})
    assert v == []


def test_peer_watchdog_forgives_the_round_this_process_slept_through():
    p = Probed(PeerWatchdog(tolerance=1, grace_s=0.0))
    p.wd.rebase(30.0)  # SIGSTOP of rank 0 itself: the round in flight is not judged
    p.now += 31
    _, verdicts = p.wd.round(p.now, p.peers, {})
    assert verdicts == []


# -- leader watchdog (followers) --------------------------------------------------------


def test_leader_watchdog_suspects_then_loses_a_silent_rank_0():
    wd = LeaderWatchdog(tolerance=2, grace_s=2.0)
    assert wd.check(100.0, None, 0.5) == []  # never pinged: nothing to lose
    assert wd.check(1.4, 0.0, 0.5) == []  # 3 intervals of slack
    assert [v.what for v in wd.check(1.6, 0.0, 0.5)] == ["suspect"]
    assert wd.check(3.0, 0.0, 0.5) == []
    assert [v.what for v in wd.check(3.4, 3.3, 0.5)] == ["recovered"]  # pings again
    assert [v.what for v in wd.check(5.0, 3.3, 0.5)] == ["suspect"]
    lost = wd.check(6.9, 3.3, 0.5)
    assert [v.what for v in lost] == ["lost"] and "rank 0" in lost[0].reason
    assert wd.check(99.0, 3.3, 0.5) == []  # reported once
    wd0 = LeaderWatchdog(tolerance=2, grace_s=0.0)
    assert [v.what for v in wd0.check(1.6, 0.0, 0.5)] == ["suspect", "lost"]
    wd1 = LeaderWatchdog(tolerance=2, grace_s=0.0)
    wd1.rebase(50.0)  # this follower itself was stopped until t=50
    assert wd1.check(50.2, 0.0, 0.5) == []


# -- launcher watchdog ------------------------------------------------------------------


def test_launcher_watchdog_parent_and_lease():
    wd = LauncherWatchdog(lease_stale_s=45.0)
    assert wd.check(1e6, None, None) is None  # a lease never seen is not stale
    assert wd.check(100.0, None, 60.0) is None
    v = wd.check(105.1, None, 60.0)
    assert v.what == "launcher_lost" and "lease" in v.reason
    assert wd.check(0.0, "parent 42 gone", None).reason == "parent 42 gone"
    wd.rebase(200.0)  # this rank was stopped: leases queued meanwhile are on their way
    assert wd.check(210.0, None, 60.0) is None
    assert LauncherWatchdog(lease_stale_s=0).check(1e9, None, 0.0) is None  # off


# -- progress watchdog ------------------------------------------------------------------


def test_progress_watchdog_fires_only_on_a_stall_with_requests():
    wd = ProgressWatchdog(stall_s=10.0)
    assert wd.check(0.0, 0, 5) is None
    assert wd.check(1000.0, 0, 5) is None  # idle for ages: no stall
    assert wd.check(1001.0, 2, 5) is None  # a request arrives: the clock starts now
    assert wd.check(1010.0, 2, 5) is None
    assert wd.check(1010.5, 2, 6) is None  # a step: restart
    assert wd.check(1020.0, 2, 6) is None
    v = wd.check(1020.5, 2, 6)
    assert v.what == "stalled" and "2 active" in v.reason and "step 6" in v.reason
    assert ProgressWatchdog(stall_s=0).check(1e9, 3, 0) is None  # off


# -- the watchdog thread ----------------------------------------------------------------


class Exited(Exception):
    pass


class FakeRank:
    """RankHooks on a fake clock; `calls` records what the watchdogs did."""

    def __init__(self, *, leader=True, world_size=2, fast=True) -> None:
        self.leader, self.world_size, self._fast = leader, world_size, fast
        self.now = 0.0
        self.calls: list[tuple] = []
        self.responsive = {r: True for r in range(1, world_size)} if leader else {}
        self.pongs: dict[int, int] = {}
        self.gone: str | None = None
        self.lease: float | None = None
        self.active, self.step, self._busy = 0, 0, None
        self.ping_at: float | None = None

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def fast(self):
        return self._fast

    def parent_gone(self):
        return self.gone

    def last_lease_at(self):
        return self.lease

    def activity(self):
        return self.active, self.step

    def busy(self):
        return self._busy

    def peers(self):
        return list(self.responsive)

    def answered(self):
        return dict(self.pongs)

    def send_probe(self, nonce):
        self.calls.append(("probe", self.now, nonce))
        for r, ok in self.responsive.items():
            if ok:
                self.pongs[r] = nonce

    def last_ping_at(self):
        return self.ping_at

    def mark(self, phase, reason):
        self.calls.append(("mark", self.now, phase))

    def abort_all(self, reason):
        self.calls.append(("abort_all", self.now))

    def request_exit(self, code, phase, reason):
        self.calls.append(("request_exit", self.now, phase))

    def hard_exit(self, code, phase, reason):
        self.calls.append(("hard_exit", self.now, code, phase))
        raise Exited(reason)

    def kinds(self):
        return [c[0] for c in self.calls if c[0] != "probe"]


SHORT = WatchdogSettings(probe_interval_s=0.2, probe_interval_loading_s=2.0, fail_tolerance=2,
                         abort_grace_s=1.5, lease_stale_s=3.0, progress_stall_s=5.0,
                         signal_clear_timeout_s=1.0)


def run_for(rank: FakeRank, wd: Watchdogs, seconds: float, event=None) -> None:
    """Tick the thread on the fake clock; `event(now)` may change the world."""
    end = rank.now + seconds
    while rank.now < end:
        if event:
            event(rank.now)
        rank.sleep(wd.tick())


def make(rank: FakeRank, settings=SHORT, leave_wait_s=2.0) -> Watchdogs:
    return Watchdogs(rank, settings, clock=rank.clock, sleep=rank.sleep,
                     leave_wait_s=leave_wait_s)


def test_thread_stopped_peer_aborts_then_exits_peer_lost_within_the_bound():
    rank = FakeRank()
    rank.active, rank._busy = 3, "step 7"  # rank 0 is stuck inside the collective
    wd = make(rank)
    run_for(rank, wd, 2.0)
    assert rank.kinds() == []
    stopped_at = rank.now
    rank.responsive[1] = False  # SIGSTOP

    def progress(now):
        rank.step += 0  # no progress, but the stall timeout (5 s) is longer than the grace
    with pytest.raises(Exited):
        run_for(rank, wd, 30.0, progress)
    assert rank.kinds() == ["abort_all", "mark", "abort_all", "hard_exit"]
    abort = next(c for c in rank.calls if c[0] == "abort_all")
    hard = rank.calls[-1]
    assert hard[2:] == (1, "peer_lost")
    assert abort[1] - stopped_at <= 3 * SHORT.probe_interval_s + 1e-9  # 2 failed rounds
    assert hard[1] - stopped_at <= SHORT.abort_grace_s + 4 * SHORT.probe_interval_s
    assert ("request_exit",) not in [c[:1] for c in rank.calls]  # busy: straight out


def test_thread_abort_then_recover_keeps_running():
    rank = FakeRank()
    rank.active = 2
    wd = make(rank)
    run_for(rank, wd, 1.0)
    rank.responsive[1] = False
    run_for(rank, wd, 1.0)  # detected, abort stage, still within the 1.5 s grace
    assert rank.kinds() == ["abort_all"]
    rank.responsive[1] = True  # SIGCONT
    rank.step += 1
    run_for(rank, wd, 20.0, lambda now: setattr(rank, "step", rank.step + 1))
    assert rank.kinds() == ["abort_all"] and wd.ended is None
    probes = [c for c in rank.calls if c[0] == "probe"]
    assert len(probes) >= 20 / SHORT.probe_interval_s - 2  # still probing


def test_thread_single_rank_has_no_peer_watchdog_and_never_fires():
    rank = FakeRank(world_size=1)
    wd = make(rank)
    assert wd.peer is None and wd.rank0 is None
    run_for(rank, wd, 600.0)
    assert rank.calls == []


def test_thread_probes_slowly_while_loading_and_fast_once_loaded():
    rank = FakeRank(fast=False)
    wd = make(rank)
    run_for(rank, wd, 10.0)
    loading = len([c for c in rank.calls if c[0] == "probe"])
    rank._fast = True
    run_for(rank, wd, 10.0)
    serving = len([c for c in rank.calls if c[0] == "probe"]) - loading
    assert 4 <= loading <= 6 and 45 <= serving <= 51


def test_thread_launcher_gone_marks_aborts_asks_main_then_exits():
    rank = FakeRank(world_size=1)
    rank.active = 1
    rank.lease = 0.0
    wd = make(rank)

    def leases(now):
        if now < 5.0:
            rank.lease = now  # renewed until the supervisor dies at t=5
    with pytest.raises(Exited):
        run_for(rank, wd, 30.0, lambda now: (leases(now), setattr(rank, "step", rank.step + 1)))
    assert rank.kinds() == ["mark", "abort_all", "request_exit", "hard_exit"]
    mark, req, hard = rank.calls[0], rank.calls[2], rank.calls[3]
    assert mark[2] == "launcher_lost" and hard[2:] == (1, "launcher_lost")
    assert 5.0 + 3.0 < mark[1] <= 5.0 + 3.0 + 0.6  # stale after 3 s
    assert hard[1] - req[1] >= 2.0  # the main thread was given leave_wait_s
    rank2 = FakeRank(world_size=1)
    wd2 = make(rank2)
    rank2.gone = "parent 7 gone"
    with pytest.raises(Exited):
        wd2.tick()
    assert rank2.kinds()[0] == "mark" and rank2.calls[0][2] == "launcher_lost"
    # Inside a step the main thread is still asked (the step ends); inside distributed
    # init or the load it is not (it may never come back): straight out.
    for busy, kinds in (("step 3", ["mark", "abort_all", "request_exit", "hard_exit"]),
                        ("distributed init", ["mark", "abort_all", "hard_exit"])):
        r = FakeRank(world_size=1)
        r._busy, r.gone = busy, "parent 7 gone"
        with pytest.raises(Exited):
            make(r).tick()
        assert r.kinds() == kinds


def test_thread_progress_stall_fails_without_asking_the_stuck_main_thread():
    rank = FakeRank(world_size=1)
    wd = make(rank)
    run_for(rank, wd, 100.0)  # idle: nothing
    rank.active = 1
    run_for(rank, wd, 3.0, lambda now: setattr(rank, "step", rank.step + 1))
    blocked_at = rank.now
    with pytest.raises(Exited):
        run_for(rank, wd, 30.0)
    assert rank.kinds() == ["mark", "hard_exit"]  # no abort stage, no request to leave
    assert rank.calls[0][2] == "failed"
    took = rank.calls[-1][1] - blocked_at
    assert SHORT.progress_stall_s - 1e-6 <= took <= SHORT.progress_stall_s + 0.6


def test_thread_follower_loses_a_silent_rank_0_and_survives_a_short_silence():
    rank = FakeRank(leader=False)
    wd = make(rank)

    def pings(until):
        return lambda now: setattr(rank, "ping_at", now) if now < until else None
    run_for(rank, wd, 5.0, pings(5.0))
    run_for(rank, wd, 1.0)  # a short silence: suspect at most
    run_for(rank, wd, 5.0, pings(1e9))
    assert rank.kinds() == [] and wd.ended is None
    silent_at = rank.now
    with pytest.raises(Exited):
        run_for(rank, wd, 30.0)
    assert rank.kinds() == ["mark", "abort_all", "request_exit", "hard_exit"]
    lost = rank.calls[0][1] - silent_at
    limit = (SHORT.fail_tolerance + 1) * SHORT.probe_interval_s + SHORT.abort_grace_s
    assert limit - 1e-6 <= lost <= limit + 0.2


def test_thread_does_not_blame_peers_for_its_own_suspension():
    rank = FakeRank()
    rank.active, rank.lease = 1, 0.0
    wd = make(rank)
    run_for(rank, wd, 1.0, lambda now: (setattr(rank, "lease", now),
                                        setattr(rank, "step", rank.step + 1)))
    rank.now += 60.0  # this process was SIGSTOPped for a minute: nothing moved meanwhile
    run_for(rank, wd, 1.0, lambda now: (setattr(rank, "lease", now),
                                        setattr(rank, "step", rank.step + 1)))
    assert rank.kinds() == []


# -- stream ledger ---------------------------------------------------------------------


def test_ledger_ends_every_open_stream_once_and_drops_what_follows():
    led = StreamLedger()
    assert led.on_generate(b"a", Generate("r1", [1, 2, 3], 8)) is None
    assert led.on_generate(b"b", Generate("r2", [4], 8)) is None
    dup = led.on_generate(b"c", Generate("r1", [9], 8))
    assert dup.finish_reason == "error" and "duplicate" in dup.error
    assert led.on_send(Tokens("r1", [7, 8], 0)) and led.on_send(Tokens("r1", [9], 2))
    finals = dict(led.end_all("abort", "peer lost: rank 1"))
    assert finals[b"a"].index == 3 and finals[b"a"].finish_reason == "abort"
    assert finals[b"a"].prompt_tokens == 3 and finals[b"b"].index == 0
    assert led.end_all("error", "again") == []  # each stream ends once
    # The step that was in flight, then the main thread's own end: never sent.
    assert not led.on_send(Tokens("r1", [10], 3))
    again = led.on_generate(b"a", Generate("r1", [1], 4))
    assert again.finish_reason == "error" and "cancelled" in again.error
    assert not led.on_send(Tokens("r1", [], 4, finish_reason="abort"))
    assert led.on_generate(b"a", Generate("r1", [1], 4)) is None  # the id is free again
    assert led.dropped == 2
    assert led.on_send(Tokens("x", [], 0, finish_reason="error"))  # unknown: passes


# -- wiring ----------------------------------------------------------------------------


def test_parent_gone_and_the_supervisor_settings_for_ranks():
    from services.rank.guard import parent_gone
    from services.supervisor.launch import rank_settings
    from services.supervisor.settings import load

    assert parent_gone(None) is None and parent_gone(1) is None  # nothing to watch
    assert parent_gone(os.getppid()) is None
    assert "re-parented" in parent_gone(os.getppid() + 100000)
    s = load(env={"LOCKSTEP_PEER_ABORT_GRACE": "2", "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "30",
                  "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "4", "LOCKSTEP_LEASE_TTL": "9"})
    r = rank_settings(s)
    assert (r.peer_abort_grace_s, r.progress_stall_s, r.signal_clear_timeout_s,
            r.lease_stale_s) == (2.0, 30.0, 4.0, 9.0)
    d = rank_settings(load(env={}))
    assert (d.peer_abort_grace_s, d.progress_stall_s, d.signal_clear_timeout_s) == \
        (5.0, 120.0, 10.0)
