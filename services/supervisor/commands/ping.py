"""ping — liveness of the supervisor.

    request  {}
    reply    {pid, boot_id, version}
    CLI      lockstep admin ping
"""

from __future__ import annotations

from dataclasses import dataclass

from common.envelope import BOOT_ID


@dataclass
class Args:
    pass


async def run(sup, args: Args) -> dict:
    from services.supervisor.service import VERSION

    return {"pid": sup.me.pid, "boot_id": BOOT_ID, "version": VERSION}
