"""backend_selection — what backend a set of hosts gets, and why not jaccl.

Rule: fewer than two members → "none" (single rank, no distributed init); jaccl only if
every member has RDMA control enabled and at least one RDMA device (and, with an RDMA
connectivity matrix, a link to every other host); else ring. Each blocker is named.

Wire (Args, Reply, the CLI's flags): common/messages/commands/backend_selection.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.backend_selection import Args
from services.supervisor.plan import selection_for

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    return selection_for(args.hosts, args.backend).to_wire()
