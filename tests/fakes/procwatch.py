"""Evidence helpers for process tests: poll with deadlines, judge exits with psutil.
The helpers themselves live in tests/support; this module keeps the names the process
tests import."""

from __future__ import annotations

from pathlib import Path

from tests.support.polling import wait_for as poll_for
from tests.support.ports import free_port
from tests.support.processes import process_gone, process_running

__all__ = ["free_port", "poll_file", "poll_for", "process_gone", "process_running"]


def poll_file(path: Path, needle: str, timeout: float) -> str:
    """Wait until `path` contains `needle`; returns the first line holding it."""
    def find() -> str | None:
        try:
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return None
        return next((ln for ln in text.splitlines() if needle in ln), None)
    return poll_for(f"{needle!r} in {path}", find, timeout)
