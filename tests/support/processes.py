"""Processes as tests see them from outside: exits judged with psutil (a zombie has
exited: PID 1 here does not reap orphans), the environment for a `python -m services.*`
child, and stopping a child's whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from common import ports
from common.procs import START_TIME_TOLERANCE, start_time_of
from tests.support.ports import TEST_RANGE_ENV

REPO = Path(__file__).resolve().parents[2]


def process_gone(pid: int, start_time: float | None = None) -> bool:
    """True if `pid` no longer runs: no such pid, a zombie (exited, not reaped), or,
    given `start_time`, the pid now belongs to a process started at another time."""
    try:
        p = psutil.Process(pid)
        if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return True
        return start_time is not None and abs(start_time_of(p) - start_time) > START_TIME_TOLERANCE
    except psutil.NoSuchProcess:
        return True


def process_running(pid: int) -> bool:
    return not process_gone(pid)


def netns_of(pid: int) -> str:
    """The name of the network namespace `pid` runs in ("" in the root namespace)."""
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True, timeout=10).stdout.strip()


# LOCKSTEP_* settings a child keeps: the port slice of this worker (tests/conftest.py:
# else a supervisor it starts could hand a rank a port the test drew) and where the model
# wheel is cached; any other is the caller's shell, not the test's.
INHERITED = frozenset({ports.RANGE_ENV, TEST_RANGE_ENV, "LOCKSTEP_CACHE"})


def lockstep_env(home: Path | None = None, **extra: str) -> dict[str, str]:
    """This environment without any LOCKSTEP_* setting but INHERITED, the repository on
    PYTHONPATH, LOCKSTEP_HOME if given, then `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LOCKSTEP_") or k in INHERITED}
    env["PYTHONPATH"] = str(REPO)
    if home is not None:
        env["LOCKSTEP_HOME"] = str(home)
    env.update(extra)
    return env


def reaper_once(home: Path, *args: str, timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`lockstep reaper --once --json` on `home`: one reap pass, its report on stdout."""
    return subprocess.run([sys.executable, "-m", "services.reaper", "--home", str(home),
                           "--once", "--json", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """Ctrl-C for a child leading its own session: SIGINT, then (if it has not exited
    within `timeout`) SIGKILL to its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (reaching anything it spawned), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
