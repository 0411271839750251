"""Stored responses (`store: true`, OpenAI's default): what `GET /v1/responses/{id}`
answers and what `previous_response_id` continues.

In the gateway process's memory, bounded three ways — a count (`max_entries`), the JSON
bytes of everything kept (`max_bytes`), and an age (`ttl_s`, counted from when the
response was stored) — least recently used first out. A response that alone exceeds
`max_bytes` is not kept (its `store` is then reported false). Nothing survives a gateway
restart; with several gateways a response lives in the one that served it.

Each entry keeps the response object and its whole conversation as input items (the
earlier turns', its own input, its output), so a continuation needs only its direct
predecessor, however long the chain; `instructions` are not part of it (as OpenAI's).
Every item gets an id when first stored (`msg_`, `fc_`, `fco_`, `rs_`; an output item
keeps its own), the same in every later response of the chain: what
`GET /v1/responses/{id}/input_items` lists and pages by.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 1024
MAX_BYTES = 64 * 1024 * 1024
TTL_S = 3600.0
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}


@dataclass
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the conversation, as input items, through this response
    at: float
    nbytes: int

    def input_items(self) -> list[dict[str, Any]]:
        """The items this response was generated from: the chain's earlier turns and
        its own input (its own output items, which end `items`, excluded)."""
        n = len(output_as_input(self.response.get("output") or []))
        return self.items[:len(self.items) - n]


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every item given an id if it has none, in place: a background response stores its
    conversation twice (running, then ended), and both must list the same ids."""
    for it in items:
        if not it.get("id"):
            it["id"] = f"{ID_PREFIX.get(it.get('type') or 'message', 'item')}_{secrets.token_hex(12)}"
    return items


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self._d: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, rid: str, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep it (evicting the least recently used as needed); False: too big to keep."""
        items = with_ids(items)
        n = len(json.dumps([response, items], ensure_ascii=False).encode())
        if n > self.max_bytes:
            return False
        with self._lock:
            self._drop(rid)
            self._d[rid] = Stored(response, items, self.clock(), n)
            self._bytes += n
            self._expire()
            while len(self._d) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._d)))
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            self._expire()
            s = self._d.get(rid)
            if s is not None:
                self._d.move_to_end(rid)
            return s

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        s = self._d.pop(rid, None)
        if s is None:
            return False
        self._bytes -= s.nbytes
        return True

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for rid in [k for k, s in self._d.items() if s.at < cutoff]:
            self._drop(rid)


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items that continue from them."""
    out: list[dict[str, Any]] = []
    for it in output:
        if it["type"] == "message":
            out.append({"id": it["id"], "type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": p.get("text", "")} for p in it["content"]]})
        elif it["type"] == "function_call":
            out.append({"id": it["id"], "type": "function_call", "call_id": it["call_id"], "name": it["name"],
                        **({"namespace": it["namespace"]} if it.get("namespace") else {}),
                        "arguments": it["arguments"]})
        elif it["type"] == "reasoning":
            out.append({"id": it["id"], "type": "reasoning", "summary": [], "content": [
                {"type": "reasoning_text", "text": p.get("text", "")} for p in it["content"]]})
    return out
