"""Launch files and processes (DESIGN.md 5.3, docs/protocol.md "Rank lifecycle" step 1):
launch secret (0600, one per launch) → manifest (before the first rank starts) → MLX
hostfile → one RankSpec per rank → start each rank in its own session, recording its
pid, pgid, start time and command line in the manifest as soon as it runs.

A rank on a remote host gets the same files at the same paths under that host's
$LOCKSTEP_HOME (written over ssh by `remote.SshLauncher`, 0600) and is started there by
the host agent; its record says `remote` with the ssh target, the interpreter and the
home needed to reach it again (supervisor teardown or, after a crash, the reaper).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from common.bus import Channel
from common.home import Paths, write_manifest
from common.keys import LaunchKeys, new_launch_secret
from common.messages import REPORT, Backend
from common.rankspec import SCHEMA_VERSION as SPEC_VERSION
from common.rankspec import (
    WATCHDOG_ENV,
    RankSettings,
    RankSpec,
    auto_kv_budget_bytes,
    auto_prompt_cache_bytes,
    auto_prompt_cache_disk_bytes,
)
from common.records import LaunchManifest, RankRecord
from services.supervisor.deployment import Deployment, LaunchSetup, RankState
from services.supervisor.errors import LaunchError
from services.supervisor.hosts import Member, jaccl_devices
from services.supervisor.plan import DeployPlan
from services.supervisor.process_launcher import (
    Launcher,
    LaunchFailed,
    Started,
    free_ports,
    rank_env,
)
from services.supervisor.remote import (
    RemoteHost,
    SshLauncher,
    parallel,
    remote_env,
    remote_rank_argv,
)
from services.supervisor.settings import SupervisorSettings


@dataclasses.dataclass
class SupervisorIdentity:
    pid: int
    start_time: float
    boot_id: str
    sender: str
    control_endpoint: str
    report_endpoint: str
    kv_key: bytes = b""  # the disk prefix cache's key (common.keys.kv_cache_key)


KV_KEY_FILE = "kvcache.key"  # in the job dir, 0600: removed with it at teardown
DEPLOY_RECORD = "deploy.json"  # in the job dir, 0600: the plan's arguments (adoption)


def deploy_record(plan) -> dict[str, Any]:
    """The arguments `plan.make_plan` re-makes `plan` from (hosts already placed)."""
    given = plan.sampling_given
    return {"schema_version": 1, "model_path": plan.model_path, "tp": plan.tp, "pp": plan.pp,
            "hosts": plan.hosts, "backend": plan.requested_backend.value,
            "envs": list(plan.envs), "sampling": None if given is None else given.given(),
            "replica": plan.replica, "replicas": plan.replicas}


def job_dir(paths: Paths, job_id: str) -> Path:
    return paths.runtime / "jobs" / job_id


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# The supervisor's settings each rank gets in its spec: one name on both sides.
RANK_FIELDS = ("lease_ttl", "peer_abort_grace", "progress_stall_timeout",
               "signal_clear_timeout", "rank_telemetry_interval_s", "max_open_requests",
               "prompt_cache_entries", "prompt_cache_bytes", "prefill_stall_ratio",
               "prefill_step_decoding", "prefill_long_prompt", "rank_test_seams",
               "prompt_cache_disk_bytes", "deterministic", "adopt_window_s",
               "kv_budget_bytes", "speculative")


@functools.cache
def host_memory() -> int:
    """Physical memory of this (the supervisor's) host, read once per process."""
    return int(psutil.virtual_memory().total)


def kv_host_memory() -> int:
    """The memory the auto KV budget is taken from: this host's physical memory; on Apple
    silicon MLX's recommended working set for the GPU where that is smaller (what Metal
    lets MLX keep resident). Unverified: no Mac has run this; an MLX without the query
    leaves the physical memory."""
    total = host_memory()
    if sys.platform == "darwin":
        try:
            import mlx.core as mx
            info = (getattr(mx, "device_info", None) or mx.metal.device_info)()
            total = min(total, int(info["max_recommended_working_set_size"]))
        except Exception:  # noqa: BLE001 - no Metal, an older MLX: the physical memory
            pass
    return total


@functools.cache
def free_disk(home: Path) -> int:
    """Free bytes of the filesystem holding `home` (or its nearest existing parent), read
    once per process: every rank of every launch gets the same auto budget."""
    p = Path(home).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free)


def weights_bytes(model_path: str) -> int:
    """The model's weight files under `model_path` on this host (0 if it is not here)."""
    p = Path(model_path)
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0


def kv_budget(settings: SupervisorSettings, plan: DeployPlan) -> int:
    """The deployment's KV budget per rank: the setting, or its auto value (-1) resolved
    from this host's memory and the plan (raises KvBudgetRefused with the numbers)."""
    if settings.kv_budget_bytes >= 0:
        return settings.kv_budget_bytes
    cache = 0 if not settings.prompt_cache_entries else (
        settings.prompt_cache_bytes or auto_prompt_cache_bytes(host_memory()))
    return auto_kv_budget_bytes(kv_host_memory(), weights_bytes(plan.model_path),
                                plan.world_size, cache)


def rank_settings(settings: SupervisorSettings, plan: DeployPlan | None = None) -> RankSettings:
    values = {name: getattr(settings, name) for name in RANK_FIELDS}
    values["kv_budget_bytes"] = 0 if plan is None else kv_budget(settings, plan)
    if not values["prompt_cache_bytes"]:  # auto: resolved here, never on a rank
        values["prompt_cache_bytes"] = auto_prompt_cache_bytes(host_memory())
    if values["prompt_cache_disk_bytes"] < 0:  # auto, from the free disk of the home
        values["prompt_cache_disk_bytes"] = auto_prompt_cache_disk_bytes(
            free_disk(settings.home))
    if not values["prompt_cache_entries"]:  # no memory tier: no disk tier either
        values["prompt_cache_disk_bytes"] = 0
    return RankSettings(**values)


def _where(dep: Deployment, m: Member) -> RemoteHost | None:
    return None if m.local else dep.remote_hosts[m.host_index]


def _probe_ports(dep: Deployment, launcher: SshLauncher | None) -> dict[int, list[int]]:
    """Free ports on each rank's host, probed there: member index → its ports. Rank 0
    gets plan and requests first (and the jaccl coordinator), then its ring port; one
    probe per (host, address), since ports from separate probes may repeat."""
    members, backend = dep.plan.members, dep.plan.backend
    groups: dict[tuple[str, str], list[Member]] = {}
    for m in members:
        groups.setdefault(("" if m.local else m.ssh, m.ip), []).append(m)

    def need(m: Member) -> int:
        extra = (2 + (backend == Backend.JACCL)) if m.index == 0 else 0
        return extra + (backend == Backend.RING)

    def probe(key: tuple[str, str]) -> list[int]:
        ms = groups[key]
        n, host = sum(need(m) for m in ms), _where(dep, ms[0])
        if n == 0:
            return []
        return free_ports(n, key[1]) if host is None else launcher.free_ports(host, n, key[1])

    keys = list(groups)
    out: dict[int, list[int]] = {}
    for key, ports in zip(keys, parallel(probe, keys), strict=True):
        for m in groups[key]:
            out[m.index], ports = ports[:need(m)], ports[need(m):]
    return out


def prepare(dep: Deployment, paths: Paths, me: SupervisorIdentity,
            launcher: SshLauncher | None = None, *,
            rank_endpoints: dict[int, tuple[str, str]] | None = None) -> None:
    """Ports (probed on each rank's host: `dep.remote_hosts`, `Deployment.placed`), then
    secret, channels, hostfile and manifest (with no ranks yet), given to the deployment
    at once (`Deployment.launched`). `rank_endpoints`: the control/report endpoints each
    remote rank reaches the supervisor on. Files made here before a step fails are
    removed here: the teardown knows only what `launched` recorded."""
    members = dep.plan.members
    ports = _probe_ports(dep, launcher)
    host0 = members[0].ip
    jd = job_dir(paths, dep.job_id)
    secret_path = paths.secrets / f"{dep.job_id}.key"
    jd.mkdir(parents=True, exist_ok=False, mode=0o700)
    try:
        keys = LaunchKeys(new_launch_secret(secret_path), dep.deployment_id, dep.job_id)
        _write_private(jd / KV_KEY_FILE, me.kv_key.hex() + "\n")
        # What a restarted supervisor re-makes this plan from (adoption.py)
        _write_private(jd / DEPLOY_RECORD, json.dumps(deploy_record(dep.plan)))
        coordinator = ""
        if dep.plan.backend == Backend.RING:
            hosts = [[f"{m.ip}:{ports[m.index][-1]}"] for m in members]
            _write_private(jd / "hostfile.json", json.dumps(hosts))
        elif dep.plan.backend == Backend.JACCL:
            coordinator = f"{host0}:{ports[0][2]}"
            _write_private(jd / "hostfile.json", json.dumps(jaccl_devices(members)))
        manifest = LaunchManifest(
            job_id=dep.job_id, deployment_id=dep.deployment_id, supervisor_pid=me.pid,
            supervisor_start_time=me.start_time, supervisor_boot_id=me.boot_id,
            created_at=time.time(), ranks=[], secret_path=str(secret_path))
        write_manifest(paths, manifest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            secret_path.unlink()
        shutil.rmtree(jd, ignore_errors=True)
        raise
    dep.launched(LaunchSetup(
        job_dir=jd, secret_path=secret_path, keys=keys,
        control=Channel("supervisor", "control", sender=me.sender, send_key=keys.control),
        report=Channel("supervisor", "report", sender=me.sender, send_key=keys.report,
                       accept=REPORT),
        plan_endpoint=f"tcp://{host0}:{ports[0][0]}",
        requests_endpoint=f"tcp://{host0}:{ports[0][1]}",
        jaccl_coordinator=coordinator, rank_endpoints=dict(rank_endpoints or {})), manifest)


def _home_of(dep: Deployment, m: Member, paths: Paths) -> Paths:
    host = _where(dep, m)
    return paths if host is None else host.paths


def _spec(dep: Deployment, rank: int, paths: Paths, me: SupervisorIdentity,
          settings: SupervisorSettings, floor: int) -> RankSpec:
    m = dep.plan.members[rank]
    where = _home_of(dep, m, paths)  # the same layout under that host's home
    hostfile = (where.runtime / "jobs" / dep.job_id / "hostfile.json"
                if dep.plan.backend in (Backend.RING, Backend.JACCL) else None)
    control, report = dep.rank_endpoints.get(rank, (me.control_endpoint, me.report_endpoint))
    return RankSpec(
        schema_version=SPEC_VERSION, deployment_id=dep.deployment_id, job_id=dep.job_id,
        rank=rank, world_size=dep.world_size, tp=dep.plan.tp, pp=dep.plan.pp, host=m.host,
        model_path=dep.plan.model_path, backend=dep.plan.backend, home=str(where.home),
        secret_path=str(where.secrets / f"{dep.job_id}.key"), control_endpoint=control,
        cache_key_path=str(where.runtime / "jobs" / dep.job_id / KV_KEY_FILE),
        replica=dep.plan.replica,
        report_endpoint=report, plan_endpoint=dep.plan_endpoint,
        requests_endpoint=dep.requests_endpoint, supervisor_pid=me.pid,
        cancel_epoch_floor=floor, hostfile=str(hostfile) if hostfile else "",
        watch_parent=_where(dep, m) is None, settings=rank_settings(settings, dep.plan))


def _env(dep: Deployment, rank: int, paths: Paths, settings: SupervisorSettings,
         extra: dict[str, str]) -> dict[str, str]:
    env = rank_env(rank_settings(settings), os.environ)
    # The rank reads these over its spec; left in the inherited environment they would
    # beat the supervisor's own resolved settings (its --flags). A deployment's explicit
    # envs (below) may still set them.
    for var in WATCHDOG_ENV:
        env.pop(var, None)
    for item in dep.plan.envs:
        k, _, v = item.partition("=")
        if k:
            env[k] = v
    env.update(extra)
    env["MLX_RANK"] = str(rank)
    env["LOCKSTEP_HOME"] = str(paths.home)
    env["LOCKSTEP_JOB_ID"] = dep.job_id
    if dep.plan.backend == Backend.RING:
        env["MLX_HOSTFILE"] = str(dep.job_dir / "hostfile.json")
    elif dep.plan.backend == Backend.JACCL:
        env["MLX_IBV_DEVICES"] = str(dep.job_dir / "hostfile.json")
        env["MLX_JACCL_COORDINATOR"] = dep.jaccl_coordinator
    else:
        env.pop("MLX_HOSTFILE", None)
    return env


class _Recorder:
    """Records each started rank in the deployment and rewrites the manifest, so it
    always names every rank that may be running (ranks on several hosts start in
    parallel threads)."""

    def __init__(self, dep: Deployment, paths: Paths) -> None:
        self.dep, self.paths = dep, paths
        self.records: list[RankRecord] = []
        self.lock = threading.Lock()

    def started(self, rs: RankState, m: Member, s: Started, host: RemoteHost | None) -> None:
        rs.started(s.identity, s.pgid, s.popen, host, s.log_path)
        where = _home_of(self.dep, m, self.paths)
        rec = RankRecord(
            rank=rs.rank, host=m.host, pid=s.identity.pid, pgid=s.pgid,
            start_time=s.identity.start_time, cmdline=list(s.identity.cmdline),
            marker_dir=str(where.markers / self.dep.deployment_id), remote=s.remote,
            ssh=s.ssh, python=host.python if host else None,
            ssh_config=host.target.config_file if host else None,
            home=host.home if host else None)
        with self.lock:
            self.records = sorted([*self.records, rec], key=lambda r: r.rank)
            write_manifest(self.paths, self.dep.record_ranks(self.records))


def start_ranks(dep: Deployment, paths: Paths, me: SupervisorIdentity,
                settings: SupervisorSettings, launcher: Launcher, *, floor: int,
                extra_env: dict[str, str] | None = None,
                remote: SshLauncher | None = None) -> None:
    """Start every rank: local ones here, one after another; each remote host's in a
    thread of its own (files first, then its ranks)."""
    rec = _Recorder(dep, paths)
    local: list[Member] = []
    by_host: dict[int, list[Member]] = {}
    dep.ranks_planned()
    for m in dep.plan.members:
        (local.append(m) if m.local else by_host.setdefault(m.host_index, []).append(m))
    for m in local:
        rs = dep.ranks[m.index]
        spec_path = dep.job_dir / f"rank-{m.index}.spec.json"
        _spec(dep, m.index, paths, me, settings, floor).save(spec_path)
        env = _env(dep, m.index, paths, settings, dict(extra_env or {}))
        log_path = paths.logs / f"{dep.job_id}-rank{m.index}.log"
        try:
            started = launcher.start(settings.rank_argv(spec_path), env, log_path,
                                     rank=m.index, host_ssh=m.ssh)
        except LaunchFailed as exc:
            raise LaunchError(str(exc), rank=m.index) from None
        rec.started(rs, m, started, None)

    def host_ranks(members: list[Member]) -> None:
        _start_on_host(dep, members, paths, me, settings, floor, dict(extra_env or {}),
                       remote, rec)

    if by_host:
        parallel(host_ranks, list(by_host.values()))


def _start_on_host(dep: Deployment, members: list[Member], paths: Paths,
                   me: SupervisorIdentity, settings: SupervisorSettings, floor: int,
                   extra: dict[str, str], launcher: SshLauncher, rec: _Recorder) -> None:
    host = dep.remote_hosts[members[0].host_index]
    there = host.paths
    jd = there.runtime / "jobs" / dep.job_id
    files = [(str(there.secrets / f"{dep.job_id}.key"), dep.secret_path.read_bytes()),
             (str(jd / KV_KEY_FILE), (dep.job_dir / KV_KEY_FILE).read_bytes())]
    if (dep.job_dir / "hostfile.json").exists():
        files.append((str(jd / "hostfile.json"), (dep.job_dir / "hostfile.json").read_bytes()))
    for m in members:
        spec = _spec(dep, m.index, paths, me, settings, floor)
        spec.save(dep.job_dir / f"rank-{m.index}.spec.json")  # the supervisor's copy
        files.append((str(jd / f"rank-{m.index}.spec.json"),
                      (dep.job_dir / f"rank-{m.index}.spec.json").read_bytes()))
    try:
        parallel(lambda f: launcher.write_file(host, f[0], f[1]), files)
        for m in members:
            rs = dep.ranks[m.index]
            log_path = str(there.logs / f"{dep.job_id}-rank{m.index}.log")  # on that host
            argv = remote_rank_argv(settings.rank_command, host.python,
                                    str(jd / f"rank-{m.index}.spec.json"))
            env = remote_env(plan_envs=dep.plan.envs, extra=extra, rank=m.index,
                             home=host.home, job_id=dep.job_id, backend=dep.plan.backend,
                             hostfile=str(jd / "hostfile.json"),
                             coordinator=dep.jaccl_coordinator)
            rec.started(rs, m, launcher.spawn(host, argv, env, log_path, rank=m.index), host)
    except LaunchFailed as exc:
        raise LaunchError(str(exc), rank=members[0].index) from None


def describe_ranks(dep: Deployment) -> list[dict[str, Any]]:
    return [{"rank": r.rank, "pid": r.pid, "pgid": r.pgid, "host": r.host,
             "remote": r.remote is not None} for r in dep.ranks.values()]
