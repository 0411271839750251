"""What the live resume tests share (tests/e2e/test_resume_live.py,
test_resume_more_live.py): `lockstep up`'s options for them (the tiny preset, a short peer
grace, redeploys enough for every fault of a module), a fault sent to a rank of the
serving deployment, the gateway's resume count."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import httpx

from tests.support.up_cluster import UpCluster, UpOptions

NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: streams run to max_tokens
MSG = [{"role": "user", "content": "Count for me, slowly, and keep going."}]


def resume_options(tp: int, pp: int | None = None, grace: float = 1) -> UpOptions:
    return UpOptions(tp=tp, pp=pp, restarts=6, ready_s=180, env={
        "LOCKSTEP_PEER_ABORT_GRACE": str(grace), "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "8"})


def serving(c: UpCluster) -> dict:
    return next(d for d in c.deployments() if d["state"] == "serving")


def resumes(c: UpCluster) -> float:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^lockstep_gateway_resumes_total\{[^}]*\} (\S+)$",
                                            text, re.M))


@dataclass(frozen=True)
class Fault:
    deployment_id: str  # the deployment faulted
    pids: list[int]  # its launch's rank pids


def fault(c: UpCluster, rank: int, sig: int) -> Fault:
    """Send `sig` to `rank` of the serving deployment (its ranks must be gone once `up`
    stopped)."""
    dep = serving(c)
    pids = [r["pid"] for r in dep["ranks"]]
    c.pids |= set(pids)
    os.kill(pids[rank], sig)
    return Fault(dep["deployment_id"], pids)
