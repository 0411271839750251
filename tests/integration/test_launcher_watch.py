"""A service watching its launcher (common/launcher_watch.py), with real processes and
real signals: the lease alone (launcher not our parent), the parent-death signal alone
(lease too slow to matter), a launcher already gone when the watch starts, and the hard
exit of a service that ignores SIGTERM."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.launcher_watch import EXIT_LAUNCHER_GONE, LAUNCHER_ENV, launcher_value
from common.procs import identify, signal_identity
from tests.gwutil import poll_until
from tests.support.processes import process_gone

ROOT = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, "-m", "tests.fakes.launcher_child"]


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the child prints, within `timeout` (never a blocking read)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    return proc.stdout.readline().decode().strip()


def _serve(launcher_value_: str | None, *args: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(LAUNCHER_ENV, None)
    if launcher_value_ is not None:
        env[LAUNCHER_ENV] = launcher_value_
    return subprocess.Popen([*CHILD, "serve", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            start_new_session=True)


def _gone_launcher() -> str:
    """LOCKSTEP_LAUNCHER naming a process that has exited."""
    p = subprocess.Popen(["sleep", "600"])
    value = launcher_value(identify(p.pid))
    p.kill()
    p.wait()
    return value


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_the_lease_stops_a_service_whose_launcher_is_not_its_parent():
    launcher = subprocess.Popen(["sleep", "600"])
    child = _serve(launcher_value(identify(launcher.pid)), "0.1", "5", "30", "handle")
    try:
        assert _line(child, 30) == "watching"
        time.sleep(0.3)  # a few lease checks while the launcher lives: nothing happens
        assert child.poll() is None
        launcher.kill()
        launcher.wait()
        assert _line(child, 5) == "term"
        assert child.wait(5) == 0
    finally:
        _stop(launcher)
        _stop(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_the_parent_death_signal_alone_stops_the_service_when_its_launcher_is_sigkilled():
    # lease checks an hour apart: only the kernel's signal can end the child in time
    launcher = subprocess.Popen([*CHILD, "launch", "3600", "3600", "3600", "handle"], cwd=ROOT,
                                stdout=subprocess.PIPE, start_new_session=True)
    child = None
    try:
        pid = int(_line(launcher, 30))
        child = identify(pid)
        assert child is not None
        assert _line(launcher, 30) == "watching"
        launcher.kill()
        launcher.wait()
        poll_until(lambda: process_gone(child.pid, child.start_time), 5,
                   "the child to stop on its parent-death signal")
    finally:
        _stop(launcher)
        if child is not None:
            signal_identity(child, signal.SIGKILL)


def test_a_launcher_gone_before_the_watch_starts_stops_the_service_at_once():
    child = _serve(_gone_launcher(), "3600", "3600", "3600", "handle")
    try:
        assert _line(child, 30) == "term"  # from the first check, before "watching"
        assert child.wait(5) == 0
    finally:
        _stop(child)


def test_a_service_that_ignores_sigterm_exits_hard_after_the_deadline():
    child = _serve(_gone_launcher(), "0.1", "0.2", "1.0", "ignore")
    try:
        assert _line(child, 30) == "watching"
        started = time.monotonic()
        assert child.wait(10) == EXIT_LAUNCHER_GONE
        assert time.monotonic() - started < 5
    finally:
        _stop(child)


def test_no_launcher_nothing_to_watch():
    child = _serve(None, "0.1", "0.2", "1.0", "handle")
    try:
        assert _line(child, 30) == "nothing to watch"
        child.send_signal(signal.SIGTERM)
        assert child.wait(5) == 0
    finally:
        _stop(child)
