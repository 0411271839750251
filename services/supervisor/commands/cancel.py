"""cancel — an epoch-numbered cancel broadcast on the deployment's control topic,
re-sent until every rank acked or is declared dead (or cancel_timeout passed).
Epochs strictly increase across all deployments and survive a restart.

Wire (Args, Reply, the CLI's flags): common/messages/commands/cancel.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages import CancelScope
from common.messages.commands.cancel import Args
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    if args.scope == CancelScope.REQUESTS and not args.request_ids:
        raise AdminError("bad_request", "args.request_ids: scope 'requests' needs ids")
    dep = sup.get(args.deployment_id)
    if dep.control is None or not dep.ranks:
        raise AdminError("conflict", f"deployment {dep.deployment_id} has no running ranks")
    return await sup.broadcaster.cancel(dep, args.scope, args.request_ids,
                                        args.reason or "admin cancel",
                                        sup.settings.cancel_timeout)
