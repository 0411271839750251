"""One streaming /v1/chat/completions request, timed the same way for every server, and
the statistics the serving benchmarks report.

TTFT is client-side: send → the first chunk whose delta has non-empty `content` (a
role-only first chunk does not count). Inter-token latency (ITL) samples are the gaps
between successive content chunks; `chunks` vs `completion_tokens` (from the server's
`usage`, include_usage) says whether a server packs several tokens in one chunk. The
HTTP client is bench/sse_http.py (lean on purpose: it shares the CPU with the server it
measures).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

from bench.sse_http import HttpError, post_json


@dataclass
class Reply:
    sent_at: float  # time.monotonic()
    ttft_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # content chunk times since send
    text: str = ""
    done_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    lockstep: dict | None = None  # Lockstep's own timings (ttft_model_ms, ...)

    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def record(self) -> dict:
        out = {"ttft_ms": ms(self.ttft_s), "total_ms": ms(self.done_s),
               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "chunks": len(self.chunk_s), "cached_tokens": self.cached_tokens,
               "finish_reason": self.finish_reason}
        if self.lockstep:
            out["lockstep"] = self.lockstep
        return out


def ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


REQUEST_TIMEOUT_S = 1800.0  # one request, send to last byte
# Written into every result that uses this client, so a reader knows what measured it.
CLIENT = ("bench/sse_http.py: asyncio streams, one HTTP/1.1 connection per request, "
          "SSE lines parsed with json; replaced httpx on 2026-12-01 (httpx cost ~570 us of "
          "client CPU per streamed token on the 2 cores the server under test shares)")


async def chat(url: str, model: str, messages: list[dict], max_tokens: int,
               tools: list[dict] | None = None) -> Reply:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = tools
    r = Reply(time.monotonic())
    parts: list[str] = []
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        resp = await post_json(url + "/v1/chat/completions", body)
        try:
            if resp.status != 200:
                raise RuntimeError(f"{url}: {HttpError(resp.status, await resp.read())}")
            async for line in resp.lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic() - r.sent_at
                d = json.loads(line[6:])
                if "error" in d and not d.get("choices"):
                    raise RuntimeError(f"{url}: stream error {d['error']}")
                for ch in d.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        if r.ttft_s is None:
                            r.ttft_s = now
                        r.chunk_s.append(now)
                        parts.append(text)
                    if ch.get("finish_reason"):
                        r.finish_reason = ch["finish_reason"]
                usage = d.get("usage")
                if usage:
                    r.prompt_tokens = usage.get("prompt_tokens", 0)
                    r.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    r.cached_tokens = details.get("cached_tokens")
                if isinstance(d.get("lockstep"), dict):
                    r.lockstep = d["lockstep"]
        finally:
            resp.close()
    r.done_s = time.monotonic() - r.sent_at
    r.text = "".join(parts)
    return r


async def run_concurrent(url: str, model: str, conversations: list[list[dict]], max_tokens: int,
                         concurrency: int) -> tuple[list[Reply], float]:
    """Every message list as one request, `concurrency` in flight at all times; the
    replies in input order and the wall seconds from the first send to the last end."""
    sem = asyncio.Semaphore(concurrency)

    async def one(msgs: list[dict]) -> Reply:
        async with sem:
            return await chat(url, model, msgs, max_tokens)

    t0 = time.monotonic()
    replies = await asyncio.gather(*(one(m) for m in conversations))
    return list(replies), time.monotonic() - t0


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None if empty."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(replies: list[Reply], seconds: float) -> dict:
    """Throughput and latency of one measured batch of requests."""
    ttft = [r.ttft_s for r in replies if r.ttft_s is not None]
    itl = [g for r in replies for g in r.itl_s()]
    toks = sum(r.completion_tokens for r in replies)
    chunks = sum(len(r.chunk_s) for r in replies)
    cached = [r.cached_tokens for r in replies if r.cached_tokens is not None]
    out = {"requests": len(replies), "seconds": round(seconds, 3),
           "completion_tokens": toks, "tok_s": round(toks / seconds, 3) if seconds else None,
           "prompt_tokens_mean": round(sum(r.prompt_tokens for r in replies) / len(replies), 1),
           "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)),
           "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99)),
           "chunks_per_token": round(chunks / toks, 3) if toks else None,
           "cached_tokens_total": sum(cached) if cached else None,
           "missing_ttft": len(replies) - len(ttft)}
    model_ttft = [r.lockstep.get("ttft_model_ms") for r in replies if r.lockstep]
    model_ttft = [x for x in model_ttft if x is not None]
    if model_ttft:
        out["lockstep_model_ttft_p50_ms"] = round(pct(model_ttft, 50), 2)
    return out
