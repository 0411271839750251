"""A gateway that shuts down while requests wait to resume (issue 28) ends them at once
with their typed error, not after uvicorn's graceful wait with a cut connection: a real
uvicorn gateway, a fake rank 0 and a fake supervisor speaking the real signed protocol.
Rank 0's socket goes away mid-stream while the supervisor keeps vouching for it, so no
deployment can take the continuation and both requests wait; then the gateway stops."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until, sse_lines
from tests.support.fake_gateway import FakeGateway

ENDED_WITHIN_S = 2.0  # the graceful wait is 2 s here: ending inside it is the point


@pytest.fixture
def env(tmp_path):
    key = ensure_cluster_key(tmp_path / "home" / "keys" / "cluster.key")
    model = build_model(tmp_path / "models" / "tiny", preset="tiny")
    ids = load_tokenizer(model).encode("word " * 400)
    rank = FakeRank0(key, step_s=0.05, script=lambda g: list(ids)).start()
    sup = FakeSupervisor(key, rank, str(model)).start()
    settings = GatewaySettings(
        home=tmp_path / "home", port=free_port(), admin_token="t", admin_endpoint=sup.admin_endpoint,
        events_endpoint=sup.events_endpoint, keepalive_s=0.2, orphan_grace_s=0.5,
        request_read_timeout=60, refresh_s=0.5, resume_timeout=60)
    gw = GatewayThread(settings, key).start()
    poll_until(lambda: gw.gw.cluster.backends, 10, "the fake deployment to be picked up")
    yield FakeGateway(rank=rank, sup=sup, gw=gw, model=model, settings=settings, key=key,
                      home=tmp_path / "home", url=gw.url)
    if gw.thread.is_alive():
        gw.stop()
    sup.stop()
    rank.stop()


def _stream(url: str, body: dict, out: dict) -> None:
    out.update(chunks=0, keepalives=0, error=None, done=False)
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            for kind, data in sse_lines(r):
                if kind == "comment":
                    out["keepalives"] += 1
                elif data == "[DONE]":
                    out["done"] = True
                elif "error" in data:
                    out["error"] = data["error"]
                else:
                    out["chunks"] += 1
    except httpx.HTTPError as exc:  # a cut connection: what this test rules out
        out["cut"] = repr(exc)
    out["ended_at"] = time.monotonic()


def _plain(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        out["status"], out["json"] = r.status_code, r.json()
    except httpx.HTTPError as exc:
        out["cut"] = repr(exc)
    out["ended_at"] = time.monotonic()


@pytest.mark.timeout(60)
def test_shutdown_ends_requests_waiting_to_resume_at_once_with_their_error(env):
    url, rank, gw = env.url, env.rank, env.gw
    body = {"model": env.model_name, "prompt": "hi", "max_tokens": 400}
    s: dict = {}
    p: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, body, s), daemon=True),
               threading.Thread(target=_plain, args=(url, body, p), daemon=True)]
    for t in threads:
        t.start()
    poll_until(lambda: s.get("chunks", 0) >= 2 and len(rank.active_ids) == 2, 10,
               "both requests running on rank 0")
    rank.stop()  # the link closes: a resumable failure, and nowhere to resume
    poll_until(lambda: len(gw.gw.cluster.resuming) == 2, 10, "both requests waiting to resume")
    poll_until(lambda: s["keepalives"] >= 2, 10, "keep-alives while the stream waits")
    assert gw.gw.cluster.active == 2  # waiting still counts as active

    stop_at = time.monotonic()
    gw.stop()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert "cut" not in s and "cut" not in p, (s, p)
    assert s["done"] and "not resumed: the gateway is shutting down" in s["error"]["message"], s
    assert p["status"] == 502, p
    assert "not resumed: the gateway is shutting down" in p["json"]["error"]["message"], p
    for out in (s, p):
        assert out["ended_at"] - stop_at < ENDED_WITHIN_S, out["ended_at"] - stop_at
    assert not gw.gw.cluster.resuming
