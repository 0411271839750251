"""The determinism probes (issue 41) a live test sends through a gateway: four kinds —
greedy; seeded with top_p and penalties; a JSON schema; n=2 seeded — each streamed with
logprobs and top_logprobs, alone or at once with companions of other prompt lengths that
arrive while they stream; and the comparison, bit for bit (JSON floats round-trip
exactly)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import httpx

from tests.gwutil import poll_until, sse_lines

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


def stream_chat(url: str, body: dict, out: dict, key: str, lock: threading.Lock) -> None:
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


def probe_body(model: str, kind: str, prompt: str = PROMPT, **over) -> dict:
    return {"model": model, "stream": True, **LOGPROBS, **PROBES[kind], **over,
            "messages": [{"role": "user", "content": prompt}]}


def companion_body(model: str, i: int) -> dict:
    text = " ".join(["meadow", "lantern", "harbour", "quartz"][i % 4] for _ in range(8 + 45 * i))
    return {"model": model, "stream": True, "temperature": 0.5, "seed": i,
            "max_tokens": 20 + 7 * i, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": text}]}


FREEZE_S = 4.0  # rank 0 held at most this long: its followers call it lost after 6.5 s


@contextlib.contextmanager
def rank0_frozen(pid: int) -> Iterator[None]:
    """Rank 0 stopped (SIGSTOP) for the block, continued however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def run_probes(url: str, model: str, kinds: list[str], companions: int = 0,
               hold: Callable[[int], contextlib.AbstractContextManager] | None = None,
               **over) -> dict:
    """The probes `kinds` at once (with `over` in each body); `companions` more requests
    start once every probe has streamed 3 tokens. Each probe's choices and finishes.

    With companions the probes are started inside `hold(streams)`, a block that keeps
    rank 0 from stepping until the gateway has sent it that many streams (`held_at_rank0`):
    they then start within a step or two of each other, however long the gateway took to
    prepare each, so none can finish before the last is streaming."""
    out: dict = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=stream_chat, args=(url, probe_body(model, k, **over), out,
                                                      k, lock), daemon=True) for k in kinds]
    if companions and hold is None:
        raise ValueError("companions need `hold`: the probes must start together")
    streams = sum(PROBES[k].get("n", 1) for k in kinds)
    with hold(streams) if hold is not None else contextlib.nullcontext():
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
            t = threading.Thread(target=stream_chat, args=(url, companion_body(model, i), out,
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


def gateway_streams(url: str, hdr: dict, dep_id: str, timeout: float = 10) -> int:
    """Streams the gateway holds on `dep_id` (each registered as its GENERATE is sent:
    services/gateway/core/request_channel.py)."""
    deps = httpx.get(f"{url}/admin/api/cluster/deployments", headers=hdr,
                     timeout=timeout).json()["deployments"]
    return next(d["gateway_active"] for d in deps if d["deployment_id"] == dep_id)


@contextlib.contextmanager
def held_at_rank0(url: str, hdr: dict, dep: dict, streams: int) -> Iterator[None]:
    """`dep`'s rank 0 frozen while the block starts requests, until the gateway has sent
    it `streams` more streams (at most FREEZE_S; none can end meanwhile)."""
    pid = next(r["pid"] for r in dep["ranks"] if r["rank"] == 0)
    dep_id = dep["deployment_id"]
    with rank0_frozen(pid):
        want = gateway_streams(url, hdr, dep_id) + streams
        yield
        poll_until(lambda: gateway_streams(url, hdr, dep_id, FREEZE_S) >= want, FREEZE_S,
                   f"the gateway to send {streams} more streams to rank 0")


def clear_cache(url: str, hdr: dict, dep_id: str) -> None:
    """Every rank's prefix cache emptied (the next prompt prefills cold)."""
    r = httpx.post(f"{url}/admin/api/cluster/deployments/{dep_id}/cache-clear", headers=hdr,
                   json={}, timeout=60)
    assert r.status_code == 200, r.text


def assert_same(got: dict, want: dict, where: str) -> None:
    """Every probe of `want`: the same finishes and, token by token, the same token,
    logprob and top logprobs."""
    for kind in want:
        a, b = got[kind], want[kind]
        assert a["finish"] == b["finish"], (where, kind, a["finish"], b["finish"])
        for i in b["choices"]:
            for j, (x, y) in enumerate(zip(a["choices"][i], b["choices"][i], strict=True)):
                assert x == y, f"{where}: {kind} choice {i} token {j}: {x} != {y}"


