"""One deployment's state as the supervisor sees it, and its DeploymentInfo wire form.

`Deployment` and `RankState` own their mutable fields: other modules change them through
the methods here (a report received, a probe, a teardown recorded, an abort asked),
never by assigning a field (tests/unit/supervisor/test_deployment_owner.py checks it). The
lifecycle state itself moves only through `life` (deployment_state.StateMachine, its one
table of edges); what a launch fixes before its first rank starts (job files, keys,
channels, endpoints, manifest) arrives once, as a `LaunchSetup` (`launched`), its remote
hosts just before (`placed`)."""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.bus import Channel
from common.envelope import Key
from common.keys import LaunchKeys, seal_key
from common.messages import (
    CacheStats,
    KvStats,
    LoadProgress,
    Phase,
    PhaseTimes,
    ProcState,
    SpecStats,
)
from common.model_ref import model_id
from common.procs import ProcessIdentity, is_alive
from common.records import LaunchManifest, RankRecord
from common.schema import to_wire
from services.supervisor.deployment_state import LIVE, DeploymentState, StateMachine
from services.supervisor.plan import DeployPlan

if TYPE_CHECKING:
    import asyncio

    from common.messages import RankReady, Telemetry
    from common.records import RankMarker
    from services.hostagent.client import RemoteHost
    from services.supervisor.errors import LaunchError

__all__ = ["LIVE", "Deployment", "DeploymentState", "LaunchSetup", "RankState"]


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
    kv: KvStats | None = None  # KV held for running requests, the budget, from telemetry
    spec: SpecStats | None = None  # rank 0's speculation counts (None: not speculating)
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
        if self.popen is not None:
            if self.popen.poll() is not None:
                return True
            if self.identity is not None and self.popen.pid == self.identity.pid:
                # Our own unreaped child: its pid cannot name another process, so
                # poll() is the whole answer (the monitor asks 4x a second; psutil's
                # identity read was most of an idle supervisor's CPU).
                return False
        if self.remote is not None:
            return self.remote_state in (ProcState.GONE, ProcState.REUSED)
        return self.identity is not None and not is_alive(self.identity)

    @property
    def pid(self) -> int:
        return self.identity.pid if self.identity else 0

    # --- what changes it ------------------------------------------------------------------

    def started(self, identity: ProcessIdentity, pgid: int, popen: subprocess.Popen | None,
                remote: RemoteHost | None, log_path: Path) -> None:
        """Its process runs: here (`popen`, our child) or on `remote`; its output goes to
        `log_path` on that host."""
        self.identity, self.pgid, self.popen, self.remote = identity, pgid, popen, remote
        self.log_path = log_path

    def on_marker(self, phase: Phase) -> None:
        """Its identity-checked marker shows `phase` (readiness)."""
        self.phase = phase

    def seen(self, now: float) -> None:
        self.last_seen = now

    def on_ready(self, body: RankReady, now: float) -> None:
        """An identity-checked RANK_READY."""
        self.ready, self.last_seen = body, now

    def on_telemetry(self, body: Telemetry, now: float, rx: float) -> None:
        """`now` wall time, `rx` monotonic receive time."""
        self.phase, self.step, self.active = body.phase, body.step, body.active
        self.cancel_epoch, self.mem_active = body.cancel_epoch, body.mem_active
        self.last_seen, self.telemetry_rx = now, rx
        self.rejects = dict(body.rejects)  # "socket.reason" -> count, for status/metrics
        self.cache = body.cache  # the prefix cache's figures (None: off), for status/metrics
        self.load = body.load  # while loading: weights bytes read / total
        self.phases = body.phases  # time per loop phase (None: an older rank), for metrics
        self.kv = body.kv  # KV held and the budget (None: an older rank)
        self.spec = body.spec
        if body.error:
            self.error = body.error

    def on_ack(self, epoch: int, now: float, rx: float) -> None:
        if epoch > self.acked_epoch:
            self.acked_epoch, self.acked_at = epoch, rx
        self.last_seen = now

    def on_error(self, error: str) -> None:
        self.error = error

    def on_probe(self, state: ProcState, marker: RankMarker | None) -> None:
        """One probe of its host answered: its process state there and, if found and
        identity-checked, its marker (None keeps the last one read)."""
        self.remote_error, self.remote_state = None, state
        if marker is not None:
            self.remote_marker = marker

    def on_probe_failed(self, error: str) -> None:
        self.remote_error = error

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "remote": self.remote is not None,
                "pid": self.pid, "phase": self.phase.value,
                "step": self.step, "active": self.active, "cancel_epoch": self.cancel_epoch,
                "acked_epoch": self.acked_epoch, "mem_active": self.mem_active,
                "last_seen": self.last_seen, "rejects": dict(self.rejects),
                "cache": None if self.cache is None else to_wire(self.cache),
                "load": None if self.load is None else to_wire(self.load),
                "phases": None if self.phases is None else to_wire(self.phases),
                "kv": None if self.kv is None else to_wire(self.kv),
                "spec": None if self.spec is None else to_wire(self.spec)}


@dataclass(frozen=True)
class LaunchSetup:
    """What a launch fixes before its first rank starts (job_launch.prepare): its files
    here, its keys and channels, rank 0's endpoints, and the control/report endpoints
    each remote rank reaches the supervisor on."""

    job_dir: Path
    secret_path: Path
    keys: LaunchKeys
    control: Channel  # signs control PUB messages for this launch
    report: Channel  # verifies this launch's report messages
    plan_endpoint: str
    requests_endpoint: str
    jaccl_coordinator: str = ""  # jaccl: rank 0's coordinator address
    rank_endpoints: Mapping[int, tuple[str, str]] = field(default_factory=dict)  # (ctl, report)


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

    # --- what changes it (the state: `life`) ---------------------------------------------

    def placed(self, remote_hosts: Mapping[int, RemoteHost]) -> None:
        """The hosts its remote ranks go to (by host index), known before anything is
        written there: a failed launch removes its launch files on each."""
        self.remote_hosts = dict(remote_hosts)

    def launched(self, setup: LaunchSetup, manifest: LaunchManifest) -> None:
        """The launch's setup, once, and its manifest (no ranks yet) as written."""
        assert self.keys is None, f"{self.deployment_id}: launched twice"
        self.job_dir, self.secret_path, self.keys = setup.job_dir, setup.secret_path, setup.keys
        self.control, self.report = setup.control, setup.report
        self.plan_endpoint, self.requests_endpoint = setup.plan_endpoint, setup.requests_endpoint
        self.jaccl_coordinator = setup.jaccl_coordinator
        self.rank_endpoints = dict(setup.rank_endpoints)
        self.manifest = manifest

    def ranks_planned(self) -> None:
        """A RankState for every member of the plan, before the first one starts."""
        for m in self.plan.members:
            self.ranks[m.index] = RankState(rank=m.index, host=m.host)

    def next_lease_seq(self) -> int:
        self.lease_seq += 1
        return self.lease_seq

    def request_abort(self, reason: str) -> None:
        """End a launch in progress and any retries after a failure (the first reason
        asked is kept)."""
        self.abort_reason = self.abort_reason or reason

    def launching(self, task: asyncio.Task[None]) -> None:
        self.launch_task = task

    def watching_remote(self, task: asyncio.Task[None]) -> None:
        self.remote_watch = task

    def stop_watching_remote(self) -> None:
        if self.remote_watch is not None:
            self.remote_watch.cancel()

    def canary_passed(self, at: float | None = None) -> None:
        self.canary_at = time.time() if at is None else at

    def record_error(self, error: str) -> None:
        self.error = error

    def rank_lost(self, reason: str, teardown: asyncio.Task[None]) -> None:
        """The monitor saw a rank gone while serving; `teardown` tears down the rest."""
        self.error, self.failure_task = reason, teardown

    def launch_failed(self, err: LaunchError, outcome: dict[str, Any] | None) -> None:
        """The failed launch's error, and its teardown's outcome when that was proven
        (None: the teardown failed too, `err.teardown`)."""
        self.launch_error = err
        if outcome is not None:
            self.teardown = outcome

    def record_teardown(self, outcome: dict[str, Any]) -> None:
        self.teardown = outcome

    def remote_files_left(self, errors: list[str]) -> None:
        """After a proven teardown: launch files some remote hosts kept."""
        if errors and self.teardown is not None:
            self.teardown["remote_files_left"] = errors

    def add_teardown_failure(self, line: str, keep: int = 20) -> LaunchManifest:
        """An unproven teardown appended to the manifest (the last `keep`); the new
        manifest, for the caller to write."""
        assert self.manifest is not None
        failures = [*self.manifest.teardown_failures, line][-keep:]
        self.manifest = dataclasses.replace(self.manifest, teardown_failures=failures)
        return self.manifest

    def record_ranks(self, ranks: list[RankRecord]) -> LaunchManifest:
        """Every started rank in the manifest; the new manifest, for the caller to write."""
        assert self.manifest is not None
        self.manifest = dataclasses.replace(self.manifest, ranks=list(ranks))
        return self.manifest

    # --- what it shows --------------------------------------------------------------------

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
            "determinism": self.determinism(),
            "speculation": self.speculation(),
        }

    def speculation(self) -> str | None:
        """Rank 0's drafts as its RANK_READY said; None until it is ready."""
        r0 = self.ranks.get(0)
        return None if r0 is None or r0.ready is None else r0.ready.speculation.value

    def determinism(self) -> str | None:
        """Rank 0's forward pass as its RANK_READY said; None until it is ready."""
        r0 = self.ranks.get(0)
        return None if r0 is None or r0.ready is None else r0.ready.determinism.value
