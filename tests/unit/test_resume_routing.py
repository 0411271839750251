"""Where a continuation goes and what it weighs (services/gateway/core/resume.py, router.py,
app.Gateway.pick), on stand-in backends with the real bound check, stream and router:

- a continuation is routed by the same cache-aware rule as a new request, on prompt +
  produced tokens, among deployments with room first;
- until its first token there it weighs as a prefill of what is not cached (router.load),
  not as a decoding request;
- new requests leave room for continuations still waiting for a deployment: they were
  admitted once, and go first.
"""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

from common.messages import ErrorCode, Generate
from services.gateway.core.errors import ApiError
from services.gateway.core.gateway_core import Gateway
from services.gateway.core.request_channel import Backend
from services.gateway.core.request_stream import RequestStream
from services.gateway.core.resume import Outcome, Resumer
from services.gateway.core.router import DECODE_COST, Router, load


class Replica:
    """A serving deployment as routing sees it; the bound is Backend's own code."""

    full = Backend.full
    check_room = Backend.check_room

    def __init__(self, dep_id: str, max_inflight: int = 0) -> None:
        self.deployment_id, self.max_inflight = dep_id, max_inflight
        self.model, self.model_path = "tiny", "/m"
        self.lost = self.closed = self.draining = False
        self.streams: dict[str, object] = {}
        self.overloads: collections.Counter = collections.Counter()
        self.retry_after_s = 1
        self.adopted: list[tuple[str, int]] = []

    @property
    def active(self) -> int:
        return len(self.streams)

    def run(self, n: int) -> None:
        for i in range(n):
            self.streams[f"{self.deployment_id}-{i}"] = SimpleNamespace(
                route_len=10, route_cached=0, first_token_at=1.0)  # decoding

    async def adopt(self, s: RequestStream, gen: Generate, cached: int = 0) -> None:
        s.rebind(self, gen.request_id, len(gen.prompt), cached)
        self.streams[gen.request_id] = s
        self.adopted.append((gen.request_id, cached))

    def forget(self, s) -> None:
        pass


PROMPT = list(range(100, 400))  # 300 tokens
PRODUCED = list(range(500, 540))


def resumer(cluster, router) -> Resumer:
    msg = Generate(request_id="r", prompt=PROMPT, max_tokens=200, client="t")
    return Resumer(cluster, msg, "tiny", "/m", timeout=5.0, max_resumes=2, router=router)


def cluster_of(*backends) -> SimpleNamespace:
    return SimpleNamespace(backends={b.deployment_id: b for b in backends}, resuming=set(),
                           shutting_down=False, resumed_from=collections.Counter(),
                           resume_log=[])


def test_a_continuation_goes_where_its_tokens_are_cached_and_weighs_as_a_prefill():
    failed, a, b = Replica("d-1"), Replica("d-a"), Replica("d-b")
    router = Router(imbalance=4096)
    router.approx["d-b"] = router.index_of(b)
    router.index_of(b).add([*PROMPT, *PRODUCED[:20]])  # b served this conversation before
    c = cluster_of(a, b)
    s = RequestStream(failed, "r", len(PROMPT))
    s.first_token_at = 1.0  # it was decoding on d-1
    got = asyncio.run(resumer(c, router).resume(s, PRODUCED, ErrorCode.RANK_LOST))
    assert got.outcome is Outcome.RESUMED and s.backend is b and not a.adopted
    cached = b.adopted[0][1]
    assert cached >= len(PROMPT)  # the router's expectation, passed on
    # until its first token there, its load is the uncached rest of prompt + output
    assert s.first_token_at is None and s.prompt_len == len(PROMPT)
    assert load(b) == len(PROMPT) + len(PRODUCED) - cached < DECODE_COST
    assert router.routed["d-b"] == 1


def test_a_continuation_prefers_a_deployment_with_room_over_the_cache():
    failed, full, roomy = Replica("d-1"), Replica("d-a", max_inflight=1), Replica("d-b")
    full.run(1)
    router = Router(imbalance=4096)
    router.index_of(full).add([*PROMPT, *PRODUCED])
    s = RequestStream(failed, "r", len(PROMPT))
    got = asyncio.run(resumer(cluster_of(full, roomy), router).resume(
        s, PRODUCED, ErrorCode.RANK_LOST))
    assert got.outcome is Outcome.RESUMED and s.backend is roomy


def test_new_requests_leave_room_for_continuations_waiting_for_a_deployment():
    b = Replica("d-a", max_inflight=3)
    b.run(1)
    cluster = SimpleNamespace(backends={"d-a": b}, resuming=set())
    gw = SimpleNamespace(cluster=cluster)
    assert Gateway.pick(gw, "tiny") == [b]  # room: 2 of 3
    waiting = [RequestStream(Replica("d-1"), f"w{i}", 5) for i in range(2)]
    cluster.resuming.update(waiting)  # two continuations of tiny wait for a deployment
    with pytest.raises(ApiError) as e:
        Gateway.pick(gw, "tiny")
    assert e.value.status == 429 and "2 resumed requests" in e.value.message
    other = RequestStream(Replica("d-1"), "w-other", 5)
    other.backend.model = "other"
    cluster.resuming = {waiting[0], other}  # one placed; another model's does not count
    assert Gateway.pick(gw, "tiny") == [b]
