"""Concurrent client streams with a fault in the middle: the shape every live failover
test shares. `one(i, got, lock)` runs stream i and records, under `lock`,
`got["where"][i]` (its x-lockstep-deployment), `got["chunks"][i]` (deltas so far) and
finally `got[i]` (its result; `chat_stream` records a streamed chat so).
`fault(where)` runs once every stream has streamed `min_chunks` deltas and none has
ended (a fault after an end would prove nothing)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from tests.gwutil import GaveUp, poll_until, sse_lines

Record = Callable[[int, dict, threading.Lock], None]


def streams_with_fault(n: int, one: Record, fault: Callable[[dict], None] | None = None, *,
                       one_by_one: bool = False, min_chunks: int = 3,
                       join_s: float = 180.0) -> dict:
    """Run n streams (`one_by_one`: each admitted before the next starts, so the router
    sees each one's load); return `got`."""
    got: dict = {}
    lock = threading.Lock()
    threads = []
    for i in range(n):
        t = threading.Thread(target=one, args=(i, got, lock), daemon=True)
        t.start()
        threads.append(t)
        if one_by_one:
            poll_until(lambda i=i: i in got.get("where", {}) or i in got, 60,
                       f"stream {i} admitted")
    if fault is not None:
        def streaming() -> bool:
            with lock:
                done = [i for i in range(n) if i in got]
                counts = dict(got.get("chunks") or {})
            if done:
                raise GaveUp(f"a stream finished before the fault: {done}")
            return len(counts) == n and min(counts.values()) >= min_chunks
        poll_until(streaming, 60, f"all {n} streaming")
        with lock:
            where = dict(got["where"])
        fault(where)
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a stream never ended"
    return got


def chat_stream(url: str, body: dict, i: int, got: dict, lock: threading.Lock,
                timeout: float = 180.0) -> None:
    """Stream i: a streamed chat completion `body`, recorded as `streams_with_fault`
    expects; its result is (text, finish_reason, in-band errors), or ("exception", repr,
    []) if the request itself failed."""
    text: list[str] = []
    finish, errors = None, []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=timeout) as r:
            assert r.status_code == 200, r.read()
            with lock:
                got.setdefault("where", {})[i] = r.headers["x-lockstep-deployment"]
            for what, data in sse_lines(r):
                if what != "data" or data == "[DONE]":
                    continue
                if "error" in data:
                    errors.append(data["error"])
                    continue
                for ch in data["choices"]:
                    text.append(ch["delta"].get("content") or "")
                    finish = ch.get("finish_reason") or finish
                with lock:
                    got.setdefault("chunks", {})[i] = len(text)
        result = ("".join(text), finish, errors)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        result = ("exception", repr(exc), [])
    with lock:
        got[i] = result
