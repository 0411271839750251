"""stop — verified teardown of a deployment (DESIGN.md 5.7): graceful shutdown on
control → SIGTERM per rank process group → wait (stop_timeout) → SIGKILL → wait →
SIGKILL → sweep marker pids (identity-checked) → proof of exit.

Refused with `active_requests` while requests are active, unless `force`: then
abort_all runs first and its evidence is in the reply. A launch in progress is aborted
and torn down. Not proven → `teardown_failed` naming each survivor; the deployment and
its manifest are kept, and the next stop retries.

    request  {deployment_id, force: bool=false}
    reply    {deployment_id, outcome: {path: [step], survivors, swept, skipped,
              duration_s, proven}, abort?: abort_all evidence}
    CLI      lockstep admin stop ID [--force]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    deployment_id: str
    force: bool = False


async def run(sup: CommandHost, args: Args) -> dict:
    return await sup.stop_deployment(args.deployment_id, force=args.force)
