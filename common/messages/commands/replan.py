"""replan — change a deployment's backend. Without a signature: a preview of the new
plan and its signature (an HMAC over the plan and the launch it replaces). With the
signature: the deployment is stopped (verified) and relaunched with that plan; a
signature that does not match the current preview is `signature_mismatch` (HTTP 409 at
the gateway), and nothing is changed.

    request  {deployment_id, backend: "auto"|"ring"|"jaccl"|"mpi", signature: str|null,
              force: bool=false}
    reply    preview {preview: true, plan, current, signature}
             applied {preview: false, deployment_id, job_id, state}
    CLI      lockstep admin replan ID --backend B [--signature SIG] [--force]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.messages.commands.cli import BACKEND_CHOICES, POSITIONAL, choices
from common.messages.vocab import DeploymentState


@dataclass
class Args:
    deployment_id: str = field(metadata=POSITIONAL)
    backend: str = field(default="auto", metadata=choices(BACKEND_CHOICES, required=True))
    signature: str | None = None
    force: bool = False


@dataclass(frozen=True)
class Reply:
    preview: bool
    # a preview: the plan it would launch, the one running, and the signature to apply it
    plan: dict[str, object] | None = None
    current: dict[str, object] | None = None
    signature: str | None = None
    # applied: the relaunched deployment
    deployment_id: str | None = None
    job_id: str | None = None
    state: DeploymentState | None = None

    def render(self) -> str:
        if not self.preview:
            return f"{self.deployment_id}: {self.state} (job {self.job_id})"
        return (f"preview: {json.dumps(self.current, sort_keys=True)} -> "
                f"{json.dumps(self.plan, sort_keys=True)}\n"
                f"apply with: --signature {self.signature}")
