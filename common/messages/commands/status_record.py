"""The status reply's record: what the supervisor reports (status.py is the command;
status_text.py renders this record as text, so it reads these types, not the command)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.deployment_info import DeploymentInfo
from common.messages.admin import Event
from common.messages.commands.reap import ReapReport


@dataclass(frozen=True)
class Endpoints:
    admin: str
    events: str
    control: str
    report: str


@dataclass(frozen=True)
class Restarts:
    """Who restarts this supervisor if it dies (`lockstep up`'s runtime/adoption.json)."""

    up_pid: int
    supervisor_restarts: int  # at most this many within any restart_window_s (0: never)
    restart_window_s: float
    restarts: int  # made so far by this `up`
    adopt_window_s: float  # a local rank waits this long to be adopted

    def describe(self) -> str:
        if not self.supervisor_restarts:
            return (f"not restarted if it dies (lockstep up pid {self.up_pid}, "
                    "--supervisor-restarts 0)")
        return (f"if it dies, lockstep up pid {self.up_pid} restarts it: at most "
                f"{self.supervisor_restarts} within {self.restart_window_s:g}s "
                f"({self.restarts} so far), ranks wait {self.adopt_window_s:g}s to be adopted")


@dataclass(frozen=True)
class SupervisorInfo:
    pid: int
    boot_id: str
    uptime_s: float
    home: str
    endpoints: Endpoints
    restarts: Restarts | None = None  # None: no `lockstep up` restarts it


@dataclass(frozen=True)
class Rejection:
    """Messages a socket rejected, by reason (common/envelope.py's counters)."""

    service: str
    socket: str
    reason: str
    count: int


@dataclass(frozen=True)
class StatusRecord:
    supervisor: SupervisorInfo
    deployments: list[DeploymentInfo]
    cancel_epoch: int
    rejections: list[Rejection] = field(default_factory=list)
    reaper: ReapReport | None = None
    events: list[Event] = field(default_factory=list)
