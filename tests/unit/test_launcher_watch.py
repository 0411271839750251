"""The launcher watch's decisions (common/launcher_watch.py): every clock and every
observation passed in."""

from __future__ import annotations

import os

import pytest

from common.launcher_watch import (
    LAUNCHER_ENV,
    Action,
    LauncherLease,
    LauncherWatch,
    LauncherWatchError,
    WatchSettings,
    launcher_gone,
    launcher_value,
    parse_launcher,
    watch_launcher,
)
from common.procs import ProcessIdentity, identify

S = WatchSettings(interval_s=0.5, resend_s=5.0, hard_exit_s=60.0)
UP = ProcessIdentity(4242, 1234.56, ("python", "-m", "services", "up"))


def test_the_value_round_trips_and_bad_values_are_refused():
    assert parse_launcher(launcher_value(UP)) == (4242, 1234.56)
    for bad in ("", "4242", "x:1.0", "4242:soon", "1:5.0", "0:5.0", "-3:5.0"):
        with pytest.raises(LauncherWatchError):
            parse_launcher(bad)


def test_the_lease_holds_while_the_launcher_lives_then_stops_resends_and_exits_hard():
    lease = LauncherLease(S)
    assert [lease.check(t, None) for t in (0.0, 100.0, 1e6)] == [None, None, None]
    assert lease.wait(1e6) == 0.5
    assert lease.check(1000.0, "gone") is Action.STOP
    assert lease.reason == "gone"
    assert lease.check(1004.9, None) is None  # once gone, gone: a later "alive" changes nothing
    assert lease.check(1005.0, None) is Action.RESEND
    assert lease.check(1009.0, None) is None
    assert lease.check(1010.0, None) is Action.RESEND
    assert lease.wait(1059.8) == pytest.approx(0.2)  # wakes for the hard-exit deadline
    assert lease.check(1060.0, None) is Action.HARD_EXIT
    assert lease.check(1061.0, None) is Action.HARD_EXIT


def test_gone_means_re_parented_or_the_identity_no_longer_runs():
    alive = {UP: True}
    assert launcher_gone(UP, 4242, getppid=lambda: 4242, alive=alive.get) is None
    assert "re-parented to pid 1" in launcher_gone(UP, 4242, getppid=lambda: 1, alive=alive.get)
    assert "has exited" in launcher_gone(UP, None, getppid=lambda: 1, alive=lambda i: False)
    # not our parent: getppid is not consulted
    assert launcher_gone(UP, None, getppid=lambda: 1, alive=alive.get) is None


def test_the_watch_thread_acts_on_each_verdict_once():
    now, calls = [0.0], []
    observations = iter([None, "exited"])
    w = LauncherWatch("svc", UP, None, settings=S, clock=lambda: now[0],
                      gone=lambda: next(observations), stop=lambda: calls.append("stop"),
                      hard_exit=lambda: calls.append("hard"))
    for t in (0.0, 0.5, 1.0, 5.9, 6.0, 30.0, 60.5):
        now[0] = t
        w.tick()
    assert calls == ["stop", "stop", "stop", "hard"]  # no observation once it is gone


def test_watch_launcher_takes_the_variable_so_nothing_started_later_inherits_it():
    env = {"OTHER": "1"}
    assert watch_launcher("svc", env) is None
    env[LAUNCHER_ENV] = "nonsense"
    with pytest.raises(LauncherWatchError):
        watch_launcher("svc", env)
    assert LAUNCHER_ENV not in env
    me = identify(os.getpid())
    env[LAUNCHER_ENV] = launcher_value(me)  # we are not our own parent: the lease only
    w = watch_launcher("svc", env, settings=WatchSettings(interval_s=3600))
    try:
        assert w is not None and w.launcher == me and w.parent_pid is None
        assert LAUNCHER_ENV not in env and env == {"OTHER": "1"}
        assert w.lease.lost_at is None
    finally:
        w.close()
