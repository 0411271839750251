"""What a deployment's request channel (request_channel.py) answers instead of a
stream: `Overloaded`, a 429 with `retry-after` when a bound on requests in flight is
reached (the gateway's `max_inflight`, or rank 0's `max_open_requests`, refused in-band);
`Unavailable`, a 503 `model_not_ready` when rank 0 cannot take the request now."""

from __future__ import annotations

import enum
from typing import Protocol

from services.gateway.core.errors import ApiError

UNAVAILABLE_RETRY_S = 5  # retry-after of a 503 from here (app.pick says the same)
SEND_TIMEOUT_S = 5.0  # for rank 0 to take a GENERATE


class Bound(str, enum.Enum):
    """Which bound refused: in the 429's data and the overloaded metric's label."""

    GATEWAY = "gateway"  # the gateway's max_inflight for the deployment
    RANK = "rank"  # rank 0's max_open_requests, refused in-band

    def __str__(self) -> str:
        return self.value


class Backend(Protocol):
    """What a refusal names of the deployment channel that refused (request_channel.py's
    Backend is one): declared here, so this module needs nothing above it."""

    deployment_id: str
    model: str
    max_inflight: int
    retry_after_s: int


class Overloaded(ApiError):
    """A deployment's bound on requests in flight is reached: 429, retry later."""

    def __init__(self, backend: Backend, bound: Bound, in_flight: int | None,
                 held: int = 0) -> None:
        ahead = (f" and {held} resumed requests of its model wait for room: they go first"
                 if held else "")
        who = (f"deployment {backend.deployment_id} has {in_flight} requests in flight "
               f"(its bound, max_inflight){ahead}" if bound is Bound.GATEWAY
               else f"rank 0 of deployment {backend.deployment_id} is at its bound on open "
               "requests (max_open_requests)")
        retry = backend.retry_after_s
        data: dict = {"bound": bound.value}
        if bound is Bound.GATEWAY:
            data["limit"] = backend.max_inflight
        super().__init__(429, f"overloaded: {who}; retry after {retry} s", code="overloaded",
                         headers={"retry-after": str(retry),
                                  "x-lockstep-deployment": backend.deployment_id}, data=data)


class Cancelled(Exception):
    """A continuation not sent: its stream was cancelled (client gone, abort, abort-all)
    before it could move. Never undone by a resume (docs/gateway.md "who may end or
    resume a stream")."""


class Unavailable(ApiError):
    """Rank 0 cannot take the request now (its link was lost, the deployment is gone,
    or it does not take the GENERATE within SEND_TIMEOUT_S): 503 `model_not_ready` with
    `retry-after`, as routing answers once it knows (app.pick) — a request routed just
    before the loss and sent just after it gets the same answer."""

    def __init__(self, backend: Backend, why: str) -> None:
        super().__init__(503, f"model {backend.model!r} is not serving: deployment "
                         f"{backend.deployment_id}: {why}", code="model_not_ready",
                         headers={"retry-after": str(UNAVAILABLE_RETRY_S),
                                  "x-lockstep-deployment": backend.deployment_id})
