"""The soak's clients (tests/faults/soak.py): CLIENTS threads, each streaming
completions through the gateway in a loop, paused while the invariants are checked.
Every stream must end with content, `abort` or an OpenAI-shaped error within a deadline:
a hang or a broken transfer is recorded as a bad outcome and fails the soak."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from tests.gwutil import sse_lines

if TYPE_CHECKING:
    from tests.faults.soak import Stats

READ_TIMEOUT_S = 20.0  # gateway request_read_timeout: a stalled stream ends with 504
ADMIT_WAIT_S = 20.0  # gateway admit_wait: a request waits this long for a redeploy
STREAM_DEADLINE_S = 60.0  # a client stream still open after this is a hang
CLIENTS = 3
SERVING_OUTCOMES = ("content", "abort", "error", "disconnect")


class Clients:
    """The client threads; `in_flight` holds the streams open right now."""

    def __init__(self, url: str, seed: int, stats: Stats, model: Callable[[], str]) -> None:
        self.url, self.seed, self.stats, self.model = url, seed, stats, model
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.lock = threading.Lock()
        self.in_flight: dict[int, float] = {}
        self.workers: list[threading.Thread] = []

    def start(self, n: int = CLIENTS) -> None:
        for i in range(n):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True,
                                 name=f"soak-client-{i}")
            t.start()
            self.workers.append(t)

    def _loop(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        # longer than a wait for a redeploy (no byte before admission) and a stalled read
        with httpx.Client(timeout=httpx.Timeout(ADMIT_WAIT_S + READ_TIMEOUT_S + 10,
                                                connect=5)) as http:
            n = 0
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.05)
                    continue
                n += 1
                key = i * 1_000_000 + n
                with self.lock:
                    self.in_flight[key] = time.monotonic()
                began = time.monotonic()
                try:
                    outcome = self.stream_once(http, rng.randint(8, 160),
                                               disconnect=rng.random() < 0.15)
                finally:
                    with self.lock:
                        self.in_flight.pop(key, None)
                self.record(outcome, began)
                if outcome.startswith("error"):
                    time.sleep(0.5)  # no service: don't spin on 503s

    def record(self, outcome: str, began: float | None = None) -> None:
        kind = outcome.split(":", 1)[0]
        with self.lock:
            self.stats.outcomes[kind] += 1
            if began is not None:
                self.stats.requests.append((began, time.monotonic(), outcome))
            if kind == "error":
                self.stats.errors[outcome] += 1
            if kind not in SERVING_OUTCOMES:
                self.stats.bad.append(outcome)

    def stream_once(self, http: httpx.Client, max_tokens: int, *, disconnect: bool) -> str:
        """One streaming completion; returns content | abort | error:<code> | disconnect,
        or hang:/broken:<why> (both fail the soak)."""
        model = self.model()
        body = {"model": model, "prompt": "the quick brown fox", "max_tokens": max_tokens,
                "temperature": 0, "stream": True}
        deadline = time.monotonic() + STREAM_DEADLINE_S
        try:
            with http.stream("POST", self.url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    try:
                        err = resp.json()["error"]
                        assert {"message", "type", "param", "code"} <= set(err)
                        return f"error:{resp.status_code}:{err['code']}"
                    except Exception:  # noqa: BLE001
                        return f"broken:status {resp.status_code} body {resp.text[:200]!r}"
                finish, done, got = None, False, 0
                for kind, data in sse_lines(resp):
                    if time.monotonic() > deadline:
                        return f"hang:stream open after {STREAM_DEADLINE_S}s"
                    if kind != "data":
                        continue
                    if data == "[DONE]":
                        done = True
                        break
                    if "error" in data:
                        finish = f"error:stream:{data['error'].get('code')}"
                        continue
                    for ch in data.get("choices") or []:
                        got += len(ch.get("text") or "")
                        finish = ch.get("finish_reason") or finish
                    if disconnect and got:
                        return "disconnect"
                if not done:
                    return f"broken:no [DONE] (finish {finish})"
                if finish in ("stop", "length"):
                    return "content"
                if finish == "abort" or (finish or "").startswith("error"):
                    return finish.split(":")[0] if finish == "abort" else finish
                return f"broken:finish_reason {finish!r}"
        except httpx.ReadTimeout:
            return "hang:read timeout"
        except httpx.HTTPError as exc:
            return f"broken:{type(exc).__name__}: {exc}"
