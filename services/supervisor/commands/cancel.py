"""cancel — an epoch-numbered cancel broadcast on the deployment's control topic,
re-sent until every rank acked or is declared dead (or cancel_timeout passed).
Epochs strictly increase across all deployments and survive a restart.

    request  {deployment_id, scope: "all"|"requests", request_ids: [str]=[], reason: str=""}
    reply    {epoch, acked: {rank: {step_applied, cancelled}}, missing: [rank],
              dead: [rank], sends}
    CLI      lockstep admin cancel ID [--scope all|requests] [--request-id RID ...]
                                      [--reason TEXT]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.messages import CancelScope
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    deployment_id: str
    scope: CancelScope = CancelScope.REQUESTS
    request_ids: list[str] = field(default_factory=list)
    reason: str = ""


async def run(sup: CommandHost, args: Args) -> dict:
    if args.scope == CancelScope.REQUESTS and not args.request_ids:
        raise AdminError("bad_request", "args.request_ids: scope 'requests' needs ids")
    dep = sup.get(args.deployment_id)
    if dep.control is None or not dep.ranks:
        raise AdminError("conflict", f"deployment {dep.deployment_id} has no running ranks")
    return await sup.broadcaster.cancel(dep, args.scope, args.request_ids,
                                        args.reason or "admin cancel",
                                        sup.settings.cancel_timeout)
