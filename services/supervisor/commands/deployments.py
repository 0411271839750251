"""deployments — every deployment the supervisor holds, with each rank's state. Carries
`requests_key` (hex of the launch's requests key) for the gateway: this reply only ever
travels over the cluster-key-authenticated admin channel.

    request  {}
    reply    {deployments: [DeploymentInfo]}
             DeploymentInfo = {deployment_id, job_id, state, model, model_path, tp, pp,
               backend, world_size, requests_endpoint, requests_key, canary_at, error,
               teardown, ranks: [{rank, host, pid, phase, step, active, cancel_epoch,
               acked_epoch, mem_active, last_seen}]}
    CLI      lockstep admin deployments [--json]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Args:
    pass


async def run(sup, args: Args) -> dict:
    return {"deployments": [d.to_wire() for d in sup.deployments.values()]}
