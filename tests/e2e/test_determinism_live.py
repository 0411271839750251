"""Determinism through the whole server (issue 41), on the shared cluster's TP=2
deployment (tests/support/live_cluster.py: `lockstep up`, real ranks over ring):

four probes — greedy; seeded with top_p and penalties; a JSON schema; n=2 seeded — each
with logprobs and top_logprobs, sent alone, one after another, with the prefix cache
emptied first; then the four at once with six companions of other prompt lengths
arriving while they stream (cache emptied again); then the four again, their prompts now
in the prefix cache. Every stream's tokens and every logprob must equal the probe's run
alone, bit for bit (JSON floats round-trip exactly).
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.gwutil import poll_until, sse_lines
from tests.support import live_cluster as lc

NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: streams run to max_tokens
LONG_JSON = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"},
                                           "minItems": 30}}, "required": ["a"]}}}
LOGPROBS = {"logprobs": True, "top_logprobs": 2}
PROBES = {
    "greedy": {"temperature": 0, "max_tokens": 60, "logit_bias": NO_EOS},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5,
               "frequency_penalty": 0.3, "seed": 11, "max_tokens": 60, "logit_bias": NO_EOS},
    "json": {"temperature": 0, "max_tokens": 60, "response_format": LONG_JSON},
    "n2": {"temperature": 0.7, "seed": 5, "n": 2, "max_tokens": 60, "logit_bias": NO_EOS},
}
PROMPT = "Tell me about the river, the mill and the miller's three sons, at length."


def _stream(url: str, body: dict, out: dict, key: str, lock: threading.Lock) -> None:
    """One streamed chat: per choice, its (token, logprob, top_logprobs) and finish."""
    per: dict[int, list] = {}
    finish: dict[int, str] = {}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
            assert r.status_code == 200, r.read()
            for what, data in sse_lines(r):
                if what != "data" or data == "[DONE]":
                    continue
                assert "error" not in data, data
                for ch in data["choices"]:
                    for t in (ch.get("logprobs") or {}).get("content") or []:
                        per.setdefault(ch["index"], []).append(
                            (t["token"], t["logprob"],
                             [(x["token"], x["logprob"]) for x in t["top_logprobs"]]))
                    if ch.get("finish_reason"):
                        finish[ch["index"]] = ch["finish_reason"]
                with lock:
                    out.setdefault("progress", {})[key] = min(len(v) for v in per.values()) \
                        if per else 0
        result = {"choices": per, "finish": finish}
    except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
        result = {"error": repr(exc)}
    with lock:
        out[key] = result


def _probe_body(kind: str) -> dict:
    return {"model": lc.TP_MODEL, "stream": True, **LOGPROBS, **PROBES[kind],
            "messages": [{"role": "user", "content": PROMPT}]}


def _companion_body(i: int) -> dict:
    text = " ".join(["meadow", "lantern", "harbour", "quartz"][i % 4] for _ in range(8 + 45 * i))
    return {"model": lc.TP_MODEL, "stream": True, "temperature": 0.5, "seed": i,
            "max_tokens": 20 + 7 * i, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": text}]}


def _run(url: str, kinds: list[str], companions: int = 0) -> dict:
    out: dict = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=_stream, args=(url, _probe_body(k), out, k, lock),
                                daemon=True) for k in kinds]
    for t in threads:
        t.start()
    if companions:
        def streaming() -> bool:
            with lock:
                done = [k for k in kinds if k in out]
                p = dict(out.get("progress") or {})
            assert not done, f"a probe finished before its companions came: {done}"
            return all(p.get(k, 0) >= 3 for k in kinds)
        poll_until(streaming, 60, "every probe streaming")
        for i in range(companions):
            t = threading.Thread(target=_stream, args=(url, _companion_body(i), out,
                                                       f"companion{i}", lock), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a stream never ended"
    for key, res in out.items():
        if key != "progress":
            assert "error" not in res, (key, res)
    return {k: out[k] for k in kinds}


def _clear_cache(c: lc.LiveCluster) -> None:
    dep = c.deps[lc.TP_MODEL]["deployment_id"]
    r = httpx.post(f"{c.url}/admin/api/cluster/deployments/{dep}/cache-clear", headers=c.hdr,
                   json={}, timeout=60)
    assert r.status_code == 200, r.text


def _same(got: dict, want: dict, where: str) -> None:
    for kind in PROBES:
        a, b = got[kind], want[kind]
        assert a["finish"] == b["finish"], (where, kind, a["finish"], b["finish"])
        for i in b["choices"]:
            for j, (x, y) in enumerate(zip(a["choices"][i], b["choices"][i], strict=True)):
                assert x == y, f"{where}: {kind} choice {i} token {j}: {x} != {y}"


@pytest.mark.timeout(600)
def test_probes_are_identical_alone_in_company_and_from_the_prefix_cache(live_cluster):
    c = live_cluster
    models = httpx.get(c.url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["determinism"] for m in models}[lc.TP_MODEL] == "on", models
    assert "deterministic:   on (batch-invariant)" in c.text()
    _clear_cache(c)
    alone = {}
    for kind in PROBES:  # one at a time: each probe alone in the batch
        alone.update(_run(c.url, [kind]))
        _clear_cache(c)
    assert all(len(v) == 60 for r in alone.values() for v in r["choices"].values()), alone
    assert len(alone["n2"]["choices"]) == 2
    _same(_run(c.url, list(PROBES), companions=6), alone, "beside six companions")
    _same(_run(c.url, list(PROBES)), alone, "from the prefix cache")  # stored by the last run
