"""backend_selection — what backend a set of hosts gets, and why not jaccl.

Rule: fewer than two members → "none" (single rank, no distributed init); jaccl only if
every member has RDMA control enabled and at least one RDMA device (and, with an RDMA
connectivity matrix, a link to every other host); else ring. Each blocker is named.

    request  {hosts: [host record], backend: "auto"|"ring"|"jaccl"|"mpi" = "auto"}
             host record = {ssh, ips, name, python, home, rdma_ctl, rdma_devices,
                            rdma (matrix row), ranks_per_host, envs}
    reply    {backend, members: [{index, host, ssh, ip, local, rdma_ctl, rdma_devices,
              rdma, python, home, cwd, ssh_config}], blockers: [{member, reason}]}
    CLI      lockstep admin backend-selection --hosts FILE [--backend B]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.base import TEXT
from common.messages.commands.cli import BACKEND_CHOICES, HOSTS_FILE, choices
from common.messages.vocab import Backend


@dataclass
class Args:
    hosts: list[dict[str, object]] = field(metadata={**HOSTS_FILE, "required": True})
    backend: str = field(default="auto", metadata=choices(BACKEND_CHOICES))


@dataclass(frozen=True)
class Blocker:
    member: str  # the host ("" when it concerns them all)
    reason: str = field(metadata=TEXT)


@dataclass(frozen=True)
class Reply:
    backend: Backend
    members: list[dict[str, object]]
    blockers: list[Blocker]

    def render(self) -> str:
        lines = [f"backend {self.backend} ({len(self.members)} members)"]
        lines += [f"  blocker {b.member}: {b.reason}" for b in self.blockers]
        return "\n".join(lines)
