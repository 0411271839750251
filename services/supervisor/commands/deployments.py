"""deployments — every deployment the supervisor holds, with each rank's state. Carries
`requests_key_sealed`: the launch's requests key, AES-GCM-sealed under a key derived from
the cluster key (common.keys.seal_key / requests_key_of), so only a holder of the cluster
key (the gateway) can open it, and neither this reply nor `lockstep admin status` output
shows it in clear. The launch secret itself never leaves the supervisor.

Wire (Args, Reply, the CLI's flags): common/messages/commands/deployments.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.deployments import Args

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    return {"deployments": [d.to_wire(cluster_key=sup.cluster_key) for d in sup.deployments.values()]}
