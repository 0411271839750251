"""Admin HTTP API under /admin/api/cluster (DESIGN.md section 8), bearer token only.

Each route forwards one command to the supervisor's admin socket and maps its stable
error code to an HTTP status (`signature_mismatch` → 409). Two routes add the
gateway's own evidence:
- `POST /abort-all`: aborts the gateway's streams, has the supervisor broadcast the
  cancel and wait for zero active on every rank, then waits for the gateway's own
  counter to reach zero; the reply is that evidence.
- `POST /deployments/{id}/unload` (and `DELETE /deployments/{id}`): the quiescence
  gate. With active requests it is refused (409 `active_requests`) unless `force`,
  which runs abort-all for that deployment and needs zero-active evidence from every
  rank (DELETE with force falls back on verified teardown as the proof); then the
  supervisor's verified teardown. While another replica of the model serves (or with
  `drain: true`) it drains first: the router sends nothing new there and in-flight
  requests finish there, up to `drain_timeout_s` (120).
`POST /deployments/{id}/cache-clear` empties every rank's prefix cache through the plan
(the supervisor's `cache_clear`: rank 0 confirms the step; 504 `timeout` if it did not).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from common.deployment_info import DeploymentInfo
from common.messages import commands
from common.messages.commands import ReplyError, args_wire, command_of
from common.request_params import deployable
from common.schema import SchemaError, decode_into, to_wire
from services.gateway.core.cluster_view import AdminTimeout, SupervisorUnavailable
from services.gateway.core.errors import ADMIN_STATUS, ApiError
from services.gateway.core.request_body import parse_json
from services.gateway.core.router import load as route_load

TELEMETRY_SETTLE_S = 5.0  # after a drain, for every rank's telemetry to show it

router = APIRouter(prefix="/admin/api/cluster")
DEPLOY_WAIT_S = 600.0
REAP_WAIT_S = 180.0
STOP_WAIT_S = 120.0
CACHE_CLEAR_WAIT_S = 600.0  # the longest deadline the supervisor accepts


class _Args(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _SamplingArgs(_Args):
    """A deployment's sampling defaults (common/sampling_defaults.py): one field per
    deployable parameter (common/request_params.py); the supervisor checks the ranges and
    refuses with a 400 naming the field."""

    model_config = ConfigDict(strict=False, extra="forbid")  # 0 for 0.0 is fine


SamplingArgs = create_model(  # type: ignore[call-overload]
    "SamplingArgs", __base__=_SamplingArgs,
    **{p.name: (p.kind | None, None) for p in deployable()})


class DeployArgs(_Args):
    model_path: str | None = None
    tp: int = Field(default=1, ge=1, le=64)
    pp: int = Field(default=1, ge=1, le=64)
    hosts: list[dict[str, Any]] | None = None  # host records (an mlx.launch hostfile's "hosts")
    backend: Literal["auto", "ring", "jaccl", "mpi"] = "auto"
    deployment_id: str | None = None
    wait: bool = False  # HTTP default: answer at once, watch /ready or GET /deployments
    envs: list[str] = Field(default_factory=list)
    sampling: SamplingArgs | None = None
    replicas: int = Field(default=1, ge=1, le=16)  # N deployments of the model, one name
    replica: int | None = Field(default=None, ge=0, le=15)  # only that one of `replicas`


class UnloadArgs(_Args):
    force: bool = False
    timeout_s: float | None = Field(default=None, gt=0, le=300)
    # replicas: with another replica of the model serving (drain null), or drain true, new
    # requests go elsewhere and in-flight ones finish here first, up to drain_timeout_s
    drain: bool | None = None
    drain_timeout_s: float = Field(default=120.0, gt=0, le=3600)


class AbortAllArgs(_Args):
    deployment_id: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=300)


class CacheClearArgs(_Args):
    timeout_s: float | None = Field(default=None, gt=0, le=600)  # None: the supervisor's


class BackendArgs(_Args):
    hosts: list[dict[str, Any]]
    backend: Literal["auto", "ring", "jaccl", "mpi"] = "auto"


class ReplanArgs(_Args):
    deployment_id: str
    backend: Literal["auto", "ring", "jaccl", "mpi"] = "auto"
    signature: str | None = None
    force: bool = False


def require_admin(request: Request) -> None:
    token = request.app.state.gw.settings.resolved_admin_token()
    if not token:
        raise ApiError(401, "the admin API is closed: no admin token is configured "
                       "(LOCKSTEP_ADMIN_TOKEN or $LOCKSTEP_HOME/admin.token)", code="admin_disabled")
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise ApiError(401, "missing admin token: send 'Authorization: Bearer <token>'",
                       code="invalid_admin_token")
    if not hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
        raise ApiError(401, "invalid admin token", code="invalid_admin_token")


async def _args(request: Request, cls: type[_Args]) -> Any:
    raw = await request.body()
    obj = parse_json(raw) if raw.strip() else {}
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        e = exc.errors()[0]
        param = ".".join(str(p) for p in e.get("loc", ())) or None
        raise ApiError(400, f"invalid value for '{param}': {e.get('msg')}", param=param,
                       code="invalid_value") from None


async def call(request: Request, command: str, args: dict | None = None,
               timeout: float | None = None) -> dict:
    """Forward one admin command; an error reply becomes an OpenAI-shaped error."""
    gw = request.app.state.gw
    try:
        reply = await gw.cluster.admin(command, args or {}, timeout=timeout)
    except SupervisorUnavailable as exc:
        if (why := gw.cluster.restarting()) is None:
            raise_unavailable(gw, command, exc)
        gw.metrics.admin_calls.labels(command=command, code="supervisor_restarting").inc()
        raise ApiError(503, f"supervisor restarting: {why}; the model keeps serving, retry "
                       "the command shortly", code="supervisor_restarting") from None
    gw.metrics.admin_calls.labels(command=command, code=reply.code or ("ok" if reply.ok else "?")).inc()
    if not reply.ok:
        raise ApiError(ADMIN_STATUS.get(reply.code, 500), reply.message or reply.code,
                       code=reply.code, data=dict(reply.data) or None)
    gw.cluster.wake()
    return dict(reply.data)


def raise_unavailable(gw, command: str, exc: SupervisorUnavailable) -> None:
    try:
        raise exc
    except AdminTimeout as exc:
        gw.metrics.admin_calls.labels(command=command, code="timeout").inc()
        raise ApiError(504, f"no reply from the supervisor in time ({exc}); the command may "
                       "still be running: check GET /admin/api/cluster/status",
                       code="timeout") from None
    except SupervisorUnavailable as exc:
        gw.metrics.admin_calls.labels(command=command, code="unavailable").inc()
        raise ApiError(503, f"supervisor unavailable: {exc}", code="supervisor_unavailable") from None


def args_of(cls: type, fields: dict) -> Any:
    """An admin command's Args from a validated HTTP body (the supervisor checks ranges
    and answers `bad_request` naming the field)."""
    try:
        return decode_into(cls, fields)
    except SchemaError as exc:
        raise ApiError(400, f"invalid value: {exc.reason}: {exc.detail}", param=exc.detail,
                       code="invalid_value") from None


async def run(request: Request, args: Any, timeout: float | None = None) -> dict:
    """Forward the command whose Args `args` is; its reply's data, for the HTTP answer."""
    return await call(request, command_of(args).name, args_wire(args), timeout)


async def ask(request: Request, args: Any, timeout: float | None = None) -> Any:
    """Like run, the reply decoded once into the command's Reply, for a reader."""
    cmd = command_of(args)
    data = await call(request, cmd.name, args_wire(args), timeout)
    try:
        return cmd.decode(data)
    except ReplyError as exc:
        raise ApiError(502, str(exc), code="bad_supervisor_reply") from None


@router.get("/status")
async def status(request: Request) -> dict:
    require_admin(request)
    gw = request.app.state.gw
    data = await run(request, commands.status.Args())
    data["gateway"] = {"active": gw.cluster.active,
                       "backends": {k: b.active for k, b in gw.cluster.backends.items()},
                       # replicas: each one's load (router.py) and requests routed there
                       "routing": {k: {"load": route_load(b), "routed": gw.router.routed[k],
                                       "draining": b.draining,
                                       # rank 0's prefix cache, from its events (cache_index.py)
                                       "cache_index": b.cache_index.summary()}
                                   for k, b in gw.cluster.backends.items()},
                       # seen by the gateway itself (rank_link.py): not routed to
                       "rank0_lost": {k: b.lost for k, b in gw.cluster.backends.items() if b.lost},
                       "events_seen": gw.cluster.events_seen, "event_gaps": gw.cluster.gaps.gaps,
                       "refreshed_at": gw.cluster.refreshed_at,
                       # requests resumed elsewhere, by the deployment that failed them
                       "resumed": dict(gw.cluster.resumed_from),
                       "recent_resumes": list(gw.cluster.resume_log),  # where each went
                       "resuming": len(gw.cluster.resuming),
                       # waiting for a redeploy of their model (admit_wait.py)
                       "admit_waiting": gw.cluster.admit_waiting}
    # The reaper has no admin socket: its counters arrive on its events (cluster_view.py).
    data["rejections"] = [*(data.get("rejections") or []), *gw.cluster.reaper_rejections]
    return data


# What GET /deployments adds to each of the supervisor's DeploymentInfo records (the
# gateway's own view); strip these before reading one with the strict reader.
GATEWAY_FIELDS = ("gateway_active",)


@router.get("/deployments")
async def deployments(request: Request) -> dict:
    require_admin(request)
    data = await run(request, commands.deployments.Args())
    backends = request.app.state.gw.cluster.backends
    for d in data.get("deployments") or []:
        if isinstance(d, dict):
            b = backends.get(d.get("deployment_id"))
            d["gateway_active"] = b.active if b else 0
    return data


@router.post("/deployments")
async def deploy(request: Request) -> dict:
    require_admin(request)
    a = await _args(request, DeployArgs)
    return await run(request, args_of(commands.deploy.Args, a.model_dump()),
                     timeout=DEPLOY_WAIT_S if a.wait else 30.0)


async def abort_all(request: Request, deployment_id: str | None, timeout_s: float | None) -> dict:
    gw = request.app.state.gw
    t0 = time.monotonic()
    timeout = timeout_s or gw.settings.abort_all_timeout_s
    backends = [b for k, b in gw.cluster.backends.items() if deployment_id in (None, k)]
    for b in backends:
        b.abort_local("abort_all")
    # Requests waiting to resume: those the aborted deployment failed (still bound to it
    # until a continuation moves them) or, for a global abort-all, every one.
    for s in list(gw.cluster.resuming):
        if deployment_id in (None, s.backend.deployment_id):
            s.abort_reason = s.abort_reason or "abort_all"
    if deployment_id is None:  # requests waiting for a redeploy belong to no deployment
        gw.cluster.admit_aborts += 1
    reply = await ask(request, commands.abort_all.Args(deployment_id, timeout), timeout=timeout + 10.0)
    left = max(0.5, timeout - (time.monotonic() - t0))
    gw_active = 0
    for b in backends:
        gw_active += await b.settle(left)
    ev = to_wire(reply)  # the supervisor's evidence, and the gateway's beside it
    ev["gateway_active"] = gw_active
    ev["zero_active"] = reply.zero_active and gw_active == 0
    ev["elapsed_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return ev


@router.post("/abort-all")
async def abort_all_route(request: Request) -> dict:
    require_admin(request)
    a = await _args(request, AbortAllArgs)
    return await abort_all(request, a.deployment_id, a.timeout_s)


async def _unload(request: Request, dep_id: str, force: bool, timeout_s: float | None,
                  teardown_is_proof: bool, drain: bool | None = None,
                  drain_timeout_s: float = 120.0) -> dict:
    gw = request.app.state.gw
    b = gw.cluster.backends.get(dep_id)
    drained = None  # first, so that what follows sees the ranks after the drain
    if b is not None and (drain or (drain is None and _other_replica(gw, b))):
        drained = await _drain(b, drain_timeout_s)
    info = await _info(request, dep_id)
    if drained is not None and not drained["left"]:
        # drained at the gateway: the ranks' telemetry says so within its period
        settle = time.monotonic() + TELEMETRY_SETTLE_S
        while any(r.active for r in info.ranks) and time.monotonic() < settle:
            await asyncio.sleep(0.2)
            info = await _info(request, dep_id)
    ranks = {str(r.rank): r.active for r in info.ranks}
    rank0 = None
    if b is not None:
        try:
            rank0 = (await b.stats(timeout=2.0)).active
        except Exception:  # noqa: BLE001 - rank 0 not answering: rely on telemetry
            rank0 = None
    active = {"gateway_active": b.active if b else 0, "ranks": ranks, "rank0_active": rank0}
    busy = active["gateway_active"] or any(ranks.values()) or rank0
    evidence = None
    if busy and not force:
        if b is not None:
            b.draining = False  # not unloading after all: it serves again
        raise ApiError(409, f"deployment {dep_id} has active requests; abort them first or "
                       "unload with force=true", code="active_requests", data=active)
    if busy or force:
        evidence = await abort_all(request, dep_id, timeout_s)
        if not evidence.get("zero_active") and not teardown_is_proof:
            raise ApiError(409, "abort-all did not prove zero active requests on every rank; "
                           "not unloading (DELETE with force=true tears down anyway, the "
                           "verified teardown being the proof)", code="active_requests",
                           data=evidence)
    teardown = await run(request, commands.stop.Args(dep_id, bool(force)), timeout=STOP_WAIT_S)
    await _refresh(gw)
    return {"deployment_id": dep_id, "active_before": active, "evidence": evidence,
            "drained": drained, "teardown": teardown}


async def _info(request: Request, dep_id: str) -> DeploymentInfo:
    info = (await ask(request, commands.deployments.Args())).get(dep_id)
    if info is None:
        raise ApiError(404, f"no deployment {dep_id!r}", code="not_found")
    return info


def _other_replica(gw, b) -> bool:
    """Another deployment of b's model serves: b's requests can be routed there."""
    return any(o is not b and o.model == b.model and not o.lost and not o.closed
               and not o.draining for o in gw.cluster.backends.values())


async def _drain(b, timeout_s: float) -> dict:
    """No new requests to `b` (the router skips it); wait for its in-flight ones to
    finish there, up to `timeout_s`. A stop is a cancellation for whatever it then ends,
    never a failure to resume."""
    b.draining = True
    t0 = time.monotonic()
    before = b.active
    while b.active and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.1)
    return {"in_flight": before, "left": b.active, "waited_s": round(time.monotonic() - t0, 3)}


async def _refresh(gw) -> None:
    try:
        await gw.cluster.refresh()
    except SupervisorUnavailable:
        pass


@router.post("/deployments/{dep_id}/unload")
async def unload(dep_id: str, request: Request) -> dict:
    require_admin(request)
    a = await _args(request, UnloadArgs)
    return await _unload(request, dep_id, a.force, a.timeout_s, teardown_is_proof=False,
                         drain=a.drain, drain_timeout_s=a.drain_timeout_s)


@router.delete("/deployments/{dep_id}")
async def delete(dep_id: str, request: Request) -> dict:
    require_admin(request)  # before any validation: no token, no hint about the arguments
    return await _unload(request, dep_id, _flag(request, "force"), None, teardown_is_proof=True)


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter: true/false/1/0 (absent: false)."""
    raw = request.query_params.get(name)
    if raw is None:
        return False
    val = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower())
    if val is None:
        raise ApiError(400, f"invalid value for '{name}': expected true or false",
                       param=name, code="invalid_value")
    return val


@router.post("/deployments/{dep_id}/cache-clear")
async def cache_clear(dep_id: str, request: Request) -> dict:
    require_admin(request)
    a = await _args(request, CacheClearArgs)
    # The supervisor answers by its own deadline (timeout_s, else its cancel_timeout).
    return await run(request, commands.cache_clear.Args(dep_id, a.timeout_s),
                     timeout=(a.timeout_s or CACHE_CLEAR_WAIT_S) + 10.0)


@router.post("/backend-selection")
async def backend_selection(request: Request) -> dict:
    require_admin(request)
    a = await _args(request, BackendArgs)
    return await run(request, args_of(commands.backend_selection.Args, a.model_dump()))


@router.post("/replan")
async def replan(request: Request) -> dict:
    require_admin(request)
    a = await _args(request, ReplanArgs)
    # Applying (a signature given) is a verified stop plus a whole launch and canary.
    return await run(request, args_of(commands.replan.Args, a.model_dump()),
                     timeout=DEPLOY_WAIT_S if a.signature else 60.0)


@router.post("/reap")
async def reap(request: Request) -> dict:
    require_admin(request)
    # A pass may wait for one already running, then walk SIGTERM -> SIGKILL -> proof.
    return await run(request, commands.reap.Args(), timeout=REAP_WAIT_S)
