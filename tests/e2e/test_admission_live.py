"""Admission control end to end: `lockstep up --tp 1` (real supervisor, reaper, gateway
and an MLX rank) with both bounds set from the environment, as an operator would:
LOCKSTEP_MAX_INFLIGHT reaches the gateway, LOCKSTEP_MAX_OPEN_REQUESTS the supervisor and
through it rank 0's spec. A second requester connected straight to rank 0 plays a second
gateway, so rank 0's bound is reached while this gateway's is not."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.bus import Channel, configure
from common.keys import load_cluster_key, requests_key_of
from common.messages import REQUESTS_OUT, Abort, ErrorCode, Generate, Sampling, Tokens, TokensBatch
from tests.gwutil import poll_until, sse_lines
from tests.support.requests import supervisor_record
from tests.support.up_cluster import UpCluster, UpOptions, up_fixture

GATEWAY_BOUND = 2
RANK_BOUND = 3
LONG = 400  # tokens; at 0.02 s a step ≥ 8 s: still running while the test acts
HELD = 3000  # the second gateway's streams: ≥ 60 s, aborted by the test (its gateway's
# first stream waits for that gateway's tokenizer, a few seconds on a loaded machine)

up = up_fixture(UpOptions(tp=1, ready="ready", env={
    "LOCKSTEP_MAX_INFLIGHT": str(GATEWAY_BOUND), "LOCKSTEP_MAX_OPEN_REQUESTS": str(RANK_BOUND),
    "LOCKSTEP_OVERLOAD_RETRY_AFTER_S": "3",
    "LOCKSTEP_RANK_TEST_SEAMS": "true", "LOCKSTEP_TEST_STEP_DELAY_S": "0.02"}))


@dataclass(frozen=True)
class Live:
    url: str
    home: Path
    dep: dict  # the one deployment, as the admin API showed it once ready
    model: str


@pytest.fixture(scope="module")
def live(up: UpCluster) -> Live:
    dep = next(d for d in up.deployments() if d["state"] == "serving")
    return Live(up.url, up.home, dep, dep["model"])


class SecondGateway:
    """A signed DEALER straight to rank 0's requests socket."""

    def __init__(self, live: Live) -> None:
        key = requests_key_of(supervisor_record(live.dep), load_cluster_key(live.home / "keys" / "cluster.key"))
        self.ch = Channel("test", "requests", sender="gateway-2", send_key=key, accept=REQUESTS_OUT)
        self.ctx = zmq.Context()
        self.sock = configure(self.ctx.socket(zmq.DEALER))
        self.sock.connect(live.dep["requests_endpoint"])
        self.got: dict[str, list[Tokens]] = {}

    def send(self, body) -> None:
        self.sock.send(self.ch.pack(body))

    def generate(self, max_tokens: int) -> str:
        rid = "g2-" + secrets.token_hex(6)
        self.send(Generate(rid, [1, 2, 3], max_tokens, Sampling(), [], "gateway-2"))
        return rid

    def pump_until(self, pred, timeout: float, what: str):
        def step():
            while self.sock.poll(0):  # what has arrived; poll_until paces the waiting
                msg = self.ch.unpack(self.sock.recv())
                body = None if msg is None else msg.body
                chunks = body.chunks if isinstance(body, TokensBatch) else \
                    [body] if isinstance(body, Tokens) else []
                for c in chunks:
                    if not c.waiting:  # rank 0's "still waiting" heartbeats aside
                        self.got.setdefault(c.request_id, []).append(c)
            return pred()
        return poll_until(step, timeout, what, interval=0.01)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class HeldStream(threading.Thread):
    def __init__(self, live: Live) -> None:
        super().__init__(daemon=True)
        self.live, self.tokens, self.status = live, 0, None
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": self.live.model, "prompt": "hello", "max_tokens": HELD,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", self.live.url + "/v1/completions", json=body,
                          timeout=60) as r:
            self.status = r.status_code
            for kind, d in sse_lines(r):
                if kind == "data" and d != "[DONE]" and d.get("choices"):
                    self.tokens += 1
                if self.stop.is_set():
                    return  # leaving the with-block closes the connection: an ABORT


def overloads(live: Live) -> dict[str, float]:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return {s.labels["bound"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "lockstep_gateway_overloaded" for s in fam.samples
            if s.name.endswith("_total")}


def post(live: Live, **kw) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", timeout=60,
                      json={"model": live.model, "prompt": "hi", "max_tokens": 4, **kw})


@pytest.mark.timeout(240)
def test_both_bounds_from_the_environment_end_to_end(live):
    g2 = SecondGateway(live)
    streams: list[HeldStream] = []
    try:
        # The second gateway fills rank 0 up to one below its bound ...
        t0 = time.monotonic()
        held = [g2.generate(HELD) for _ in range(RANK_BOUND - 1)]
        g2.pump_until(lambda: all(g2.got.get(r) for r in held), 30, "tokens of the held")
        # ... this gateway's first stream takes the last place ...
        streams.append(HeldStream(live))
        streams[0].start()
        poll_until(lambda: streams[0].tokens >= 2, 30, "the first stream's tokens")
        # ... so rank 0 refuses the next one (in-band, typed) and the gateway answers 429.
        r = post(live)
        assert r.status_code == 429, (r.text, {k: (sum(len(c.tokens) for c in v), v[-1].finish_reason, v[-1].error) for k, v in g2.got.items()}, time.monotonic() - t0)
        assert r.headers["retry-after"] == "3"
        assert (r.json()["error"]["code"], r.json()["error"]["data"]["bound"]) == ("overloaded", "rank")
        extra = g2.generate(4)
        g2.pump_until(lambda: g2.got.get(extra), 10, "rank 0's answer to one more")
        assert [(c.finish_reason, c.error_code) for c in g2.got[extra]] == [
            ("error", ErrorCode.OVERLOADED)]
        # The second gateway leaves; this one's own bound is reached first now.
        for rid in held:
            g2.send(Abort(rid, "client"))
        g2.pump_until(lambda: all(g2.got[r][-1].finish_reason for r in held), 30, "aborts")
        streams.append(HeldStream(live))
        streams[1].start()
        poll_until(lambda: streams[1].tokens >= 2, 30, "the second stream's tokens")
        r = post(live, stream=True)
        assert r.status_code == 429, (r.text, {k: (sum(len(c.tokens) for c in v), v[-1].finish_reason, v[-1].error) for k, v in g2.got.items()}, time.monotonic() - t0)
        assert (r.json()["error"]["data"], r.headers["retry-after"]) == (
            {"bound": "gateway", "limit": GATEWAY_BOUND}, "3")
        assert overloads(live) == {"gateway": 1.0, "rank": 1.0}
        # Room again once the streams end.
        for s in streams:
            s.stop.set()
        for s in streams:
            s.join(30)
            assert not s.is_alive() and s.status == 200
        ok = poll_until(lambda: (x := post(live)).status_code == 200 and x, 30, "a 200 again")
        assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        for s in streams:
            s.stop.set()
        g2.close()
