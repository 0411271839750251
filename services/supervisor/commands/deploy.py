"""deploy — plan and launch a deployment: reap orphans first (a failed reap or an
unreadable manifest refuses with `reap_blocked`), write the manifest, start the ranks,
wait for the readiness barrier, release serve, pass the canary.

Wire (Args, Reply, the CLI's flags): common/messages/commands/deploy.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.deploy import Args
from services.supervisor import lifecycle
from services.supervisor.deployment_state import DeploymentState as S

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    result = await sup.deploy(model_path=args.model_path, tp=args.tp, pp=args.pp,
                              hosts=args.hosts, backend=args.backend,
                              deployment_id=args.deployment_id, wait=args.wait, envs=args.envs,
                              sampling=args.sampling, replicas=args.replicas,
                              replica=args.replica)
    if args.wait and "deployments" not in result:
        dep = sup.deployments.get(result["deployment_id"])
        if dep is not None and dep.job_id == result["job_id"] and dep.state != S.SERVING:
            raise lifecycle.launch_failure(dep)
    return result
