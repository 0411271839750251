"""ping — liveness of the supervisor.

    request  {}
    reply    {pid, boot_id, version}
    CLI      lockstep admin ping
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Args:
    pass


@dataclass(frozen=True)
class Reply:
    pid: int
    boot_id: str
    version: str

    def render(self) -> str:
        return f"supervisor pid {self.pid} (boot {self.boot_id}, version {self.version})"
