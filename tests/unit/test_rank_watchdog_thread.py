"""The thread that acts on the watchdogs' verdicts (services/rank/watchdog_thread.py), on a fake
rank and a fake clock: abort stages, exits and their bounds, probing rates, and the
wiring of the supervisor's settings into the ranks'."""

from __future__ import annotations

import dataclasses
import os

import pytest

from services.rank.watchdog_thread import Watchdogs
from services.rank.watchdogs import Inside, WatchdogSettings, Where

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

    def where(self):
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

    def peers_ok(self, ok):
        self.calls.append(("peers_ok", self.now, ok))

    def request_exit(self, code, phase, reason):
        self.calls.append(("request_exit", self.now, phase))

    def hard_exit(self, code, phase, reason):
        self.calls.append(("hard_exit", self.now, code, phase))
        raise Exited(reason)

    def kinds(self):
        return [c[0] for c in self.calls if c[0] not in ("probe", "peers_ok")]

    def peers_ok_seen(self):
        return [c[2] for c in self.calls if c[0] == "peers_ok"]


SHORT = WatchdogSettings(peer_probe_interval_s=0.2, peer_probe_interval_loading_s=2.0, peer_fail_tolerance=2,
                         peer_abort_grace=1.5, lease_ttl=3.0, progress_stall_timeout=5.0,
                         signal_clear_timeout=1.0)


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
    rank.active, rank._busy = 3, Where(Inside.STEP, 7)  # stuck inside the collective
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
    assert abort[1] - stopped_at <= 3 * SHORT.peer_probe_interval_s + 1e-9  # 2 failed rounds
    assert hard[1] - stopped_at <= SHORT.peer_abort_grace + 4 * SHORT.peer_probe_interval_s
    assert ("request_exit",) not in [c[:1] for c in rank.calls]  # busy: straight out


def test_thread_abort_then_recover_keeps_running():
    rank = FakeRank()
    rank.active = 2
    wd = make(rank)
    run_for(rank, wd, 1.0)
    rank.responsive[1] = False
    run_for(rank, wd, 1.0)  # detected, abort stage, still within the 1.5 s grace
    assert rank.kinds() == ["abort_all"] and rank.peers_ok_seen() == [False]
    first = [c[0] for c in rank.calls if c[0] in ("peers_ok", "abort_all")][:2]
    assert first == ["peers_ok", "abort_all"]  # never "ok" after the abort was posted
    rank.responsive[1] = True  # SIGCONT
    rank.step += 1
    run_for(rank, wd, 20.0, lambda now: setattr(rank, "step", rank.step + 1))
    assert rank.kinds() == ["abort_all"] and wd.ended is None
    assert rank.peers_ok_seen() == [False, True]  # STATS says so: its aborts may resume
    probes = [c for c in rank.calls if c[0] == "probe"]
    assert len(probes) >= 20 / SHORT.peer_probe_interval_s - 2  # still probing


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
    for busy, kinds in ((Where(Inside.STEP, 3), ["mark", "abort_all", "request_exit", "hard_exit"]),
                        (Where(Inside.DISTRIBUTED_INIT), ["mark", "abort_all", "hard_exit"])):
        r = FakeRank(world_size=1)
        r._busy, r.gone = busy, "parent 7 gone"
        with pytest.raises(Exited):
            make(r).tick()
        assert r.kinds() == kinds


def test_thread_orphaned_rank_serves_on_through_the_adopt_window():
    adopting = dataclasses.replace(SHORT, adopt_window_s=4.0, lease_ttl=45.0)
    rank = FakeRank(world_size=1)
    rank.lease = 0.0
    rank.gone = "parent 7 gone"  # the supervisor was killed at t=0
    wd = make(rank, adopting)

    def restarted(now):  # a restarted supervisor re-authenticates and leases from t=2
        if now >= 2.0:
            rank.lease = now
    run_for(rank, wd, 30.0, restarted)  # never lost: adopted, and the leases go on
    assert rank.kinds() == [] and wd.launcher.adopted
    orphan = FakeRank(world_size=1)
    orphan.lease, orphan.gone = 0.0, "parent 7 gone"
    wd2 = make(orphan, adopting)
    with pytest.raises(Exited):
        run_for(orphan, wd2, 30.0)  # nobody adopts it
    mark = orphan.calls[0]
    assert mark[2] == "launcher_lost" and 4.0 <= mark[1] <= 4.0 + 0.6


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
    assert SHORT.progress_stall_timeout - 1e-6 <= took <= SHORT.progress_stall_timeout + 0.6


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
    lost = next(c for c in rank.calls if c[0] == "mark")[1] - silent_at
    limit = (SHORT.peer_fail_tolerance + 1) * SHORT.peer_probe_interval_s + SHORT.peer_abort_grace
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


# -- wiring ----------------------------------------------------------------------------


def test_parent_gone_and_the_supervisor_settings_for_ranks():
    from services.rank.watchdog_thread import parent_gone
    from services.supervisor.job_launch import rank_settings
    from services.supervisor.settings import load

    assert parent_gone(None) is None and parent_gone(1) is None  # nothing to watch
    assert parent_gone(os.getppid()) is None
    assert "re-parented" in parent_gone(os.getppid() + 100000)
    s = load(env={"LOCKSTEP_PEER_ABORT_GRACE": "2", "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "30",
                  "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "4", "LOCKSTEP_LEASE_TTL": "9"})
    r = rank_settings(s)
    assert (r.peer_abort_grace, r.progress_stall_timeout, r.signal_clear_timeout,
            r.lease_ttl) == (2.0, 30.0, 4.0, 9.0)
    d = rank_settings(load(env={}))
    assert (d.peer_abort_grace, d.progress_stall_timeout, d.signal_clear_timeout) == \
        (5.0, 120.0, 10.0)


def test_a_follower_starting_to_serve_measures_silence_at_the_fast_rate_from_then_on():
    """Seen in CI: rank 0 probes at the loading rate while it warms up (1.15 s under load);
    the follower, serving a moment later, expects the fast rate. The silence before the
    switch must not count against the fast limit (0.6 s): it used to, and with no abort
    grace the follower left `peer_lost` 0.3 s after it began serving."""
    rank = FakeRank(leader=False, fast=False)
    settings = dataclasses.replace(SHORT, peer_abort_grace=0.0)
    wd = make(rank, settings)
    rank.ping_at = 0.0  # rank 0's last loading-rate probe
    run_for(rank, wd, 1.2)  # it warms up: no probe, within the loading limit (6 s)
    rank._fast = True  # SERVE: fast probes expected from now on
    run_for(rank, wd, 0.3, lambda now: None)  # the first fast probe is on its way
    assert rank.kinds() == [] and wd.ended is None
    run_for(rank, wd, 2.0, lambda now: setattr(rank, "ping_at", now))  # probes flow
    assert rank.kinds() == [] and wd.ended is None
    with pytest.raises(Exited):  # and a real silence is still caught at the fast limit
        run_for(rank, wd, 5.0)
