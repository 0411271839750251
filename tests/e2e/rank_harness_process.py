"""Rank processes of the harness (tests/e2e/rank_harness.py): started as children of the
test or through the stand-in launcher (tests/e2e/rank_launcher.py; then not our
children, judged by psutil), signalled by process group, and proven gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import psutil

from tests.support.polling import poll_for

REPO = Path(__file__).resolve().parents[2]


def poll_until(pred, timeout: float, what: str, interval: float = 0.02):
    """`poll_for` that raises TimeoutError, as the harness's own waits do."""
    return poll_for(pred, timeout, what, interval, error=TimeoutError)


class Orphanable:
    """A rank started by the stand-in launcher: not our child, so it is judged by psutil.
    A zombie counts as exited (PID 1 may never reap it); its exit code is unknown (-1)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._proc = psutil.Process(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if self._proc.status() == psutil.STATUS_ZOMBIE:
                    self.returncode = -1
            except psutil.NoSuchProcess:
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        poll_until(lambda: self.poll() is not None, 1e9 if timeout is None else timeout,
                   f"pid {self.pid} to exit")
        return self.returncode


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def spawn_rank(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A rank as our child, leading its own session (so its group can be signalled)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def start_launcher(path: Path, plan: list[dict]) -> subprocess.Popen:
    """The stand-in launcher on a 0600 plan file; it prints the ranks' pids as one JSON
    line on its stdout."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(plan, f)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.rank_launcher", str(path)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL, start_new_session=True)


def signal_groups(procs: Iterable, sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def assert_groups_gone(procs: Iterable) -> None:
    """Every rank exited and its process group is empty (an orphan may linger as a
    zombie: its group must have no live member)."""
    for p in procs:
        p.wait(timeout=5)
        if isinstance(p, Orphanable):  # orphans may linger as zombies
            assert not group_members(p.pid), f"process group {p.pid} has members"
            continue
        try:
            os.killpg(p.pid, 0)  # the group must be empty too
            raise AssertionError(f"process group {p.pid} still has members")
        except ProcessLookupError:
            pass
