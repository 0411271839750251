"""The operator console (DESIGN.md section 8): the static page at `/admin/` and the admin
routes it needs beyond /admin/api/cluster.

The page (services/gateway/admin/console/: one HTML, one JS, one CSS; no build step) holds
nothing secret and runs no inline script; every response under /admin/ carries a strict
Content-Security-Policy. The token never reaches the server in a URL: the page reads it
from the fragment (`#token=`) or a form, keeps it in sessionStorage and sends it as
`Authorization: Bearer` to the admin API, polled once a second.

    GET  /admin/api/requests                the gateway's requests in flight, per deployment
    POST /admin/api/requests/{id}/abort     ABORT through rank 0, which takes it out of the
                                            batch on every rank (finish_reason "abort")
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from services.gateway.admin.api import require_admin
from services.gateway.core.errors import ApiError
from services.gateway.core.request_channel import Backend, RequestStream
from services.gateway.core.router import load as route_load

STATIC = Path(__file__).with_name("console")
FILES = {"console.js": "text/javascript", "console.css": "text/css"}
HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
ABORT_REASON = "admin"

router = APIRouter()


@router.get("/admin")
async def admin_redirect() -> Response:
    return RedirectResponse("/admin/", status_code=308)


@router.get("/admin/")
async def page() -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/admin/{name}")
async def static_file(name: str) -> Response:
    if name not in FILES:  # a closed set: nothing else under console/ is served
        raise ApiError(404, f"no such file: /admin/{name}", code="not_found")
    return FileResponse(STATIC / name, media_type=FILES[name], headers=HEADERS)


def stream_row(b: Backend, s: RequestStream, now: float) -> dict:
    ttft = None if s.first_token_at is None else (s.first_token_at - s.submitted_at) * 1000
    return {"request_id": s.request_id, "deployment_id": b.deployment_id, "model": b.model,
            "age_s": round(now - s.submitted_at, 3), "prompt_tokens": s.prompt_len,
            "cached_tokens": s.cached_tokens, "generated_tokens": s.generated,
            "model_ttft_ms": s.model_ttft_ms,
            "visible_ttft_ms": None if ttft is None else round(ttft, 1),
            "finished": s.finished or s.queue.final_at is not None,
            "aborting": s.abort_reason is not None, "abort_reason": s.abort_reason}


@router.get("/admin/api/requests")
async def requests(request: Request) -> dict:
    require_admin(request)
    gw = request.app.state.gw
    now = time.monotonic()
    rows = [stream_row(b, s, now) for b in gw.cluster.backends.values()
            for s in list(b.streams.values())]
    rows.sort(key=lambda r: -r["age_s"])  # oldest first: the ones an operator looks for
    return {"at": time.time(), "requests": rows,
            "deployments": {k: {"active": b.active, "tokens_out": b.tokens_out,
                                "lost": b.lost, "overloads": dict(b.overloads),
                                # replicas: the router's load (prefill-token equivalents)
                                "load": route_load(b), "draining": b.draining}
                            for k, b in gw.cluster.backends.items()}}


@router.post("/admin/api/requests/{request_id}/abort")
async def abort(request_id: str, request: Request) -> dict:
    require_admin(request)
    gw = request.app.state.gw
    for b in gw.cluster.backends.values():
        s = b.streams.get(request_id)
        if s is None:
            continue
        done = s.finished or s.queue.final_at is not None
        if not done:
            b.abort(s, ABORT_REASON)  # rank 0 removes it in a plan step: every rank drops it
        return {"request_id": request_id, "deployment_id": b.deployment_id,
                "aborted": not done, "finished": done}
    raise ApiError(404, f"no request {request_id!r} in flight at this gateway", code="not_found")
