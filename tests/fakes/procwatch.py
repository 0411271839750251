"""Evidence helpers for process tests: poll with deadlines, judge exits with psutil."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from common.procs import START_TIME_TOLERANCE, start_time_of


def poll_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """Call `check` until it returns something truthy; AssertionError naming `what`."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def poll_file(path: Path, needle: str, timeout: float) -> str:
    """Wait until `path` contains `needle`; returns the first line holding it."""
    def find() -> str | None:
        try:
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return None
        return next((ln for ln in text.splitlines() if needle in ln), None)
    return poll_for(f"{needle!r} in {path}", find, timeout)


def process_gone(pid: int, start_time: float | None = None) -> bool:
    """True if `pid` no longer runs: no such pid, a zombie (exited, not reaped: PID 1
    here does not reap orphans), or the pid now belongs to a process started later."""
    try:
        p = psutil.Process(pid)
        if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return True
        return start_time is not None and abs(start_time_of(p) - start_time) > START_TIME_TOLERANCE
    except psutil.NoSuchProcess:
        return True


def process_running(pid: int) -> bool:
    return not process_gone(pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
