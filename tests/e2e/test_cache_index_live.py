"""Rank 0's cache index events on real ranks (the shared live cluster's TP=2 tiny
deployment, tests/support/live_cluster.py): after every turn of a chat through the
gateway, the gateway Backend's precise index (admin status `routing.<dep>.cache_index`)
equals rank 0's own record of its prefix cache (`rank-0.cache.jsonl`, which rank 1's
equals) entry for entry, with no sequence gap; and a second connection (a Backend in
this process, as a second gateway would hold it) measures how soon after a request's
final chunk the event storing its KV arrives: printed, not asserted (times are for the
bench)."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
import zmq.asyncio

from common.deployment_info import read_deployment_info
from common.home import Paths
from common.keys import load_cluster_key, requests_key_of
from common.messages import Generate
from services.gateway.core.request_channel import Backend
from services.rank.prefix_store import cache_index_path, read_cache_index
from tests.gwutil import poll_until
from tests.support import live_cluster as lc
from tests.support.requests import supervisor_record

pytestmark = pytest.mark.timeout(240)
SETTLE_S = 15.0  # for a turn's entry to reach both the record and the gateway


def record(c, dep: dict, rank: int = 0) -> list[list[int]]:
    """rank `rank`'s cache index after its last plan that changed it: [[id, n], ...]."""
    recs = read_cache_index(cache_index_path(Paths(c.home), dep["deployment_id"], rank))
    return sorted(recs[-1]["entries"]) if recs else []


def gateway_index(c, dep: dict) -> dict:
    st = httpx.get(c.url + "/admin/api/cluster/status", headers=c.hdr, timeout=10).json()
    return st["gateway"]["routing"][dep["deployment_id"]]["cache_index"]


def chat(c, messages: list[dict]) -> dict:
    r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
        "model": lc.TP_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_gateway_index_equals_rank_0s_record_after_every_chat_turn(live_cluster):
    c = live_cluster
    dep = c.deps[lc.TP_MODEL]
    messages = [{"role": "system", "content": "You index caches. " * 12},
                {"role": "user", "content": "Turn one: name a colour and a city."}]
    for turn in range(4):
        body = chat(c, messages)
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if turn:  # the previous turn's prompt and reply, stored and found
            assert cached > 0, body["usage"]
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Turn {turn + 2}: and another one?"}]

        def equal():
            want, got = record(c, dep), gateway_index(c, dep)
            return got if got["synced"] and got["entries"] == want and want else None

        got = poll_until(equal, SETTLE_S, f"turn {turn + 1}: the gateway's index = rank 0's record")
        assert got["gaps"] == 0 and got["applied"] > 0, got
        assert record(c, dep, 1) == record(c, dep, 0)  # TP=2: rank 1 holds the same
    metrics = httpx.get(c.url + "/metrics", timeout=10).text
    assert f'lockstep_gateway_cache_index_gaps_total{{deployment="{dep["deployment_id"]}"}} 0.0' \
        in metrics

    delays = asyncio.run(_delays(c, dep))
    print(f"\nfinal chunk -> cache event at a gateway connection, ms: "
          f"{[round(d * 1000, 2) for d in delays]} (median {statistics.median(delays) * 1000:.2f})")


async def _delays(c, dep: dict) -> list[float]:
    """A 4-turn conversation in token ids on a Backend of this process: for each turn, the
    time from its final chunk to the event storing its KV, both read on that Backend;
    its index equals rank 0's record at the end."""
    info = read_deployment_info(supervisor_record(dep))
    ctx = zmq.asyncio.Context()
    b = Backend(ctx, info, key=requests_key_of(info, load_cluster_key(c.home / "keys" / "cluster.key")))
    out = []
    try:
        idx = b.cache_index
        await _until(lambda: idx.synced, 10, "the snapshot")
        prompt = [5 + (i * 7919) % 900 for i in range(200)]
        for turn in range(4):
            rid = f"cache-ev-{time.time_ns()}-{turn}"
            s = await b.generate(Generate(request_id=rid, prompt=prompt, max_tokens=8))
            toks: list[int] = []
            while not s.finished:
                chunk = await s.next(30)
                assert chunk is not None, "no chunk within 30 s"
                toks += chunk.tokens
            final_at = s.queue.final_at
            s.release()
            assert s.finish_reason in ("stop", "length")
            await _until(lambda rid=rid: rid in idx.stored_at, SETTLE_S, f"turn {turn + 1}'s cache event")
            out.append(idx.stored_at[rid] - final_at)
            prompt = prompt + toks + [5 + (turn * 31 + i) % 900 for i in range(20)]
        await _until(lambda: [[k, n] for k, n in sorted(idx.view().items())] == record(c, dep),
                     SETTLE_S, "this connection's index = rank 0's record")
        assert idx.gaps == 0
    finally:
        b.close()
        ctx.destroy(linger=0)
    return out


async def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.002)
