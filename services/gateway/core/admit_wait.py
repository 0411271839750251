"""Admission through a redeploy (docs/gateway.md "Admission through a redeploy"): a
request for a model with no serving deployment waits for one while `lockstep up` has
recorded that it is redeploying that model (runtime/redeploy.json,
services/up/redeploy_notice.py), instead of a 503.

    pick → a serving deployment with room            → admitted (as always)
         → 503 (not serving) and a redeploy recorded  → wait, re-pick every POLL_S, until
             served; or `admit_wait` passed          → 503 naming the wait and why
             or abort-all, client gone, gateway stop → 503 / 499, nothing sent to a rank
             or `admit_queue` already waiting        → 429 with retry-after, at once
         → 503 and nothing coming back (no record, the redeploy rate spent, unloaded)
                                                      → 503 at once, as before

Waiting requests hold no rank resources; they count in the gateway's `admit_waiting`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services.gateway.core.errors import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request

    from services.gateway.core.gateway_core import Gateway
    from services.gateway.core.request_channel import Backend

POLL_S = 0.1
RECORD_POLL_S = 0.5  # the redeploy record is re-read at most this often per request


async def pick_or_wait(gw: Gateway, request: Request, model: str, n: int) -> list[Backend]:
    """The serving deployments of `model` with room for `n`, waiting through a recorded
    redeploy (see the module's docstring)."""
    s = gw.settings
    try:
        return gw.pick(model, n)
    except ApiError as exc:
        # 503: known, not serving; 404: its failed deployment already forgotten while
        # another model serves — either way, waited for only if `up` promised it back
        if exc.status not in (503, 404) or s.admit_wait <= 0:
            raise
        why = gw.cluster.coming_back(model)
        if why is None:
            raise
    c = gw.cluster
    if c.admit_waiting >= (s.admit_queue or s.inflight_limit):
        raise ApiError(429, f"model {model!r} is being redeployed ({why}) and "
                       f"{c.admit_waiting} requests already wait for it; retry later",
                       code="overloaded", headers={"retry-after": str(s.overload_retry_after_s)})
    t0 = time.monotonic()
    aborts = c.admit_aborts
    checked = t0
    c.admit_waiting += 1
    try:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                return gw.pick(model, n)
            except ApiError as exc:
                if exc.status not in (503, 404):
                    raise
            now = time.monotonic()
            if c.admit_aborts != aborts or c.shutting_down:
                end = ("ended: the gateway is shutting down" if c.shutting_down
                       else "aborted (abort-all)")
                raise ApiError(503, f"model {model!r}: the wait for its redeploy was {end}",
                               code="model_not_ready", headers={"retry-after": "5"})
            if await request.is_disconnected():  # nobody reads the answer: 499, logged
                raise ApiError(499, "the client closed the request while it waited for "
                               "the redeploy", code="client_closed")
            if now - checked >= RECORD_POLL_S:
                checked = now
                still = c.coming_back(model)
                if still is None:  # nothing is coming back any more (rate spent, stopped)
                    return gw.pick(model, n)  # serving now, or its own 503
                why = still
            if now - t0 >= s.admit_wait:
                raise ApiError(503, f"model {model!r} is not serving: waited {s.admit_wait:g}s "
                               f"(admit_wait) for its redeploy ({why})",
                               code="model_not_ready", headers={"retry-after": "5"})
    finally:
        c.admit_waiting -= 1
