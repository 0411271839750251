"""FastAPI wiring: state, routes, errors in each API's shape (errors.shaped), body cap, health and ready."""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.envelope import Key
from services.gateway.admin import api as admin_api
from services.gateway.admin import console_api
from services.gateway.anthropic import routes as anthropic_routes
from services.gateway.catch_all import CatchAll
from services.gateway.core.errors import ApiError, shaped
from services.gateway.core.gateway_core import Gateway
from services.gateway.core.settings import GatewaySettings
from services.gateway.openai import routes as openai_routes
from services.gateway.responses import items as responses_items
from services.gateway.responses import routes as responses_routes

log = logging.getLogger("lockstep.gateway")


class BodyTooLarge(Exception):
    pass


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
