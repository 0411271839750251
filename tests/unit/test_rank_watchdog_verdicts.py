"""The rank watchdogs' decisions (services/rank/watchdogs.py) on a fake clock: settings,
the peer watchdog (rank 0), the leader watchdog (followers), the launcher and progress
watchdogs. No real seconds, no processes: tests/unit/test_rank_watchdog_thread.py drives
the thread that acts on these verdicts, tests/e2e/test_rank_watchdogs.py the real ranks."""

from __future__ import annotations

import pytest

from common.rankspec import RankSettings
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
    s = RankSettings(peer_abort_grace=3.0, progress_stall_timeout=60.0, signal_clear_timeout=4.0,
                     peer_probe_interval_s=0.2, lease_ttl=9.0)
    w = WatchdogSettings.resolve(s, {})
    assert (w.peer_abort_grace, w.progress_stall_timeout, w.signal_clear_timeout) == (3.0, 60.0, 4.0)
    assert (w.peer_probe_interval_s, w.lease_ttl, w.peer_fail_tolerance) == (0.2, 9.0, 2)
    w = WatchdogSettings.resolve(s, {"LOCKSTEP_PEER_ABORT_GRACE": "0",
                                     "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "2.5",
                                     "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "1", "OTHER": "x"})
    assert (w.peer_abort_grace, w.progress_stall_timeout, w.signal_clear_timeout) == (0.0, 2.5, 1.0)
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
    wd = LauncherWatchdog(lease_ttl=45.0)
    assert wd.check(1e6, None, None) is None  # a lease never seen is not stale
    assert wd.check(100.0, None, 60.0) is None
    v = wd.check(105.1, None, 60.0)
    assert v.what == "launcher_lost" and "lease" in v.reason
    assert wd.check(0.0, "parent 42 gone", None).reason == "parent 42 gone"
    wd.rebase(200.0)  # this rank was stopped: leases queued meanwhile are on their way
    assert wd.check(210.0, None, 60.0) is None
    assert LauncherWatchdog(lease_ttl=0).check(1e9, None, 0.0) is None  # off


GONE = "the launcher (parent pid 42) is gone; re-parented to pid 1"


def test_launcher_watchdog_adopt_window_zero_is_lost_at_once():
    wd = LauncherWatchdog(lease_ttl=45.0, adopt_window=0.0)
    v = wd.check(10.0, GONE, 9.0)
    assert v.what == "launcher_lost" and v.reason == GONE


def test_launcher_watchdog_orphaned_without_adoption_is_lost_at_exactly_the_window():
    wd = LauncherWatchdog(lease_ttl=45.0, adopt_window=20.0)
    assert wd.check(99.0, None, 98.0) is None  # parent alive
    v = wd.check(100.0, GONE, 98.0)  # t0: first seen gone
    assert v.what == "orphaned" and "20s" in v.reason
    assert wd.check(110.0, GONE, 98.0) is None  # serving on meanwhile
    assert wd.judge(119.99, GONE, 98.0) is None
    assert wd.check(119.99, GONE, 98.0) is None
    v = wd.check(120.0, GONE, 98.0)
    assert v.what == "launcher_lost"
    assert v.reason.startswith("supervisor (parent) gone for 20.0s and nobody adopted this "
                               "rank (adopt window 20s)")
    assert wd.judge(120.0, GONE, 98.0) == v  # another thread asking gets the same answer


def test_launcher_watchdog_adopted_inside_the_window_then_only_the_lease_counts():
    wd = LauncherWatchdog(lease_ttl=45.0, adopt_window=20.0)
    assert wd.check(100.0, GONE, 99.5).what == "orphaned"
    assert wd.check(105.0, GONE, 99.5) is None
    v = wd.check(106.0, GONE, 105.5)  # a restarted supervisor's lease, after t0
    assert v.what == "adopted" and wd.adopted
    assert wd.check(1000.0, GONE, 990.0) is None  # never lost by the parent again
    v = wd.check(1035.1, GONE, 990.0)  # but a stale lease still ends it
    assert v.what == "launcher_lost" and "no supervisor lease for 45.1s" in v.reason


def test_launcher_watchdog_a_lease_before_t0_is_not_an_adoption():
    wd = LauncherWatchdog(lease_ttl=45.0, adopt_window=5.0)
    wd.check(100.0, GONE, 100.0)  # the old supervisor's last lease, at t0 itself
    assert wd.check(105.0, GONE, 100.0).what == "launcher_lost"


def test_launcher_watchdog_lease_staleness_still_applies_inside_the_window():
    wd = LauncherWatchdog(lease_ttl=10.0, adopt_window=60.0)
    assert wd.check(100.0, GONE, 95.0).what == "orphaned"
    v = wd.check(105.5, GONE, 95.0)
    assert v.what == "launcher_lost" and "lease" in v.reason


def test_launcher_watchdog_rebase_restarts_the_adopt_window():
    wd = LauncherWatchdog(lease_ttl=0.0, adopt_window=20.0)
    wd.check(100.0, GONE, None)
    wd.rebase(500.0)  # this process was stopped: nobody could adopt it meanwhile
    assert wd.check(519.0, GONE, None) is None
    assert wd.check(520.0, GONE, None).what == "launcher_lost"


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
