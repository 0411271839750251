"""The reaper's side of adoption (docs/supervisor.md "Adoption", docs/reaper.md): a launch
whose supervisor is dead is left alone while the `lockstep up` that restarts supervisors
lives and its adoption window is open, so a restarted supervisor can adopt it instead.

    no runtime/adoption.json, or its `up` is gone (pid + start time)  → reap as before
    restarting_until set and not past                                 → wait
    the service saw the launch orphaned less than window_s ago        → wait
    otherwise                                                         → reap

The first rule of "wait" is what `up` writes the moment it sees its supervisor die; the
second covers the moments before that (the periodic reaper's own memory of when it
first saw each launch orphaned; `reaper --once` has none, and reaps once the record's
deadline is past or unset). Decisions take `now`.
"""

from __future__ import annotations

import logging

from common.atomic_json import StateFileError
from common.home import Paths, live_adoption_record, read_adoption_record
from common.records import AdoptionRecord

log = logging.getLogger("lockstep.reaper")


def live_record(paths: Paths) -> AdoptionRecord | None:
    """The adoption record while its `up` runs (an unreadable one is logged, and holds
    nothing back)."""
    try:
        read_adoption_record(paths.adoption_file)
    except (StateFileError, OSError) as exc:
        log.error("adoption record unreadable, ignored: %s", exc)
        return None
    return live_adoption_record(paths.adoption_file)


class AdoptionWindow:
    """Which orphaned launches wait for a restarted supervisor; `seen` is the periodic
    reaper's memory of when each job was first seen orphaned (None: `--once`)."""

    def __init__(self, seen: dict[str, float] | None = None) -> None:
        self.seen = seen

    def waits(self, record: AdoptionRecord | None, job_id: str, now: float,
              wall: float) -> str | None:
        """Why `job_id` is left alone this pass, or None to reap it. `now` monotonic,
        `wall` wall-clock (the record's deadline is wall-clock: another process wrote it)."""
        if record is None:
            return None
        if record.restarting_until is not None and wall < record.restarting_until:
            return (f"lockstep up (pid {record.up_pid}) is restarting its supervisor: "
                    f"adoption window open for {record.restarting_until - wall:.1f}s more")
        if self.seen is None:
            return None
        first = self.seen.setdefault(job_id, now)
        if now - first < record.window_s:
            return (f"orphaned {now - first:.1f}s ago; lockstep up (pid {record.up_pid}) "
                    f"restarts supervisors (adoption window {record.window_s:g}s)")
        return None

    def forget(self, live_jobs: set[str]) -> None:
        """Drop the memory of jobs no longer orphaned (adopted, or gone)."""
        if self.seen is not None:
            for job in set(self.seen) - live_jobs:
                del self.seen[job]
