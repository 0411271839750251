"""deployments — every deployment the supervisor holds, with each rank's state. Carries
`requests_key_sealed`: the launch's requests key, AES-GCM-sealed under a key derived from
the cluster key (common.keys.seal_key / requests_key_of), so only a holder of the cluster
key (the gateway) can open it, and neither this reply nor `lockstep admin status` output
shows it in clear. The launch secret itself never leaves the supervisor.

    request  {}
    reply    {deployments: [DeploymentInfo]}
             DeploymentInfo = {deployment_id, job_id, state, model, model_path, tp, pp,
               backend, world_size, requests_endpoint, requests_key_sealed, canary_at, error,
               teardown, ranks: [{rank, host, pid, phase, step, active, cancel_epoch,
               acked_epoch, mem_active, last_seen, rejects}]}
    CLI      lockstep admin deployments [--json]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    pass


async def run(sup: CommandHost, args: Args) -> dict:
    return {"deployments": [d.to_wire(cluster_key=sup.cluster_key) for d in sup.deployments.values()]}
