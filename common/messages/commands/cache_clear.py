"""cache_clear — empty every rank's prefix cache through the plan. The supervisor sends
CACHE_CLEAR{deployment_id, clear_id} to rank 0 (control, re-sent until answered); rank 0
folds one CLEAR op into its next plan, so every rank drops every entry at the same step,
and answers CACHE_CLEARED{clear_id, step} once that plan is out (cache off: at once).

    request  {deployment_id, timeout_s: float|null (null = cancel_timeout, 10 s)}
    reply    {deployment_id, clear_id, step, enabled, sends, waited_s}
             step: the plan at which every rank emptied its cache; enabled false: the
             prefix cache is off (prompt_cache_entries 0), there was nothing to clear
    errors   not_found (no such deployment), conflict (not serving),
             timeout (rank 0 did not answer in time: the clear may still happen)
    CLI      lockstep admin cache-clear ID [--timeout-s S]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.commands.cli import POSITIONAL


@dataclass
class Args:
    deployment_id: str = field(metadata=POSITIONAL)
    timeout_s: float | None = None


@dataclass(frozen=True)
class Reply:
    deployment_id: str
    clear_id: int
    step: int
    enabled: bool
    sends: int
    waited_s: float

    def render(self) -> str:
        if not self.enabled:
            return f"{self.deployment_id}: the prefix cache is off, nothing to clear"
        return (f"{self.deployment_id}: every rank's prefix cache emptied at step "
                f"{self.step} (clear {self.clear_id}, {self.sends} sends)")
