"""stop — verified teardown of a deployment (DESIGN.md 5.7): graceful shutdown on
control → SIGTERM per rank process group → wait (stop_timeout) → SIGKILL → wait →
SIGKILL → sweep marker pids (identity-checked) → proof of exit.

Refused with `active_requests` while requests are active, unless `force`: then
abort_all runs first and its evidence is in the reply. A launch in progress is aborted
and torn down. Not proven → `teardown_failed` naming each survivor; the deployment and
its manifest are kept, and the next stop retries.

    request  {deployment_id, force: bool=false}
    reply    {deployment_id, outcome: {path: [step], survivors, swept, skipped, hosts,
              duration_s, proven}, abort?: abort_all evidence}
    CLI      lockstep admin stop ID [--force]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.commands.abort_all import Reply as AbortEvidence
from common.messages.commands.cli import POSITIONAL


@dataclass
class Args:
    deployment_id: str = field(metadata=POSITIONAL)
    force: bool = False


@dataclass(frozen=True)
class TeardownOutcome:
    """A verified teardown (services/supervisor/teardown.py writes it); empty when the
    launch it stopped had already torn itself down."""

    path: list[str] = field(default_factory=list)  # the ladder's steps taken
    survivors: list[dict[str, object]] = field(default_factory=list)
    swept: list[dict[str, object]] = field(default_factory=list)
    skipped: list[dict[str, object]] = field(default_factory=list)
    hosts: dict[str, dict[str, object]] = field(default_factory=dict)  # remote: {path, error}
    duration_s: float = 0.0
    proven: bool = True

    def describe(self) -> str:
        return " -> ".join(self.path) or "none alive"


@dataclass(frozen=True)
class Reply:
    deployment_id: str
    outcome: TeardownOutcome
    abort: AbortEvidence | None = None  # a forced stop's abort_all evidence

    def render(self) -> str:
        return (f"stopped {self.deployment_id}: {self.outcome.describe()} "
                f"in {self.outcome.duration_s:.2f}s, every rank's exit proven")
