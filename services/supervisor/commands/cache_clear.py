"""cache_clear — empty every rank's prefix cache through the plan. The supervisor sends
CACHE_CLEAR{deployment_id, clear_id} to rank 0 (control, re-sent until answered); rank 0
folds one CLEAR op into its next plan, so every rank drops every entry at the same step,
and answers CACHE_CLEARED{clear_id, step} once that plan is out (cache off: at once).

Wire (Args, Reply, the CLI's flags): common/messages/commands/cache_clear.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.cache_clear import Args
from services.supervisor.deployment_state import DeploymentState
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    timeout = sup.settings.cancel_timeout if args.timeout_s is None else args.timeout_s
    if not 0 < timeout <= 600:
        raise AdminError("bad_request", "args.timeout_s: must be within (0, 600]")
    dep = sup.get(args.deployment_id)
    if dep.state is not DeploymentState.SERVING or dep.control is None:
        raise AdminError("conflict", f"deployment {dep.deployment_id} is {dep.state}, not "
                         "serving: its ranks hold no cache to clear")
    out = await sup.cache_clears.clear(dep, timeout)
    out["enabled"] = sup.settings.prompt_cache_entries > 0
    return out
