"""The soak's clients (tests/faults/soak.py): CLIENTS threads, each streaming
completions through the gateway in a loop, paused while the invariants are checked.
Every stream must end with content, `abort` or an OpenAI-shaped error within a deadline:
a hang or a broken transfer is recorded as a bad outcome and fails the soak."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from services.gateway.core.settings import GatewaySettings
from tests.gwutil import sse_lines

if TYPE_CHECKING:
    from tests.faults.soak import Stats

READ_TIMEOUT_S = 20.0  # gateway request_read_timeout: a stalled stream ends with 504
CLIENTS = 3
SERVING_OUTCOMES = ("content", "abort", "error", "disconnect")


@dataclass(frozen=True)
class Waits:
    """How long the gateway may hold a request, and so when a client calls it a hang.
    The short soak (`make test`) shortens both waits to keep the suite's time; the full
    one (`make soak`) runs them at the gateway's defaults (issue 43, item 7)."""

    admit_wait: float  # LOCKSTEP_ADMIT_WAIT: for a redeploy, before any byte
    resume_timeout: float  # LOCKSTEP_RESUME_TIMEOUT: for a deployment to resume on
    read_timeout: float = READ_TIMEOUT_S

    @classmethod
    def short(cls) -> Waits:
        return cls(admit_wait=20.0, resume_timeout=20.0)

    @classmethod
    def defaults(cls) -> Waits:
        d = GatewaySettings()
        return cls(admit_wait=d.admit_wait, resume_timeout=d.resume_timeout)

    @property
    def deadline_s(self) -> float:
        """A client stream still open after this is a hang: every wait, in a row."""
        return self.admit_wait + self.resume_timeout + self.read_timeout + 20.0

    def env(self) -> dict[str, str]:
        return {"LOCKSTEP_ADMIT_WAIT": str(self.admit_wait),
                "LOCKSTEP_RESUME_TIMEOUT": str(self.resume_timeout)}


class Clients:
    """The client threads; `in_flight` holds the streams open right now."""

    def __init__(self, url: str, seed: int, stats: Stats, model: Callable[[], str],
                 waits: Waits) -> None:
        self.url, self.seed, self.stats, self.model = url, seed, stats, model
        self.waits = waits
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
        with httpx.Client(timeout=httpx.Timeout(self.waits.deadline_s, connect=5)) as http:
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
        deadline = time.monotonic() + self.waits.deadline_s
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
                        return f"hang:stream open after {self.waits.deadline_s:g}s"
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
