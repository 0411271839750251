"""Deployment orchestration: deploy (reap → plan → launch → barrier → serve → canary),
stop (verified teardown, refused with active requests unless forced), replan, and the
bookkeeping after a teardown: proven → manifest, secret, job files and markers removed
and the deployment gone; not proven → `teardown_failed`, manifest and state kept with
the evidence, so the next stop retries."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import secrets
import shutil
import time
from typing import TYPE_CHECKING, Any

from common.bus import BusTimeout, Channel, new_request_id
from common.home import manifest_path, remove_manifest, retire_markers, write_manifest
from common.messages import REQUESTS_OUT, EventName, Shutdown, Stats, StatsRequest
from common.rankspec import KvBudgetRefused
from common.rpc_client import AsyncRpcClient
from common.sampling_defaults import SamplingOverrides
from services.supervisor import job_launch, readiness, remote_ops
from services.supervisor import replicas as replicas_mod
from services.supervisor.canary import run_canary
from services.supervisor.deployment import LIVE, Deployment
from services.supervisor.deployment_state import Claim
from services.supervisor.deployment_state import DeploymentState as S
from services.supervisor.errors import AdminError, LaunchError, TeardownError, survivor_text
from services.supervisor.plan import DeployPlan, make_plan, signature
from services.supervisor.teardown import TeardownOutcome, verified_teardown

if TYPE_CHECKING:
    from services.supervisor.interfaces import LaunchHost, LifecycleHost, TeardownHost

log = logging.getLogger("lockstep.supervisor")
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
STATS_TIMEOUT_S = 2.0
LAUNCH_FAILURE_GRACE_S = 1.0  # a rank stuck in load ignores control: don't wait long


def new_id(prefix: str) -> str:
    return f"{prefix}{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


async def default_model(sup: LifecycleHost) -> str:
    from models.tinymodel import build_model

    async with sup.model_lock:
        path = await asyncio.to_thread(build_model, sup.paths.models / "tiny")
    return str(path)


def get(sup: LifecycleHost, deployment_id: str) -> Deployment:
    dep = sup.deployments.get(deployment_id)
    if dep is None:
        raise AdminError("not_found", f"no deployment {deployment_id!r}")
    return dep


# --- deploy ---------------------------------------------------------------------------


async def deploy(sup: LifecycleHost, *, model_path: str | None, tp: int, pp: int, hosts, backend: str,
                 deployment_id: str | None, wait: bool, envs: list[str],
                 sampling: SamplingOverrides | None = None, replicas: int = 1,
                 replica: int | None = None) -> dict[str, Any]:
    """One deployment; with `replicas` > 1 and no `replica`, every replica (ids
    `<id>-r<i>`, the reply lists them); with `replica`, that one alone (as `up` does, to
    redeploy one replica while the others serve)."""
    replicas_mod.check(replicas, replica)
    base = deployment_id or new_id("d-")
    which = [replica] if replica is not None else list(range(replicas))
    ids = [base if replicas == 1 or replica is not None else replicas_mod.replica_id(base, r)
           for r in which]
    for dep_id in ids:
        if not ID_RE.fullmatch(dep_id):
            raise AdminError("bad_request", f"deployment_id: {dep_id!r} must match {ID_RE.pattern}")
        old = sup.deployments.get(dep_id)
        if old is not None and (old.state in LIVE or old.state == S.TEARDOWN_FAILED or old.busy):
            raise AdminError("conflict", f"deployment {dep_id} exists ({old.state}); stop it first")
    if model_path is None:
        model_path = await default_model(sup)
    if hosts is None and sup.default_hosts is not None:  # `lockstep supervisor --hosts FILE`
        hosts = sup.default_hosts.hosts
        envs = [*sup.default_hosts.envs, *envs]
        backend = sup.default_hosts.backend_for(backend)
    # every plan before anything starts: a bad placement refuses the whole request
    plans = [make_plan(model_path, tp, pp, replicas_mod.place(hosts, r, replicas, tp * pp)
                       if replicas > 1 else hosts, backend, envs, sampling,
                       replica=r, replicas=replicas) for r in which]
    for p in plans:  # an auto KV budget of nothing refuses the deploy, with the numbers
        try:
            job_launch.kv_budget(sup.settings, p)
        except KvBudgetRefused as exc:
            raise AdminError("bad_request", f"kv_budget_bytes: {exc}") from None
    if len(ids) == 1:
        return await start(sup, ids[0], plans[0], wait=wait)
    results = [await start(sup, i, p, wait=False) for i, p in zip(ids, plans, strict=True)]
    if wait:
        await asyncio.gather(*(asyncio.shield(sup.deployments[i].launch_task) for i in ids
                               if sup.deployments[i].launch_task is not None))
        results = [{"deployment_id": i, "job_id": sup.deployments[i].job_id,
                    "state": sup.deployments[i].state.value} for i in ids]
    return {**results[0], "deployments": results}


async def start(sup: LifecycleHost, dep_id: str, plan: DeployPlan, *, wait: bool) -> dict[str, Any]:
    await sup.reap()  # raises reap_blocked: nothing is spawned
    if dep_id in sup.deployments and sup.deployments[dep_id].busy:
        raise AdminError("conflict", f"deployment {dep_id} is busy")
    dep = Deployment(dep_id, new_id("j-"), plan)
    dep.life.claim(Claim.LAUNCH)
    sup.deployments[dep_id] = dep
    sup.set_state(dep, S.LAUNCHING, f"backend {plan.backend}, world size {plan.world_size}")
    task = sup.spawn(_launch(sup, dep))
    dep.launching(task)
    if not wait:
        return {"deployment_id": dep_id, "job_id": dep.job_id, "state": dep.state.value}
    await asyncio.shield(task)
    return {"deployment_id": dep_id, "job_id": dep.job_id, "state": dep.state.value}


async def _launch(sup: LaunchHost, dep: Deployment) -> None:
    s = sup.settings
    def aborted() -> str | None:
        return dep.abort_reason

    try:
        try:
            if any(not m.local for m in dep.plan.members):
                await remote_ops.launch_remote(sup, dep)
            else:
                job_launch.prepare(dep, sup.paths, sup.me)
                sup.sockets.add_report_route(dep.keys.report, dep.report, dep)
                job_launch.start_ranks(dep, sup.paths, sup.me, s, sup.launcher,
                                   floor=sup.epochs.current, extra_env=sup.rank_env)
            sup.set_state(dep, S.LOADING, f"{dep.world_size} rank(s) started")
            await readiness.wait_ready(dep, sup.paths, s.load_timeout, aborted)
            await readiness.release_serve(dep, sup.paths, lambda b: sup.publish_dep(dep, b),
                                          min(30.0, s.load_timeout), aborted)
            sup.set_state(dep, S.CANARY, "every rank ready and serving")
            tokens = await run_canary(dep, sup.ctx, sup.me.sender, runs=s.canary_runs,
                                      window_s=s.canary_window_s, tokens=s.canary_tokens,
                                      timeout=s.canary_timeout_s,
                                      aborted=lambda: aborted() or _lost(dep))
            dep.canary_passed()
            dep.life.release()
            sup.set_state(dep, S.SERVING, f"canary passed {s.canary_runs}x: tokens {tokens}")
        except asyncio.CancelledError:  # the supervisor is closing: leave nothing running
            await _fail_launch(sup, dep, LaunchError("launch cancelled: supervisor closing"))
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke, tear down and report it
            err = exc if isinstance(exc, LaunchError) else LaunchError(
                f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, LaunchError):
                log.exception("launch of %s failed", dep.deployment_id)
            await _fail_launch(sup, dep, err)
    finally:
        dep.life.release()


def _lost(dep: Deployment) -> str | None:
    for rs in dep.ranks.values():
        if rs.popen is not None and rs.popen.poll() is not None:
            return f"rank {rs.rank} exited with code {rs.popen.returncode}"
        if rs.remote is not None and rs.exited:
            return f"rank {rs.rank} on {rs.remote.describe()} is gone ({rs.remote_state})"
    return None


async def _fail_launch(sup: TeardownHost, dep: Deployment, err: LaunchError) -> None:
    dep.record_error(str(err))
    sup.incident(dep, EventName.LAUNCH_FAILED, dep.error, {"job_id": dep.job_id, "rank": err.rank})
    try:
        outcome = await teardown(sup, dep, graceful_s=min(LAUNCH_FAILURE_GRACE_S,
                                                          sup.settings.graceful_timeout))
    except TeardownError as td:
        err.teardown = td
        dep.launch_failed(err, None)
        return
    dep.launch_failed(err, outcome.to_wire())
    sup.set_state(dep, S.FAILED, dep.error)


# --- teardown bookkeeping --------------------------------------------------------------


def _finalize(sup: TeardownHost, dep: Deployment) -> None:
    """Verified: remove the manifest, the launch secret, the job files and the markers."""
    remove_manifest(sup.paths, dep.job_id)
    if dep.secret_path is not None:
        with contextlib.suppress(FileNotFoundError):
            dep.secret_path.unlink()
    if dep.job_dir is not None:
        shutil.rmtree(dep.job_dir, ignore_errors=True)
    with contextlib.suppress(ValueError, OSError):
        retire_markers(sup.paths, dep.deployment_id)
    if dep.keys is not None:
        sup.sockets.drop_report_route(dep.keys.report)


async def teardown(sup: TeardownHost, dep: Deployment, *, graceful_s: float | None = None,
                   final: bool = True) -> TeardownOutcome:
    """Verified teardown; raises TeardownError if not proven, with the evidence kept in
    the manifest. `final` (a stop): the state becomes teardown_failed; not final (an
    attempt after a failure, retried: after_failure): the state is left to the caller."""
    s = sup.settings
    dep.stop_watching_remote()
    body = Shutdown(deployment_id=dep.deployment_id, job_id=dep.job_id, reason="stop")
    outcome = await verified_teardown(
        dep, sup.paths, publish_shutdown=lambda: sup.publish_dep(dep, body),
        graceful_s=s.graceful_timeout if graceful_s is None else graceful_s,
        stop_timeout=s.stop_timeout, kill_timeout=s.kill_timeout, seams=sup.seams)
    dep.record_teardown(outcome.to_wire())
    if outcome.proven:
        await remote_ops.remove_remote_files(sup, dep)
        _finalize(sup, dep)
        return outcome
    err = TeardownError(dep.deployment_id, outcome.survivors, outcome.to_wire())
    record_unproven(sup, dep, str(err))
    if final:
        sup.set_state(dep, S.TEARDOWN_FAILED, str(err))
        sup.incident(dep, EventName.TEARDOWN_FAILED, str(err), {"outcome": outcome.to_wire()})
    raise err


def record_unproven(sup: TeardownHost, dep: Deployment, why: str) -> None:
    """An unproven teardown, appended to the manifest (kept: the reaper and the next stop
    start from it). Never one that a proven teardown has removed."""
    if dep.manifest is None or not manifest_path(sup.paths, dep.job_id).exists():
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_manifest(sup.paths, dep.add_teardown_failure(f"{stamp} supervisor: {why}"))


# --- stop -------------------------------------------------------------------------------


async def stop(sup: LifecycleHost, deployment_id: str, *, force: bool) -> dict[str, Any]:
    dep = get(sup, deployment_id)
    task = dep.launch_task
    if task is not None and not task.done():
        dep.request_abort("stop requested")
        await asyncio.shield(task)
        if dep.state == S.TEARDOWN_FAILED:
            raise _teardown_admin_error(dep)
        if dep.state == S.FAILED:  # the launch tore itself down, verified
            sup.deployments.pop(deployment_id, None)
            sup.set_state(dep, S.STOPPED, "stopped during launch")
            return {"deployment_id": deployment_id, "outcome": dep.teardown or {}}
    failing = dep.failure_task
    if failing is not None and not failing.done():
        # The post-failure teardown is bounded (after_failure): wait for its proof
        # rather than race it on the same ranks.
        log.info("stop of %s waits for the teardown after its failure", deployment_id)
        await asyncio.shield(failing)
    if dep.busy:
        raise AdminError("conflict", f"deployment {deployment_id} is busy ({dep.state})")
    abort = None
    active = await active_requests(sup, dep) if dep.state in LIVE else 0
    if active:
        if not force:
            raise AdminError("active_requests", f"deployment {deployment_id} has {active} active "
                             "request(s); abort them first or stop with force",
                             {"active": active})
        abort = await sup.broadcaster.abort_all([dep], sup.settings.abort_all_timeout,
                                                reason="forced stop")
    if not dep.life.claim(Claim.STOP):  # taken while rank 0 counted its requests
        raise AdminError("conflict", f"deployment {deployment_id} is busy ({dep.state})")
    previous = dep.state
    try:
        sup.set_state(dep, S.STOPPING, "stop requested" + (" (forced)" if force else ""))
        try:
            outcome = await teardown(sup, dep)
        except TeardownError:
            raise _teardown_admin_error(dep) from None
    finally:
        dep.life.release()
    sup.deployments.pop(deployment_id, None)
    sup.set_state(dep, S.STOPPED, f"verified teardown: {' -> '.join(outcome.path) or 'none alive'}"
                  f" (was {previous})")
    reply = {"deployment_id": deployment_id, "outcome": outcome.to_wire()}
    if abort is not None:
        reply["abort"] = abort
    return reply


async def active_requests(sup: LifecycleHost, dep: Deployment) -> int:
    """Active requests as rank 0 counts them now (a fresh STATS): telemetry lags by up to
    one interval either way, so a request admitted since the last report counts too. Only
    when rank 0 cannot answer (not serving, or no reply in time) does telemetry decide."""
    active = dep.active_requests()
    if dep.keys is None or (not active and dep.state != S.SERVING):
        return active
    channel = Channel("supervisor", "stats", sender=sup.me.sender, send_key=dep.keys.requests,
                      accept=REQUESTS_OUT)
    client = AsyncRpcClient(sup.ctx, dep.requests_endpoint, channel)
    try:
        msg = await client.call(StatsRequest(request_id=new_request_id()), STATS_TIMEOUT_S)
        return max(0, msg.body.active) if isinstance(msg.body, Stats) else active
    except BusTimeout:
        return active
    finally:
        client.close()


def _teardown_admin_error(dep: Deployment) -> AdminError:
    td = dep.teardown or {}
    names = ", ".join(survivor_text(s) for s in td.get("survivors", []))
    return AdminError("teardown_failed", f"teardown of {dep.deployment_id} not proven; still "
                      f"alive: {names}; state and manifest kept, stop again to retry",
                      {"deployment_id": dep.deployment_id, "outcome": td})


def launch_failure(dep: Deployment) -> AdminError:
    err: LaunchError | None = dep.launch_error
    data: dict[str, Any] = {"deployment_id": dep.deployment_id, "job_id": dep.job_id,
                            "state": dep.state.value, "error": dep.error,
                            "rank": err.rank if err else None, "teardown": dep.teardown}
    msg = dep.error or "launch failed"
    if err is not None and err.teardown is not None:
        data["teardown_error"] = str(err.teardown)
        msg += f" (teardown failed too: {err.teardown})"
    return AdminError("launch_failed", msg, data)


# --- replan -----------------------------------------------------------------------------


async def replan(sup: LifecycleHost, deployment_id: str, backend: str, sig: str | None,
                 force: bool = False) -> dict[str, Any]:
    dep = get(sup, deployment_id)
    if dep.busy:
        raise AdminError("conflict", f"deployment {deployment_id} is busy ({dep.state})")
    p = dep.plan
    plan = make_plan(p.model_path, p.tp, p.pp, p.hosts, backend, p.envs, p.sampling_given,
                     replica=p.replica, replicas=p.replicas)
    expected = signature(sup.cluster_key.secret, deployment_id, dep.job_id, plan)
    if sig is None:
        return {"preview": True, "plan": plan.to_wire(), "current": p.to_wire(),
                "signature": expected}
    if not hmac.compare_digest(sig, expected):
        raise AdminError("signature_mismatch", "the signature does not match the current "
                         "plan for this deployment; request a new preview",
                         {"deployment_id": deployment_id})
    if dep.state in LIVE:
        await stop(sup, deployment_id, force=force)
    sup.deployments.pop(deployment_id, None)
    result = await start(sup, deployment_id, plan, wait=True)
    return {"preview": False, **result}
