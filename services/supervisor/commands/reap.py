"""reap — one reap pass now (the same pass that runs at start and before every launch).

Wire (Args, Reply, the CLI's flags): common/messages/commands/reap.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages import AdminCode
from common.messages.commands.reap import Args
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    try:
        return await sup.reap()
    except AdminError as exc:
        if exc.code is AdminCode.REAP_BLOCKED:
            return exc.data
        raise
