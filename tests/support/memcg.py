"""A kernel memory limit around a running process, for tests that prove a memory bound
with the kernel's own enforcement (the OOM killer), not a count of our own.

cgroup v2 is used where its memory controller is enabled (`memory` in the unified
hierarchy's cgroup.controllers); else cgroup v1's memory controller. This machine's
kernel exposes memory only through v1 (its unified hierarchy has `hugetlb` alone), so the
v1 path is the one exercised here; the v2 path follows the kernel's documented files
(memory.max, memory.peak, memory.events) and is untested here.

A process moved in keeps the charges of what it allocated before (neither v2 nor this
kernel's v1 moves them: move_charge_at_immigrate is refused), so the limit bounds what it
allocates *after* the move: for a rank moved in when idle, idle RSS + the limit.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2_CANDIDATES = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


def _v2_root() -> Path | None:
    for root in V2_CANDIDATES:
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return root
    return None


def unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None."""
    if os.geteuid() != 0:
        return "memory cgroups need root"
    if _v2_root() is None and not (V1 / "memory.limit_in_bytes").exists():
        return "neither cgroup v2 nor v1 has a memory controller mounted"
    return None


class MemCgroup:
    """One cgroup with a memory limit: `add(pid)`, then `peak()` and `oom_kills()`."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        v2 = _v2_root()
        self.v2 = v2 is not None
        self.path = (v2 if v2 is not None else V1) / name
        if self.path.exists():
            self._evacuate()
            self.path.rmdir()
        self.path.mkdir()
        self._write("memory.max" if self.v2 else "memory.limit_in_bytes", str(limit_bytes))
        if self.v2:
            self._write("memory.swap.max", "0")  # else v2 swaps instead of killing

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def peak(self) -> int:
        """The most the cgroup's processes held at once since they were moved in."""
        return int(self._read("memory.peak" if self.v2 else "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit."""
        for line in self._read("memory.events" if self.v2 else "memory.oom_control") \
                .splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise RuntimeError(f"{self.path}: no oom_kill count")

    def _evacuate(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                parent.write_text(pid)

    def close(self) -> None:
        """Move what is left to the parent and remove the cgroup."""
        if self.path.exists():
            self._evacuate()
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def __enter__(self) -> MemCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
