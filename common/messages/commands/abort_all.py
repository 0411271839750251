"""abort_all — cancel everything: one epoch, scope `all`, to one deployment or all of
them; then wait (bounded, default 15 s) until every rank acked and every rank's telemetry
reports zero active requests after the abort. The reply is that evidence.

    request  {deployment_id: str|null (null = every deployment), timeout_s: float|null
              (null = abort_all_timeout, 15 s)}
    reply    {epoch, zero_active: bool, ranks: {rank: active}, acked: {rank: evidence},
              missing: [rank], deployments: {id: {zero_active, ranks, acked, missing}},
              waited_s}   (rank keys are "r" for one deployment, "id/r" for several)
    CLI      lockstep admin abort-all [ID] [--timeout-s S]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.commands.cli import OPTIONAL_POSITIONAL


@dataclass
class Args:
    deployment_id: str | None = field(default=None, metadata=OPTIONAL_POSITIONAL)
    timeout_s: float | None = None


@dataclass(frozen=True)
class DeploymentAbort:
    zero_active: bool
    ranks: dict[str, int]
    acked: dict[str, dict[str, object]]
    missing: list[str]


@dataclass(frozen=True)
class Reply:
    epoch: int
    zero_active: bool
    ranks: dict[str, int] = field(default_factory=dict)
    acked: dict[str, dict[str, object]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    deployments: dict[str, DeploymentAbort] = field(default_factory=dict)
    waited_s: float = 0.0

    def render(self) -> str:
        return (f"epoch {self.epoch}: zero active {self.zero_active}; ranks "
                f"{self.ranks}; missing acks {self.missing}")
