"""cancel — an epoch-numbered cancel broadcast on the deployment's control topic,
re-sent until every rank acked or is declared dead (or cancel_timeout passed).
Epochs strictly increase across all deployments and survive a restart.

    request  {deployment_id, scope: "all"|"requests", request_ids: [str]=[], reason: str=""}
    reply    {epoch, acked: {rank: {step_applied, cancelled}}, missing: [rank],
              dead: [rank], sends}
    CLI      lockstep admin cancel ID [--scope all|requests] [--request-id RID ...]
                                      [--reason TEXT]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.commands.cli import POSITIONAL, flag
from common.messages.vocab import CancelScope


@dataclass
class Args:
    deployment_id: str = field(metadata=POSITIONAL)
    scope: CancelScope = CancelScope.REQUESTS
    request_ids: list[str] = field(default_factory=list, metadata=flag("--request-id"))
    reason: str = ""


@dataclass(frozen=True)
class Reply:
    epoch: int
    acked: dict[str, dict[str, object]]  # rank -> its ack's evidence
    missing: list[str]
    dead: list[str]
    sends: int

    def render(self) -> str:
        return (f"epoch {self.epoch}: acked by ranks {sorted(self.acked)}; missing "
                f"{self.missing}; dead {self.dead} ({self.sends} sends)")
