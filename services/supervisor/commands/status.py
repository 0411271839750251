"""status — the supervisor, every deployment, the cancel epoch, bus rejections and the
last reap report.

Wire (Args, Reply, the CLI's flags): common/messages/commands/status.py.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from common.envelope import BOOT_ID, REGISTRY
from common.home import live_adoption_record
from common.messages.commands.status import Args

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    sk = sup.sockets
    return {
        "supervisor": {"pid": sup.me.pid, "boot_id": BOOT_ID,
                       "uptime_s": round(time.time() - sup.started_at, 3),
                       "home": str(sup.paths.home),
                       "endpoints": {"admin": sk.admin_endpoint, "events": sk.events_endpoint,
                                     "control": sk.control_endpoint,
                                     "report": sk.report_endpoint},
                       "restarts": restarts(sup)},
        "deployments": [d.to_wire(cluster_key=sup.cluster_key) for d in sup.deployments.values()],
        "cancel_epoch": sup.epochs.current,
        "rejections": REGISTRY.snapshot() + rank_rejections(sup) + [
            {"service": "supervisor", "socket": "adoption", "reason": why, "count": n}
            for why, n in sorted(sup.adoption_rejections.items())],
        "reaper": sup.last_reap,
        "events": list(sup.journal),
    }


def restarts(sup: CommandHost) -> dict | None:
    """The restart policy of the `lockstep up` that restarts this supervisor, if one runs."""
    rec = live_adoption_record(sup.paths.adoption_file)
    if rec is None:
        return None
    return {"up_pid": rec.up_pid, "supervisor_restarts": rec.supervisor_restarts,
            "restart_window_s": rec.restart_window_s, "restarts": rec.restarts,
            "adopt_window_s": rec.window_s}


def rank_rejections(sup: CommandHost) -> list[dict]:
    """Ranks' `socket.reason` counters (from telemetry) as status rows, summed over ranks."""
    total: Counter[tuple[str, str]] = Counter()
    for dep in sup.deployments.values():
        for rs in dep.ranks.values():
            for key, n in (rs.rejects or {}).items():
                sock, _, reason = str(key).partition(".")
                if isinstance(n, int):
                    total[(sock, reason or "unknown")] += n
    return [{"service": "rank", "socket": k, "reason": r, "count": n}
            for (k, r), n in sorted(total.items())]
