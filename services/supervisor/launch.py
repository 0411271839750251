"""Launch files and processes (DESIGN.md 5.3, docs/protocol.md "Rank lifecycle" step 1):
launch secret (0600, one per launch) → manifest (before the first rank starts) → MLX
hostfile → one RankSpec per rank → start each rank in its own session, recording its
pid, pgid, start time and command line in the manifest as soon as it runs."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from common.bus import Channel
from common.keys import LaunchKeys, new_launch_secret
from common.messages import REPORT
from common.rankspec import SCHEMA_VERSION as SPEC_VERSION
from common.rankspec import RankSettings, RankSpec
from common.state import LaunchManifest, Paths, RankRecord, write_manifest
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.errors import LaunchError
from services.supervisor.launcher import Launcher, LaunchFailed, free_ports, rank_env
from services.supervisor.settings import SupervisorSettings


@dataclasses.dataclass
class SupervisorIdentity:
    pid: int
    start_time: float
    boot_id: str
    sender: str
    control_endpoint: str
    report_endpoint: str


def job_dir(paths: Paths, job_id: str) -> Path:
    return paths.runtime / "jobs" / job_id


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def rank_settings(settings: SupervisorSettings) -> RankSettings:
    return RankSettings(lease_stale_s=settings.lease_ttl,
                        telemetry_interval_s=settings.rank_telemetry_interval_s,
                        test_seams=settings.rank_test_seams)


def prepare(dep: Deployment, paths: Paths, me: SupervisorIdentity) -> None:
    """Secret, channels, endpoints, hostfile, manifest (with no ranks yet)."""
    jd = job_dir(paths, dep.job_id)
    jd.mkdir(parents=True, exist_ok=False, mode=0o700)
    dep.job_dir = jd
    dep.secret_path = paths.secrets / f"{dep.job_id}.key"
    secret = new_launch_secret(dep.secret_path)
    dep.keys = LaunchKeys(secret, dep.deployment_id, dep.job_id)
    dep.control = Channel("supervisor", "control", sender=me.sender, send_key=dep.keys.control)
    dep.report = Channel("supervisor", "report", sender=me.sender, send_key=dep.keys.report,
                         accept=REPORT)
    members = dep.plan.members
    host0 = members[0].ip
    # One call: ports from separate calls could repeat (each call closes its sockets).
    ports = free_ports(2 + (len(members) if dep.plan.backend == "ring" else 0), host0)
    dep.plan_endpoint = f"tcp://{host0}:{ports[0]}"
    dep.requests_endpoint = f"tcp://{host0}:{ports[1]}"
    ports = ports[2:]
    if dep.plan.backend == "ring":
        hosts = [[f"{m.ip}:{p}"] for m, p in zip(members, ports, strict=True)]
        _write_private(jd / "hostfile.json", json.dumps(hosts))
    elif dep.plan.backend == "jaccl":
        rows = [list(m.rdma_row) for m in members]
        _write_private(jd / "hostfile.json", json.dumps(rows))
    dep.manifest = LaunchManifest(
        job_id=dep.job_id, deployment_id=dep.deployment_id, supervisor_pid=me.pid,
        supervisor_start_time=me.start_time, supervisor_boot_id=me.boot_id,
        created_at=time.time(), ranks=[], secret_path=str(dep.secret_path))
    write_manifest(paths, dep.manifest)


def _spec(dep: Deployment, rank: int, paths: Paths, me: SupervisorIdentity,
          settings: SupervisorSettings, floor: int) -> RankSpec:
    m = dep.plan.members[rank]
    hostfile = dep.job_dir / "hostfile.json" if dep.plan.backend in ("ring", "jaccl") else None
    return RankSpec(
        schema_version=SPEC_VERSION, deployment_id=dep.deployment_id, job_id=dep.job_id,
        rank=rank, world_size=dep.world_size, tp=dep.plan.tp, pp=dep.plan.pp, host=m.host,
        model_path=dep.plan.model_path, backend=dep.plan.backend, home=str(paths.home),
        secret_path=str(dep.secret_path), control_endpoint=me.control_endpoint,
        report_endpoint=me.report_endpoint, plan_endpoint=dep.plan_endpoint,
        requests_endpoint=dep.requests_endpoint, supervisor_pid=me.pid,
        cancel_epoch_floor=floor, hostfile=str(hostfile) if hostfile else "",
        settings=rank_settings(settings))


def _env(dep: Deployment, rank: int, paths: Paths, settings: SupervisorSettings,
         extra: dict[str, str]) -> dict[str, str]:
    env = rank_env(rank_settings(settings), os.environ)
    for item in dep.plan.envs:
        k, _, v = item.partition("=")
        if k:
            env[k] = v
    env.update(extra)
    env["MLX_RANK"] = str(rank)
    env["LOCKSTEP_HOME"] = str(paths.home)
    env["LOCKSTEP_JOB_ID"] = dep.job_id
    if dep.plan.backend == "ring":
        env["MLX_HOSTFILE"] = str(dep.job_dir / "hostfile.json")
    elif dep.plan.backend == "jaccl":
        env["MLX_IBV_DEVICES"] = str(dep.job_dir / "hostfile.json")
        env["MLX_JACCL_COORDINATOR"] = f"{dep.plan.members[0].ip}:{free_ports(1)[0]}"
    else:
        env.pop("MLX_HOSTFILE", None)
    return env


def start_ranks(dep: Deployment, paths: Paths, me: SupervisorIdentity,
                settings: SupervisorSettings, launcher: Launcher, *, floor: int,
                extra_env: dict[str, str] | None = None) -> None:
    """Start every rank; the manifest is rewritten after each start so it always names
    every rank that may be running."""
    records: list[RankRecord] = []
    jaccl_env: dict[str, str] = {}
    for rank, member in enumerate(dep.plan.members):
        spec_path = dep.job_dir / f"rank-{rank}.spec.json"
        _spec(dep, rank, paths, me, settings, floor).save(spec_path)
        argv = settings.rank_argv(spec_path)
        env = _env(dep, rank, paths, settings, dict(extra_env or {}))
        if "MLX_JACCL_COORDINATOR" in env:  # one coordinator for all ranks
            env["MLX_JACCL_COORDINATOR"] = jaccl_env.setdefault("c", env["MLX_JACCL_COORDINATOR"])
        log_path = paths.logs / f"{dep.job_id}-rank{rank}.log"
        rs = RankState(rank=rank, host=member.host, log_path=log_path)
        dep.ranks[rank] = rs
        try:
            started = launcher.start(argv, env, log_path, rank=rank, host_ssh=member.ssh)
        except LaunchFailed as exc:
            raise LaunchError(str(exc), rank=rank) from None
        rs.identity, rs.pgid, rs.popen = started.identity, started.pgid, started.popen
        records.append(RankRecord(
            rank=rank, host=member.host, pid=started.identity.pid, pgid=started.pgid,
            start_time=started.identity.start_time, cmdline=list(started.identity.cmdline),
            marker_dir=str(paths.markers / dep.deployment_id), remote=started.remote,
            ssh=started.ssh))
        dep.manifest = dataclasses.replace(dep.manifest, ranks=list(records))
        write_manifest(paths, dep.manifest)


def describe_ranks(dep: Deployment) -> list[dict[str, Any]]:
    return [{"rank": r.rank, "pid": r.pid, "pgid": r.pgid, "host": r.host}
            for r in dep.ranks.values()]
