"""FastAPI wiring: state, routes, errors in each API's shape (errors.shaped), body cap, health and ready."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.bus import new_request_id
from common.envelope import Key
from common.messages import Generate
from services.gateway import (
    admin_api,
    anthropic_routes,
    console_api,
    openai_routes,
    responses_items,
    responses_routes,
)
from services.gateway.catch_all import CatchAll
from services.gateway.cluster_view import Cluster
from services.gateway.detok import ModelTokenizer
from services.gateway.errors import ApiError, shaped
from services.gateway.metrics import Metrics
from services.gateway.prepare_pool import PreparePool
from services.gateway.request_channel import Backend
from services.gateway.router import Router
from services.gateway.settings import GatewaySettings

log = logging.getLogger("lockstep.gateway")


class BodyTooLarge(Exception):
    pass


class Gateway:
    """Everything a request handler needs, on `app.state.gw`."""

    def __init__(self, settings: GatewaySettings, key: Key) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.cluster = Cluster(settings, key, self.metrics)
        self.metrics.cluster = self.cluster
        self.prepare_pool = PreparePool(settings.prepare_threads)
        self.router = Router(settings.route_imbalance, settings.route_index, self.metrics,
                             settings.route_policy)
        self._probe_lock = asyncio.Lock()

    def pick(self, model: str, n: int = 1) -> list[Backend]:
        """The serving deployments (replicas) of `model` that have room for `n` more
        requests; the router (router.py) chooses among them once the prompt is tokenized."""
        c = self.cluster
        cands = [b for b in c.backends.values() if names(b, model)]
        live = sorted((b for b in cands if not b.lost and not b.draining),
                      key=lambda b: b.deployment_id)
        if live:
            # one model path: replicas of one model share its tokenizer
            live = [b for b in live if b.model_path == live[0].model_path]
            # Continuations of this model's failed requests that wait for a deployment go
            # ahead of new requests (they were admitted once): room is kept for them.
            held = sum(1 for s in c.resuming if names(s.backend, model))
            roomy = [b for b in live if not b.full(n + held)]
            if not roomy:  # 429 before any tokenizing: the cheapest refusal under overload
                min(live, key=lambda b: b.active).check_room(n, held)
            return roomy
        if cands:  # rank 0 lost, seen by the gateway itself (rank_link.py)
            b = cands[0]
            raise ApiError(503, f"model {model!r} is not serving: deployment {b.deployment_id}: "
                           f"{b.lost}; waiting for the supervisor", code="model_not_ready",
                           headers={"retry-after": "5"})
        known = [d for d in c.deployments.values() if d.model == model]
        if known:
            d = known[0]
            why = f": {d.error}" if d.error else ""
            raise ApiError(503, f"model {model!r} is not serving: deployment {d.deployment_id} "
                           f"is {d.state}{why}", code="model_not_ready",
                           headers={"retry-after": "5"})
        if not c.backends:
            raise ApiError(503, f"no deployment is serving: {self.not_ready_reason()}",
                           code="no_serving_deployment", headers={"retry-after": "5"})
        have = sorted({b.model for b in c.backends.values()})
        raise ApiError(404, f"model {model!r} not found; serving: {', '.join(have)}",
                       param="model", code="model_not_found")

    async def tokenizer(self, b: Backend) -> ModelTokenizer:
        return await self.cluster.tokenizers.get(b.model_path, b.deployment_id)

    def view_is_stale(self) -> str | None:
        """Why the cluster view is too old to vouch for any deployment, or None."""
        age = self.cluster.view_age()
        if age is None or age <= self.settings.ready_view_max_age_s:
            return None
        why = self.cluster.supervisor_error or "no refresh"
        return f"the supervisor's last answer is {age:.0f}s old ({why})"

    def not_ready_reason(self) -> str:
        c = self.cluster
        if c.supervisor_error:
            return c.supervisor_error
        if not c.deployments:
            return "no deployment (deploy one: POST /admin/api/cluster/deployments)"
        return "; ".join(f"deployment {d.deployment_id} is {d.state}"
                         + (f" ({d.error})" if d.error else "")
                         for d in c.deployments.values())

    async def probe(self, b: Backend) -> bool:
        """A one-token greedy generation through rank 0: the canary, refreshed."""
        async with self._probe_lock:
            fresh = self.settings.canary_fresh_s
            if b.last_ok_at and time.time() - b.last_ok_at <= fresh:
                return True
            try:
                tok = await self.tokenizer(b)
                ids = tok.encode("ping") or [0]
                s = await b.generate(Generate(request_id=new_request_id(), prompt=ids, max_tokens=1,
                                              stop_token_ids=[], client="gateway-canary"))
            except Exception:  # noqa: BLE001
                return False
            try:
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline:
                    body = await s.next(deadline - time.monotonic())
                    if body is not None and body.finish_reason:
                        break
            finally:
                s.release("canary_timeout")
            return b.last_ok_at is not None and time.time() - b.last_ok_at <= fresh


def names(b: Backend, model: str) -> bool:
    """A request's `model` names a backend by its id (a directory name, or the repo id of
    a Hugging Face snapshot: common/model_ref.py) or by its model directory's path."""
    if model == b.model:
        return True
    if not b.model_path or not model.startswith(("/", "~")):
        return False
    return os.path.realpath(os.path.expanduser(model)) == os.path.realpath(b.model_path)


class BodyLimit:
    """Pure ASGI middleware: bodies over the cap get 413 (declared or streamed)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                resp = shaped(scope.get("path", ""), ApiError(
                    413, f"request body of {int(v)} bytes exceeds the limit of "
                    f"{self.max_bytes} bytes", code="request_too_large"))
                return await resp(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return msg

        return await self.app(scope, limited, send)


def create_app(settings: GatewaySettings, key: Key) -> FastAPI:
    gw = Gateway(settings, key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.cluster.start()
        try:
            yield
        finally:
            await gw.cluster.stop()
            gw.prepare_pool.close()

    app = FastAPI(title="lockstep gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gw = gw
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)  # /v1/messages: Anthropic's Messages API
    app.include_router(responses_routes.router)  # /v1/responses: OpenAI's Responses API
    app.include_router(responses_items.router)  # GET /v1/responses/{id}/input_items
    app.include_router(admin_api.router)
    app.include_router(console_api.router)  # /admin/ (the page) and its routes

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return shaped(request.url.path, exc)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return shaped(request.url.path, ApiError(
            413, f"request body exceeds the limit of {settings.max_body_bytes} bytes",
            code="request_too_large"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in e.get("loc", ())[1:]) or None
        return shaped(request.url.path, ApiError(
            400, f"invalid value for '{param}': {e.get('msg', 'invalid')}", param=param,
            code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return shaped(request.url.path, ApiError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "supervisor": gw.cluster.supervisor_error is None,
                "active": gw.cluster.active}

    @app.get("/ready")
    async def ready() -> Response:
        # Ready = some deployment the supervisor lately said is serving, with a request
        # channel, its tokenizer loaded, and a fresh proof that it generates.
        fresh_s = settings.canary_fresh_s
        stale = gw.view_is_stale()
        report = []
        ok = False
        for d in gw.cluster.serving():
            b = gw.cluster.backends.get(d.deployment_id)
            b = None if b is None or b.lost else b  # rank 0 lost: not ready, whatever the canary
            tok = gw.cluster.tokenizers.state(d.model_path)
            tok_ok = gw.cluster.tokenizers.loaded(d.model_path)
            at = gw.cluster.canary_at(d)
            fresh = at is not None and time.time() - at <= fresh_s
            if not fresh and b is not None and stale is None and tok_ok:
                fresh = await gw.probe(b)
                at = gw.cluster.canary_at(d)
            report.append({"deployment_id": d.deployment_id, "model": d.model,
                           "canary_at": at, "canary_fresh": fresh, "tokenizer": tok})
            ok = ok or (fresh and b is not None and tok_ok)
        ok = ok and stale is None
        body = {"ready": ok, "deployments": report}
        if not ok:
            body["reason"] = stale or (gw.not_ready_reason() if not report else
                                       "no serving deployment has a loaded tokenizer and a "
                                       "fresh canary")
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CatchAll)
    return app
