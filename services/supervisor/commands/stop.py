"""stop — verified teardown of a deployment (DESIGN.md 5.7): graceful shutdown on
control → SIGTERM per rank process group → wait (stop_timeout) → SIGKILL → wait →
SIGKILL → sweep marker pids (identity-checked) → proof of exit.

Refused with `active_requests` while requests are active, unless `force`: then
abort_all runs first and its evidence is in the reply. A launch in progress is aborted
and torn down. Not proven → `teardown_failed` naming each survivor; the deployment and
its manifest are kept, and the next stop retries.

Wire (Args, Reply, the CLI's flags): common/messages/commands/stop.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages.commands.stop import Args

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


async def run(sup: CommandHost, args: Args) -> dict:
    return await sup.stop_deployment(args.deployment_id, force=args.force)
