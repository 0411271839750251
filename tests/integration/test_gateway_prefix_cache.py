"""The prefix cache as the gateway's clients see it, over real sockets (a real uvicorn
server, a scripted rank 0 and supervisor, tests/fakes/gateway_fakes.py):
`usage.prompt_tokens_details.cached_tokens` (OpenAI's shape) in chat and completion
bodies and in the include_usage chunk, the gateway's hit / miss / cached-token counters
and each rank's cache figures in /metrics, and the admin API's cache-clear."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from common.messages import AdminCode, AdminReply, CacheStats
from tests.gwutil import sse_lines
from tests.support.fake_gateway import FakeGateway, fake_gateway

TOKEN = "admin-secret-token"
HDR = {"authorization": f"Bearer {TOKEN}"}
CACHED = 5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    stats = CacheStats(entries=3, tokens=120, bytes=4096, stored=7, evicted=4, hits=2, misses=5,
                       hit_tokens=10)
    with fake_gateway(tmp_path_factory, supervisor={"rank_cache": stats}, admin_token=TOKEN,
                      refresh_s=0.2) as g:
        yield g


@pytest.fixture(autouse=True)
def reset(env):
    env.rank.cached = None
    env.sup.replies.clear()
    yield


def _chat(env: FakeGateway, **kw) -> dict:
    return {"model": env.model_name, "messages": [{"role": "user", "content": "hello again"}],
            "max_tokens": 4, "temperature": 0, **kw}


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{{{labels}[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.timeout(60)
def test_cached_tokens_in_openai_usage_bodies_and_the_usage_chunk(env):
    env.rank.cached = lambda g: min(CACHED, len(g.prompt) - 1)
    c = openai.OpenAI(base_url=env.url + "/v1", api_key="none", max_retries=0, timeout=20)
    r = c.chat.completions.create(**_chat(env))
    assert r.usage.prompt_tokens_details.cached_tokens == CACHED  # the client's own parser
    assert r.usage.prompt_tokens > CACHED

    body = httpx.post(env.url + "/v1/completions", timeout=20, json={
        "model": env.model_name, "prompt": "one two three four five six seven", "max_tokens": 3,
        "temperature": 0}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}

    with httpx.stream("POST", env.url + "/v1/chat/completions", timeout=20,
                      json=_chat(env, stream=True, stream_options={"include_usage": True})) as s:
        chunks = [v for k, v in sse_lines(s) if k == "data" and v != "[DONE]"]
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    assert len(usage) == 1 and usage[0]["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert chunks[-1]["choices"] == []  # the usage chunk, last

    env.rank.cached = None  # a miss: OpenAI still says 0, it does not drop the field
    r = c.chat.completions.create(**_chat(env))
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.timeout(60)
def test_metrics_count_hits_misses_cached_tokens_and_each_ranks_cache(env):
    url, model = env.url, env.model_name
    before = httpx.get(url + "/metrics", timeout=10).text
    env.rank.cached = lambda g: CACHED
    httpx.post(url + "/v1/chat/completions", json=_chat(env), timeout=20).raise_for_status()
    env.rank.cached = None
    for _ in range(2):
        httpx.post(url + "/v1/chat/completions", json=_chat(env), timeout=20).raise_for_status()
    text = httpx.get(url + "/metrics", timeout=10).text
    lab = f'model="{model}"'
    for name, delta in (("lockstep_gateway_prefix_cache_hits_total", 1),
                        ("lockstep_gateway_prefix_cache_misses_total", 2),
                        ("lockstep_gateway_prefix_cache_cached_tokens_total", CACHED)):
        assert _metric(text, name, lab) - _metric(before, name, lab) == delta, name
    rank0 = 'deployment="dep-fake",rank="0"'
    assert _metric(text, "lockstep_rank_prefix_cache_entries", rank0) == 3
    assert _metric(text, "lockstep_rank_prefix_cache_tokens", rank0) == 120
    assert _metric(text, "lockstep_rank_prefix_cache_bytes", rank0) == 4096
    assert _metric(text, "lockstep_rank_prefix_cache_stored_total", rank0) == 7
    assert _metric(text, "lockstep_rank_prefix_cache_evicted_total", rank0) == 4


@pytest.mark.timeout(60)
def test_admin_api_cache_clear(env):
    base = env.url + "/admin/api/cluster/deployments"
    assert httpx.post(base + "/dep-fake/cache-clear", timeout=10).status_code == 401
    r = httpx.post(base + "/dep-fake/cache-clear", headers=HDR, json={"timeout_s": 3}, timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["deployment_id"] == "dep-fake" and r.json()["enabled"] is True
    cmd = next(c for c in reversed(env.sup.commands) if c.command == "cache_clear")
    assert cmd.args == {"deployment_id": "dep-fake", "timeout_s": 3}
    r = httpx.post(base + "/nope/cache-clear", headers=HDR, timeout=20)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    bad = httpx.post(base + "/dep-fake/cache-clear", headers=HDR, json={"timeout_s": 0}, timeout=20)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout_s"
    env.sup.replies["cache_clear"] = AdminReply("x", False, AdminCode.TIMEOUT,
                                                   "rank 0 did not confirm", {"clear_id": 2})
    r = httpx.post(base + "/dep-fake/cache-clear", headers=HDR, timeout=20)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert r.json()["error"]["data"] == {"clear_id": 2}
    status = httpx.get(env.url + "/admin/api/cluster/status", headers=HDR, timeout=20).json()
    assert status["deployments"][0]["ranks"][0]["cache"]["entries"] == 3
