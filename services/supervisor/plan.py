"""Deployment plans: model, tp, pp, placement, backend and sampling defaults, and the
replan signature.

world size = tp * pp. Whether the model can be split that way is checked from its
config.json before anything starts (services/supervisor/topology.py): tp must divide its
heads, KV heads and MLP, pp must not exceed its layers, not both at once. The sampling
defaults are resolved here, once (common/sampling_defaults.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.messages import Backend
from common.model_ref import ModelNotFound, model_id, resolve
from common.sampling_defaults import SamplingDefaults, SamplingOverrides, check_overrides
from common.sampling_defaults import resolve as resolve_sampling
from common.schema import to_wire
from services.supervisor.errors import AdminError
from services.supervisor.hosts import (
    BACKENDS,
    HostsError,
    Member,
    Selection,
    decode_hosts,
    local_host,
    members_from_host_records,
    select_backend,
)
from services.supervisor.topology import TopologyError
from services.supervisor.topology import check as check_topology


@dataclass
class DeployPlan:
    model_path: str
    tp: int
    pp: int
    backend: Backend  # none | ring | jaccl | mpi
    requested_backend: Backend
    hosts: list[dict[str, Any]] | None  # the host records as given; None = this machine
    members: list[Member]
    blockers: list[dict[str, str]] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    sampling_given: SamplingOverrides | None = None  # the operator's, kept for a replan
    replica: int = 0  # which of the model's `replicas` deployments (services/supervisor/replicas.py)
    replicas: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def to_wire(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tp": self.tp, "pp": self.pp,
                "backend": self.backend.value, "requested_backend": self.requested_backend.value,
                "world_size": self.world_size, "hosts": self.hosts,
                "members": [m.to_wire() for m in self.members], "blockers": self.blockers,
                "envs": self.envs, "sampling": to_wire(self.sampling),
                "replica": self.replica, "replicas": self.replicas}


def selection_for(hosts: list[dict[str, Any]] | None, backend: Backend | str,
                  slots: int | None = None) -> Selection:
    """Backend selection over host records (None = this machine, `slots` ranks on it)."""
    try:
        if hosts is None:
            rec = local_host()
            rec.ranks_per_host = max(1, slots or 1)
            members = members_from_host_records([rec], slots=slots)
        else:
            members = members_from_host_records(decode_hosts(hosts), slots=slots)
        return select_backend(members, backend)
    except HostsError as exc:
        raise AdminError("bad_request", str(exc)) from None


def make_plan(model_path: str, tp: int, pp: int, hosts: list[dict[str, Any]] | None,
              backend: Backend | str, envs: list[str] | None = None,
              sampling: SamplingOverrides | None = None, *, replica: int = 0,
              replicas: int = 1) -> DeployPlan:
    if tp < 1 or pp < 1:
        raise AdminError("bad_request", "tp and pp must be >= 1")
    if sampling is not None and (bad := check_overrides(sampling)):
        raise AdminError("bad_request", "sampling: " + "; ".join(bad))
    if backend not in BACKENDS:
        raise AdminError("bad_request", f"backend: must be one of {', '.join(BACKENDS)}")
    backend = Backend(backend)
    try:  # a directory, or a Hugging Face repo id in the local cache (offline)
        model_path = str(resolve(model_path))
    except ModelNotFound as exc:
        raise AdminError("bad_request", f"model_path: {exc}") from None
    try:  # before any process starts: the canary would fail only after every rank loaded
        check_topology(model_path, tp, pp, model_id(model_path))
    except TopologyError as exc:
        raise AdminError("bad_request", str(exc)) from None
    sel = selection_for(hosts, backend, tp * pp)
    if tp * pp == 1:
        backend_used = Backend.NONE
    else:
        backend_used = sel.backend
        if backend_used == Backend.JACCL and sel.blockers:
            reasons = "; ".join(f"{b['member']}: {b['reason']}" for b in sel.blockers)
            raise AdminError("bad_request", f"backend jaccl is blocked: {reasons}",
                             {"blockers": sel.blockers})
    if backend_used == Backend.MPI:
        raise AdminError("bad_request", "backend mpi needs ranks started by mpirun; this "
                                        "launcher does not do that yet (use ring or jaccl)")
    return DeployPlan(str(Path(model_path).resolve()), tp, pp, backend_used, backend,
                      hosts, sel.members, sel.blockers, list(envs or []),
                      sampling=resolve_sampling(model_path, sampling), sampling_given=sampling,
                      replica=replica, replicas=replicas)


def signature(key: bytes, deployment_id: str, job_id: str, plan: DeployPlan) -> str:
    """HMAC over the canonical plan and the job it replaces: a preview made for another
    launch or another plan never matches."""
    doc = json.dumps({"deployment_id": deployment_id, "job_id": job_id, "plan": plan.to_wire()},
                     sort_keys=True, separators=(",", ":"))
    return hmac.new(key, b"lockstep replan\x00" + doc.encode(), hashlib.sha256).hexdigest()
