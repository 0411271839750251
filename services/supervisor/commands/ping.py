"""ping — liveness of the supervisor.

    request  {}
    reply    {pid, boot_id, version}
    CLI      lockstep admin ping
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.envelope import BOOT_ID

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    pass


async def run(sup: CommandHost, args: Args) -> dict:
    return {"pid": sup.me.pid, "boot_id": BOOT_ID, "version": sup.version}
