"""status — the supervisor, every deployment, the cancel epoch, bus rejections and the
last reap report.

    request  {}
    reply    {supervisor: {pid, boot_id, uptime_s, home, endpoints},
              deployments: [DeploymentInfo], cancel_epoch,
              rejections: [{service, socket, reason, count}], reaper: ReapReport|null,
              events: [Event]}
             events: the last events published (deployment state changes with their
             teardown outcome, incidents, reaps), oldest first (the supervisor's journal)
             rejections: the supervisor's own sockets (service "supervisor"), plus what every
             rank reported in telemetry, summed over ranks (service "rank"; per rank in
             deployments[].ranks[].rejects)
    CLI      lockstep admin status [--json]; `lockstep admin watch` redraws it every second
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages.commands.status_record import (  # noqa: F401 - the reply's parts
    Endpoints,
    Rejection,
    Restarts,
    StatusRecord,
    SupervisorInfo,
)
from common.messages.commands.status_text import render


@dataclass
class Args:
    pass


@dataclass(frozen=True)
class Reply(StatusRecord):
    def render(self, *, now: float | None = None,
               prev: dict[tuple, tuple[int, float]] | None = None) -> str:
        """As text; `prev` (watch): the last reply's `steps()`, for each rank's steps/s."""
        return render(self, now=now, prev=prev)

    def steps(self) -> dict[tuple, tuple[int, float]]:
        """(deployment, rank, pid) -> (step, last_seen): the next render's rate baseline."""
        return {(d.deployment_id, r.rank, r.pid): (r.step, r.last_seen)
                for d in self.deployments for r in d.ranks}
