"""Admission control through the real gateway (uvicorn, signed ZeroMQ) in front of a fake
rank 0 that can hold requests open: a bound of N requests in flight per deployment, an
immediate 429 with `retry-after` beyond it, counted in /metrics; rank 0's own bound
(error_code overloaded, in-band) turned into the same 429."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import ConfigError
from services.gateway.core import settings as gw_settings
from tests.gwutil import poll_until, sse_lines
from tests.support.fake_gateway import FakeGateway, fake_gateway

BOUND = 4
EXTRA = 3
RETRY_AFTER = 2
HOLD_S = 600.0  # the fake's delay before a first token: "held" until release_held()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with fake_gateway(tmp_path_factory, keepalive_s=0.2, orphan_grace_s=0.5, refresh_s=0.5,
                      max_inflight=BOUND, overload_retry_after_s=RETRY_AFTER) as g:
        yield g


@pytest.fixture(autouse=True)
def reset(env):
    r = env.rank
    r.prefill_s, r.max_open = 0.0, 0
    yield
    r.release_held()
    poll_until(lambda: env.gw.gw.cluster.active == 0, 10, "gateway active count back to 0")


def overloads(env: FakeGateway) -> dict[str, float]:
    text = httpx.get(env.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "lockstep_gateway_overloaded":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["bound"]] = s.value
    return out


def gauge(env: FakeGateway, name: str) -> float:
    text = httpx.get(env.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("deployment") == "dep-fake":
                return s.value
    raise AssertionError(f"{name} not in /metrics")


class Client(threading.Thread):
    """One streaming chat request; records the status, when headers came, the body."""

    def __init__(self, env: FakeGateway, i: int) -> None:
        super().__init__(daemon=True, name=f"client-{i}")
        self.url = env.url + "/v1/chat/completions"
        self.body = {"model": env.model_name, "stream": True, "max_tokens": 5,
                     "messages": [{"role": "user", "content": f"hello {i}"}]}
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.error: dict | None = None
        self.text = ""
        self.finish: str | None = None
        self.answered_at: float | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30) as r:
                self.status, self.headers = r.status_code, r.headers
                self.answered_at = time.monotonic()
                if r.status_code != 200:
                    r.read()
                    self.error = r.json()["error"]
                    return
                for kind, d in sse_lines(r):
                    if kind != "data" or d == "[DONE]":
                        continue
                    ch = d["choices"][0] if d.get("choices") else {}
                    self.text += (ch.get("delta") or {}).get("content") or ""
                    self.finish = ch.get("finish_reason") or self.finish
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


@pytest.mark.timeout(90)
def test_bound_plus_k_streams_k_get_429_at_once_the_rest_complete(env):
    env.rank.prefill_s = HOLD_S
    before = overloads(env).get("gateway", 0.0)
    sent_before = len(env.rank.generates)
    assert gauge(env, "lockstep_gateway_inflight_limit") == BOUND
    clients = [Client(env, i) for i in range(BOUND + EXTRA)]
    t0 = time.monotonic()
    for c in clients:
        c.start()
    # Every client has its answer (headers) while the admitted ones are still held.
    poll_until(lambda: all(c.status is not None or c.failure for c in clients), 20,
               "every client's status")
    assert [c.failure for c in clients] == [None] * len(clients)
    refused = [c for c in clients if c.status == 429]
    admitted = [c for c in clients if c.status == 200]
    assert (len(refused), len(admitted)) == (EXTRA, BOUND)
    for c in refused:
        assert c.answered_at - t0 < 15  # not after a read timeout: at once
        assert c.headers["retry-after"] == str(RETRY_AFTER)
        assert c.headers["x-lockstep-deployment"] == "dep-fake"
        assert c.error["type"] == "rate_limit_error" and c.error["code"] == "overloaded"
        assert c.error["data"] == {"bound": "gateway", "limit": BOUND}
    assert env.gw.gw.cluster.active == BOUND
    assert gauge(env, "lockstep_gateway_active_requests") == BOUND
    # Only the admitted reached rank 0.
    poll_until(lambda: len(env.rank.generates) - sent_before == BOUND, 10,
               "the admitted requests at rank 0")
    assert overloads(env)["gateway"] - before == EXTRA
    # Still full: a non-streaming request is refused the same way (the OpenAI client
    # sees a RateLimitError carrying retry-after).
    oc = openai.OpenAI(base_url=env.url + "/v1", api_key="none", max_retries=0, timeout=20)
    with pytest.raises(openai.RateLimitError) as ei:
        oc.completions.create(model=env.model_name, prompt="x", max_tokens=3)
    assert ei.value.response.headers["retry-after"] == str(RETRY_AFTER)
    assert overloads(env)["gateway"] - before == EXTRA + 1
    # Released, the admitted ones complete normally.
    env.rank.release_held()
    for c in admitted:
        c.join(30)
        assert not c.is_alive() and c.failure is None
        assert c.finish in ("stop", "length") and c.text
    poll_until(lambda: env.gw.gw.cluster.active == 0, 10, "every stream released")
    # Room again: new requests are admitted, and nothing more is counted.
    env.rank.prefill_s = 0.0
    again = [Client(env, 100 + i) for i in range(BOUND)]
    for c in again:
        c.start()
    for c in again:
        c.join(30)
        assert (c.status, c.failure) == (200, None) and c.finish in ("stop", "length")
    assert overloads(env)["gateway"] - before == EXTRA + 1


@pytest.mark.timeout(60)
def test_rank0_refusal_is_a_429_too(env):
    """Rank 0's bound (below the gateway's here, as with several gateways): its in-band
    refusal (error_code overloaded) becomes a 429 with retry-after, counted as bound=rank."""
    rank = env.rank
    rank.prefill_s, rank.max_open = HOLD_S, 2
    before = overloads(env).get("rank", 0.0)
    held = [Client(env, i) for i in range(2)]
    for c in held:
        c.start()
    poll_until(lambda: len(rank.active_ids) == 2, 10, "two requests held on rank 0")
    r = httpx.post(env.url + "/v1/completions", timeout=20,
                   json={"model": env.model_name, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == str(RETRY_AFTER)
    assert r.headers["x-lockstep-request-id"].startswith("cmpl-")
    err = r.json()["error"]
    assert (err["type"], err["code"], err["data"]["bound"]) == ("rate_limit_error",
                                                               "overloaded", "rank")
    # A stream's headers are already sent when rank 0 answers: it ends with the same
    # error as an SSE event.
    with httpx.stream("POST", env.url + "/v1/completions", timeout=20,
                      json={"model": env.model_name, "prompt": "x", "stream": True}) as s:
        events = [d for k, d in sse_lines(s) if k == "data"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "overloaded"
    assert overloads(env)["rank"] - before == 2
    rank.release_held()
    for c in held:
        c.join(30)
        assert (c.status, c.failure) == (200, None) and c.finish in ("stop", "length")


def test_the_bound_is_a_setting_with_a_derived_default():
    assert gw_settings.load({}, env={}).inflight_limit == 4 * 16  # 4 x the rank's max_batch
    assert gw_settings.load({}, env={"LOCKSTEP_MAX_INFLIGHT": "7"}).inflight_limit == 7
    assert gw_settings.load({}, env={"LOCKSTEP_OVERLOAD_RETRY_AFTER_S": "5"}).overload_retry_after_s == 5
    with pytest.raises(ConfigError):
        gw_settings.load({}, env={"LOCKSTEP_MAX_INFLIGHT": "-1"})
