"""DeploymentInfo: one deployment as the supervisor reports it in its admin `status` and
`deployments` replies (services/supervisor/deployment.py `to_wire` writes it), and its one
strict reader, `read_deployment_info`, which the gateway and every other reader use.

The requests key crosses only sealed (`requests_key_sealed`, common.keys.seal_key); the
reader opens it with common.keys.requests_key_of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.messages import (
    Backend,
    CacheStats,
    DeploymentState,
    Determinism,
    KvStats,
    LoadProgress,
    Phase,
    PhaseTimes,
    SpecStats,
    Speculation,
)
from common.sampling_defaults import SamplingDefaults
from common.schema import SchemaError, decode_into

# A rank's or deployment's error may carry a stderr tail: larger than the default cap.
_LONG = {"max_len": 65536}


class DeploymentInfoError(ValueError):
    """A DeploymentInfo that is not exactly what the supervisor writes; `reason` is the
    schema's code (missing_field, extra_field, wrong_type, field_too_large)."""

    def __init__(self, deployment_id: str | None, exc: SchemaError) -> None:
        self.deployment_id, self.reason, self.detail = deployment_id, exc.reason, exc.detail
        super().__init__(f"DeploymentInfo {deployment_id or '<unnamed>'}: {exc}")


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    rank: int
    host: str
    remote: bool
    pid: int
    phase: Phase
    step: int
    active: int
    cancel_epoch: int
    acked_epoch: int
    mem_active: int
    last_seen: float
    rejects: dict[str, int] = field(default_factory=dict)
    cache: CacheStats | None = None  # its prefix cache, from telemetry (None: off/not yet)
    load: LoadProgress | None = None  # while loading, from telemetry
    phases: PhaseTimes | None = None  # cumulative time per loop phase, from telemetry
    kv: KvStats | None = None  # KV held for running requests and the budget, from telemetry
    spec: SpecStats | None = None  # rank 0's speculation counts (None: not speculating)


@dataclass(frozen=True, kw_only=True)
class DeploymentInfo:
    deployment_id: str
    job_id: str
    state: DeploymentState
    model: str
    model_path: str
    tp: int
    pp: int
    backend: Backend
    world_size: int
    requests_endpoint: str
    requests_key_sealed: str  # "" until the launch has keys
    canary_at: float | None
    error: str | None = field(metadata=_LONG)
    teardown: dict[str, object] | None  # the last teardown outcome (procs.LadderOutcome)
    ranks: list[RankInfo]
    # what a request that names none of the deployable sampling parameters gets
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    # one of `replicas` deployments of this model, served under one name
    replica: int = 0
    replicas: int = 1
    # rank 0's forward pass as its RANK_READY said (None: not ready yet)
    determinism: Determinism | None = None
    # rank 0's drafts as its RANK_READY said (None: not ready yet)
    speculation: Speculation | None = None


def read_deployment_info(d: Any) -> DeploymentInfo:
    """Decode one DeploymentInfo strictly; DeploymentInfoError names the deployment."""
    try:
        return decode_into(DeploymentInfo, d)
    except SchemaError as exc:
        dep_id = d.get("deployment_id") if type(d) is dict else None
        raise DeploymentInfoError(dep_id if type(dep_id) is str else None, exc) from None
