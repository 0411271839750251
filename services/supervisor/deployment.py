"""One deployment's state as the supervisor sees it, and its DeploymentInfo wire form."""

from __future__ import annotations

import subprocess
import time
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.bus import Channel
from common.envelope import Key
from common.keys import LaunchKeys, seal_key
from common.messages import CacheStats, LoadProgress, Phase, PhaseTimes, ProcState
from common.model_ref import model_id
from common.procs import ProcessIdentity, is_alive
from common.records import LaunchManifest
from common.schema import to_wire
from services.supervisor.deployment_state import LIVE, DeploymentState, StateMachine
from services.supervisor.plan import DeployPlan

if TYPE_CHECKING:
    import asyncio

    from common.messages import RankReady
    from common.records import RankMarker
    from services.hostagent.client import RemoteHost
    from services.supervisor.errors import LaunchError

__all__ = ["LIVE", "Deployment", "DeploymentState", "RankState"]


@dataclass
class RankState:
    rank: int
    host: str
    identity: ProcessIdentity | None = None
    pgid: int = 0
    popen: subprocess.Popen | None = None
    phase: Phase = Phase.STARTING
    step: int = 0
    active: int = 0
    cancel_epoch: int = 0  # last consumed, from telemetry
    acked_epoch: int = 0  # highest epoch this rank acked
    acked_at: float = 0.0  # monotonic time of that ack
    mem_active: int = 0
    last_seen: float = 0.0  # wall time of the last report
    telemetry_rx: float = 0.0  # monotonic receive time of the last telemetry
    ready: RankReady | None = None  # the identity-checked RankReady body
    rejects: dict[str, int] = field(default_factory=dict)  # rank's "socket.reason" -> count
    cache: CacheStats | None = None  # its prefix cache, from telemetry (None: off/not yet)
    load: LoadProgress | None = None  # while loading, from telemetry
    phases: PhaseTimes | None = None  # time per loop phase, from telemetry
    error: str | None = None
    log_path: Path | None = None  # on the rank's host
    remote: RemoteHost | None = None  # for a rank on another host
    remote_state: ProcState = ProcState.UNKNOWN  # its last probe there
    remote_marker: RankMarker | None = None  # its marker as last read there (identity-checked)
    remote_error: str | None = None  # the last probe's ssh failure, if any

    @property
    def exited(self) -> bool:
        """Observed gone: our child has exited, or the process (here, or over ssh on
        its host) is gone. An unreachable remote host proves nothing."""
        if self.popen is not None and self.popen.poll() is not None:
            return True
        if self.remote is not None:
            return self.remote_state in (ProcState.GONE, ProcState.REUSED)
        return self.identity is not None and not is_alive(self.identity)

    @property
    def pid(self) -> int:
        return self.identity.pid if self.identity else 0

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "remote": self.remote is not None,
                "pid": self.pid, "phase": self.phase.value,
                "step": self.step, "active": self.active, "cancel_epoch": self.cancel_epoch,
                "acked_epoch": self.acked_epoch, "mem_active": self.mem_active,
                "last_seen": self.last_seen, "rejects": dict(self.rejects),
                "cache": None if self.cache is None else to_wire(self.cache),
                "load": None if self.load is None else to_wire(self.load),
                "phases": None if self.phases is None else to_wire(self.phases)}


@dataclass
class Deployment:
    deployment_id: str
    job_id: str
    plan: DeployPlan
    initial: InitVar[DeploymentState | str] = DeploymentState.LAUNCHING
    keys: LaunchKeys | None = None
    control: Channel | None = None  # signs control PUB messages for this launch
    report: Channel | None = None  # verifies this launch's report messages
    manifest: LaunchManifest | None = None
    job_dir: Path | None = None
    secret_path: Path | None = None
    requests_endpoint: str = ""
    plan_endpoint: str = ""
    ranks: dict[int, RankState] = field(default_factory=dict)
    canary_at: float | None = None
    error: str | None = None
    teardown: dict[str, Any] | None = None  # last teardown outcome / failure evidence
    created_at: float = field(default_factory=time.time)
    lease_seq: int = 0
    launch_task: asyncio.Task[None] | None = None  # the launch while it runs
    failure_task: asyncio.Task[None] | None = None  # tearing down the rest after a loss
    abort_reason: str | None = None  # set by stop to end a launch in progress
    launch_error: LaunchError | None = None  # of a failed launch
    remote_hosts: dict[int, RemoteHost] = field(default_factory=dict)  # by host index
    rank_endpoints: dict[int, tuple[str, str]] = field(default_factory=dict)  # (ctl, report)
    jaccl_coordinator: str = ""
    remote_watch: asyncio.Task[None] | None = None  # polls remote markers and liveness
    life: StateMachine = field(init=False)  # the state and its history: moved only by it

    def __post_init__(self, initial: DeploymentState | str) -> None:
        self.life = StateMachine(self.deployment_id, DeploymentState(initial))

    @property
    def state(self) -> DeploymentState:
        return self.life.state

    @property
    def busy(self) -> bool:
        """A launch, stop or post-failure teardown holds it (`life.claim`)."""
        return self.life.busy

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def model_name(self) -> str:
        return model_id(self.plan.model_path)  # a HF snapshot: its repo id

    def identities(self) -> list[ProcessIdentity]:
        return [r.identity for r in self.ranks.values() if r.identity is not None]

    def active_requests(self) -> int:
        return max((r.active for r in self.ranks.values()), default=0)

    def to_wire(self, *, with_key: bool = True, cluster_key: Key | None = None) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id, "job_id": self.job_id, "state": self.state.value,
            "model": self.model_name, "model_path": self.plan.model_path, "tp": self.plan.tp,
            "pp": self.plan.pp, "backend": self.plan.backend, "world_size": self.world_size,
            "requests_endpoint": self.requests_endpoint,
            # The requests key, sealed under the cluster key (common.keys.seal_key): the
            # gateway opens it; in `lockstep admin status` output it is opaque.
            "requests_key_sealed": seal_key(cluster_key, self.keys.requests,
                                            context=f"{self.deployment_id}/{self.job_id}")
            if (self.keys and with_key and cluster_key) else "",
            "canary_at": self.canary_at, "error": self.error, "teardown": self.teardown,
            "ranks": [self.ranks[r].to_wire() for r in sorted(self.ranks)],
            "sampling": to_wire(self.plan.sampling),
            "replica": self.plan.replica, "replicas": self.plan.replicas,
        }
