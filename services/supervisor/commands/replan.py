"""replan — change a deployment's backend. Without a signature: a preview of the new
plan and its signature (an HMAC over the plan and the launch it replaces). With the
signature: the deployment is stopped (verified) and relaunched with that plan; a
signature that does not match the current preview is `signature_mismatch` (HTTP 409 at
the gateway), and nothing is changed.

Wire (Args, Reply, the CLI's flags): common/messages/commands/replan.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.replan import Args
from services.supervisor import lifecycle
from services.supervisor.deployment_state import DeploymentState as S

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    result = await sup.replan(args.deployment_id, args.backend, args.signature, args.force)
    if not result["preview"]:
        dep = sup.deployments.get(args.deployment_id)
        if dep is not None and dep.state != S.SERVING:
            raise lifecycle.launch_failure(dep)
    return result
