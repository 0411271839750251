"""stop — the verified teardown of a deployment; its protocol doc (what it does, when it
is refused, its Args and Reply) is common/messages/commands/stop.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.stop import Args

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    return await sup.stop_deployment(args.deployment_id, force=args.force)
