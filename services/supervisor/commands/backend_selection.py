"""backend_selection — what backend a set of hosts gets, and why not jaccl.

Rule: fewer than two members → "none" (single rank, no distributed init); jaccl only if
every member has RDMA control enabled and at least one RDMA device (and, with an RDMA
connectivity matrix, a link to every other host); else ring. Each blocker is named.

    request  {hosts: [host record], backend: "auto"|"ring"|"jaccl"|"mpi" = "auto"}
             host record = {ssh, ips, name, python, home, rdma_ctl, rdma_devices,
                            rdma (matrix row), ranks_per_host, envs}
    reply    {backend, members: [{index, host, ssh, ip, local, rdma_ctl, rdma_devices,
              rdma}], blockers: [{member, reason}]}
    CLI      lockstep admin backend-selection --hosts FILE [--backend B]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.supervisor.plan import selection_for

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    hosts: list[dict[str, object]]
    backend: str = "auto"


async def run(sup: CommandHost, args: Args) -> dict:
    return selection_for(args.hosts, args.backend).to_wire()
