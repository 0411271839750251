"""ping — liveness of the supervisor.

Wire (Args, Reply, the CLI's flags): common/messages/commands/ping.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.envelope import BOOT_ID
from common.messages.commands.ping import Args

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    return {"pid": sup.me.pid, "boot_id": BOOT_ID, "version": sup.version}
