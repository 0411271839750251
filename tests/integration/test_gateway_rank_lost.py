"""The gateway's own monitor of rank 0 over real sockets (a real uvicorn gateway, a fake
rank 0 and a fake supervisor speaking the real signed protocol): rank 0's socket goes
away while the supervisor keeps saying "serving" (it has not noticed): the streams in
flight end at once with the typed error, new requests get 503 and /ready is 503; when
rank 0 answers again on its endpoint and the supervisor still vouches for the job, the
deployment is served again."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from common.envelope import Key
from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until, sse_lines
from tests.support.fake_gateway import FakeGateway

FAIL_WITHIN_S = 2.0


@pytest.fixture
def env(tmp_path):
    key: Key = ensure_cluster_key(tmp_path / "home" / "keys" / "cluster.key")
    model = build_model(tmp_path / "models" / "tiny", preset="tiny")
    rank = FakeRank0(key, step_s=0.05).start()
    sup = FakeSupervisor(key, rank, str(model)).start()
    settings = GatewaySettings(
        home=tmp_path / "home", port=free_port(), admin_token="t", admin_endpoint=sup.admin_endpoint,
        events_endpoint=sup.events_endpoint, keepalive_s=0.2, orphan_grace_s=0.5,
        request_read_timeout=60, refresh_s=0.5, resume_timeout=0)  # the fail path: no resume
    gw = GatewayThread(settings, key).start()
    poll_until(lambda: gw.gw.cluster.backends, 10, "the fake deployment to be picked up")
    ids = load_tokenizer(model).encode("word " * 400)
    rank.script = lambda g: list(ids)
    yield FakeGateway(rank=rank, sup=sup, gw=gw, model=model, settings=settings, key=key,
                      home=tmp_path / "home", url=gw.url)
    serving = sup.rank  # the rank 0 the supervisor vouches for last: `rank` or its successor
    gw.stop()
    sup.stop()
    serving.stop()


def _stream(url: str, body: dict, out: dict) -> None:
    out["chunks"], out["error"], out["done"] = 0, None, False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for kind, data in sse_lines(r):
            if kind != "data":
                continue
            if data == "[DONE]":
                out["done"] = True
                break
            if "error" in data:
                out["error"] = data["error"]
            else:
                out["chunks"] += 1
    out["ended_at"] = time.monotonic()


def _plain(url: str, body: dict, out: dict) -> None:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    out["status"], out["json"], out["ended_at"] = r.status_code, r.json(), time.monotonic()


@pytest.mark.timeout(60)
def test_rank0_gone_fails_its_streams_at_once_and_is_not_routed_to_until_back(env):
    url, rank = env.url, env.rank
    body = {"model": env.model_name, "prompt": "hi", "max_tokens": 400}
    s: dict = {}
    p: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, body, s), daemon=True),
               threading.Thread(target=_plain, args=(url, body, p), daemon=True)]
    for t in threads:
        t.start()
    poll_until(lambda: s.get("chunks", 0) >= 2 and len(rank.active_ids) == 2, 10,
               "both requests running on rank 0")

    rank.stop()  # its socket closes; the supervisor still reports the deployment serving
    gone_at = time.monotonic()
    for t in threads:
        t.join(FAIL_WITHIN_S + 5)
    assert "ended_at" in s and "ended_at" in p, (s, p)
    assert s["done"] and s["error"]["code"] == "backend_error", s
    assert "connection to rank 0" in s["error"]["message"], s
    assert p["status"] == 502 and p["json"]["error"]["code"] == "backend_error", p
    for out in (s, p):
        assert out["ended_at"] - gone_at < FAIL_WITHIN_S, out["ended_at"] - gone_at
    assert env.gw.gw.cluster.active == 0

    # Refused at once, and across refreshes in which the supervisor still says serving.
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready", r.text
        assert httpx.get(url + "/ready", timeout=10).status_code == 503
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"] == []
    lost = httpx.get(url + "/admin/api/cluster/status", headers={"authorization": "Bearer t"},
                     timeout=10).json()["gateway"]["rank0_lost"]
    assert "connection to rank 0" in lost["dep-fake"], lost
    refreshes = len(env.sup.commands)
    poll_until(lambda: len(env.sup.commands) >= refreshes + 2, 10, "two more refreshes")
    r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
    assert r.status_code == 503, r.text  # the supervisor saying "serving" is not enough

    back = FakeRank0(env.key, step_s=0.01, script=rank.script).start(rank.endpoint)
    env.sup.rank = back  # same endpoint, same job: a link blip
    poll_until(lambda: httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3},
                                  timeout=10).status_code == 200, 10, "served again")
