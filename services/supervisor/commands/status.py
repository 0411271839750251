"""status — the supervisor, every deployment, the cancel epoch, bus rejections and the
last reap report.

    request  {}
    reply    {supervisor: {pid, boot_id, uptime_s, home, endpoints},
              deployments: [DeploymentInfo], cancel_epoch,
              rejections: [{service, socket, reason, count}], reaper: ReapReport|null}
    CLI      lockstep admin status [--json]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.envelope import BOOT_ID, REGISTRY


@dataclass
class Args:
    pass


async def run(sup, args: Args) -> dict:
    sk = sup.sockets
    return {
        "supervisor": {"pid": sup.me.pid, "boot_id": BOOT_ID,
                       "uptime_s": round(time.time() - sup.started_at, 3),
                       "home": str(sup.paths.home),
                       "endpoints": {"admin": sk.admin_endpoint, "events": sk.events_endpoint,
                                     "control": sk.control_endpoint,
                                     "report": sk.report_endpoint}},
        "deployments": [d.to_wire() for d in sup.deployments.values()],
        "cancel_epoch": sup.epochs.current,
        "rejections": REGISTRY.snapshot(),
        "reaper": sup.last_reap,
    }
