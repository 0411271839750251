"""Rank 0's queue of waiting requests, in the order they are admitted: by priority (lower
first, vLLM's convention); within a priority, tenants (API keys, by name) in turn by
weight; within a tenant, by arrival. A request preempted for the KV budget keeps its
arrival number, so it goes back ahead of every later arrival of its tenant and priority.

Turns are weighted fair queuing by admissions: a tenant's `served` count goes up by
1/weight each time one of its requests is admitted, and the head is the waiting tenant
with the least; a tenant that starts waiting again after a quiet spell starts from the
count of the last admission (virtual time), so its past idleness buys no burst.

Waiting ages, so that no priority starves under a stream of more urgent ones: a lane's
effective priority is its value less one per `age_s` seconds its oldest request has waited
(`AGE_S`, 10 s: a request at priority 10 goes ahead of newcomers at 0 after 100 s). Aging
orders the queue only; preemption for a waiting request compares nominal priorities.

mlx-lm's own queue (BatchGenerator's unprocessed sequences) is FIFO, so the order is
applied here, before anything is inserted into the batch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

AGE_S = 10.0  # seconds of waiting worth one priority level (0: no aging)


@dataclass(frozen=True)
class Waiting:
    priority: int
    arrival: int
    tenant: str = ""
    weight: int = 1
    since: float = 0.0  # monotonic: when it first arrived (a preempted one keeps it)


class WaitQueue:
    def __init__(self, *, age_s: float = AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.age_s, self._clock = age_s, clock
        # per priority, per tenant: (arrival, request id), sorted
        self._lanes: dict[int, dict[str, list[tuple[int, str]]]] = {}
        self._by_rid: dict[str, Waiting] = {}
        self._served: dict[str, float] = {}  # tenant -> admissions / weight
        self._now = 0.0  # the turn count of the last admission, before it: virtual time

    def push(self, rid: str, w: Waiting) -> None:
        if rid in self._by_rid:
            raise ValueError(f"{rid} is already waiting")
        if not any(self._waiting(w.tenant)):  # back after a quiet spell: no burst
            self._served[w.tenant] = max(self._served.get(w.tenant, 0.0), self._now)
        lane = self._lanes.setdefault(w.priority, {}).setdefault(w.tenant, [])
        bisect.insort(lane, (w.arrival, rid))
        self._by_rid[rid] = w

    def _effective(self, priority: int, now: float) -> tuple[float, float]:
        """A lane's place: its priority less its oldest request's age in levels; on a
        tie, the lane waiting longer."""
        if not self.age_s:
            return priority, 0.0
        since = min(self._by_rid[v[0][1]].since for v in self._lanes[priority].values())
        return priority - (now - since) // self.age_s, since

    def head(self) -> str:
        if len(self._lanes) == 1:
            lanes = next(iter(self._lanes.values()))
        else:
            now = self._clock()
            lanes = self._lanes[min(self._lanes, key=lambda p: self._effective(p, now))]
        tenant = min(lanes, key=lambda t: (self._served.get(t, 0.0), lanes[t][0][0]))
        return lanes[tenant][0][1]

    def pop(self) -> str:
        rid = self.head()
        self.remove(rid)
        return rid

    def admitted(self, rid: str, w: Waiting) -> None:
        """`rid` (popped) went into the batch: its tenant's turn is used."""
        served = self._served.get(w.tenant, 0.0)
        self._now = max(self._now, served)
        self._served[w.tenant] = served + 1.0 / max(1, w.weight)

    def remove(self, rid: str) -> None:
        w = self._by_rid.pop(rid)
        lane = self._lanes[w.priority][w.tenant]
        lane.remove((w.arrival, rid))
        if not lane:
            del self._lanes[w.priority][w.tenant]
            if not self._lanes[w.priority]:
                del self._lanes[w.priority]

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._by_rid)

    def __iter__(self) -> Iterator[str]:
        """Every waiting request, by priority, then tenant name, then arrival (not the
        admission order across tenants: that depends on turns to come)."""
        return iter([rid for p in sorted(self._lanes) for t in sorted(self._lanes[p])
                     for _, rid in self._lanes[p][t]])

    def by_priority(self) -> dict[int, int]:
        """Waiting requests per priority."""
        return {p: sum(len(v) for v in lanes.values()) for p, lanes in self._lanes.items()}

    def by_tenant(self) -> dict[str, int]:
        """Waiting requests per tenant."""
        out: dict[str, int] = {}
        for lanes in self._lanes.values():
            for t, v in lanes.items():
                out[t] = out.get(t, 0) + len(v)
        return out

    def _waiting(self, tenant: str) -> Iterator[list[tuple[int, str]]]:
        return (lanes[tenant] for lanes in self._lanes.values() if tenant in lanes)
