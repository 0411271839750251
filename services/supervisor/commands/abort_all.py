"""abort_all — cancel everything: one epoch, scope `all`, to one deployment or all of
them; then wait (bounded, default 15 s) until every rank acked and every rank's telemetry
reports zero active requests after the abort. The reply is that evidence.

Wire (Args, Reply, the CLI's flags): common/messages/commands/abort_all.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.abort_all import Args
from services.supervisor.deployment import LIVE
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    if args.deployment_id is not None:
        deps = [sup.get(args.deployment_id)]
    else:
        deps = [d for d in sup.deployments.values() if d.state in LIVE and d.control]
    deps = [d for d in deps if d.control is not None and d.ranks]
    timeout = sup.settings.abort_all_timeout if args.timeout_s is None else args.timeout_s
    if timeout < 0 or timeout > 600:
        raise AdminError("bad_request", "args.timeout_s: must be within 0..600")
    if not deps:
        return {"epoch": sup.epochs.current, "zero_active": True, "ranks": {}, "acked": {},
                "missing": [], "deployments": {}, "waited_s": 0.0}
    return await sup.broadcaster.abort_all(deps, timeout)
