"""One supervisor per state home.

Two supervisors on one $LOCKSTEP_HOME would overwrite each other's runtime file and
race over the same manifests. The guard is an exclusive flock on `runtime/supervisor.lock`,
held for the supervisor's lifetime: the kernel drops it when the process dies, however
it dies, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os

from common.atomic_json import StateFileError
from common.home import Paths, read_supervisor_record


class SupervisorBusy(Exception):
    """Another live supervisor holds this home."""


def hold_home_lock(paths: Paths) -> int:
    """The lock's fd (keep it open: closing it releases the lock), or SupervisorBusy."""
    path = paths.runtime / "supervisor.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SupervisorBusy(f"another supervisor is running for {paths.home}{_who(paths)}; "
                             "stop it first, or give this one another --home") from None
    return fd


def _who(paths: Paths) -> str:
    try:
        info = read_supervisor_record(paths.supervisor_file)
    except StateFileError:  # the lock is the evidence; the file only names the holder
        return ""
    return f" (pid {info.pid}, admin {info.admin})"
