"""Deployment plans: model, tp, pp, placement and backend, and the replan signature.

world size = tp * pp. mlx-lm's `sharded_load` takes a tensor group or a pipeline group,
so tp > 1 together with pp > 1 is refused for now.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.model_ref import ModelNotFound, resolve
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


@dataclass
class DeployPlan:
    model_path: str
    tp: int
    pp: int
    backend: str  # none | ring | jaccl | mpi
    requested_backend: str
    hosts: list[dict[str, Any]] | None  # the host records as given; None = this machine
    members: list[Member]
    blockers: list[dict[str, str]] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def to_wire(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tp": self.tp, "pp": self.pp,
                "backend": self.backend, "requested_backend": self.requested_backend,
                "world_size": self.world_size, "hosts": self.hosts,
                "members": [m.to_wire() for m in self.members], "blockers": self.blockers,
                "envs": self.envs}


def selection_for(hosts: list[dict[str, Any]] | None, backend: str,
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
              backend: str, envs: list[str] | None = None) -> DeployPlan:
    if tp < 1 or pp < 1:
        raise AdminError("bad_request", "tp and pp must be >= 1")
    if tp > 1 and pp > 1:
        raise AdminError("bad_request", "tp > 1 together with pp > 1 is not supported yet "
                                        "(mlx-lm sharded_load takes one group)")
    if backend not in BACKENDS:
        raise AdminError("bad_request", f"backend: must be one of {', '.join(BACKENDS)}")
    try:  # a directory, or a Hugging Face repo id in the local cache (offline)
        model_path = str(resolve(model_path))
    except ModelNotFound as exc:
        raise AdminError("bad_request", f"model_path: {exc}") from None
    if pp > 1 and not (Path(model_path) / "model.safetensors.index.json").is_file():
        raise AdminError("bad_request", "model_path: pipeline parallel needs "
                                        "model.safetensors.index.json in the model directory")
    sel = selection_for(hosts, backend, tp * pp)
    if tp * pp == 1:
        backend_used = "none"
    else:
        backend_used = sel.backend
        if backend_used == "jaccl" and sel.blockers:
            reasons = "; ".join(f"{b['member']}: {b['reason']}" for b in sel.blockers)
            raise AdminError("bad_request", f"backend jaccl is blocked: {reasons}",
                             {"blockers": sel.blockers})
    if backend_used == "mpi":
        raise AdminError("bad_request", "backend mpi needs ranks started by mpirun; this "
                                        "launcher does not do that yet (use ring or jaccl)")
    return DeployPlan(str(Path(model_path).resolve()), tp, pp, backend_used, backend,
                      hosts, sel.members, sel.blockers, list(envs or []))


def signature(key: bytes, deployment_id: str, job_id: str, plan: DeployPlan) -> str:
    """HMAC over the canonical plan and the job it replaces: a preview made for another
    launch or another plan never matches."""
    doc = json.dumps({"deployment_id": deployment_id, "job_id": job_id, "plan": plan.to_wire()},
                     sort_keys=True, separators=(",", ":"))
    return hmac.new(key, b"lockstep replan\x00" + doc.encode(), hashlib.sha256).hexdigest()
