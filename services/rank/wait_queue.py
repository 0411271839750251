"""Rank 0's queue of waiting requests, in the order they are admitted: by priority (lower
first, vLLM's convention), then by arrival. A request preempted for the KV budget keeps
its arrival number, so it goes back ahead of every later arrival of its priority.

mlx-lm's own queue (BatchGenerator's unprocessed sequences) is FIFO, so the order is
applied here, before anything is inserted into the batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class WaitQueue:
    def __init__(self) -> None:
        self._keys: list[tuple[int, int, str]] = []  # (priority, arrival, request id), sorted
        self._by_rid: dict[str, tuple[int, int, str]] = {}

    def push(self, rid: str, priority: int, arrival: int) -> None:
        if rid in self._by_rid:
            raise ValueError(f"{rid} is already waiting")
        key = (priority, arrival, rid)
        bisect.insort(self._keys, key)
        self._by_rid[rid] = key

    def head(self) -> str:
        return self._keys[0][2]

    def pop(self) -> str:
        key = self._keys.pop(0)
        del self._by_rid[key[2]]
        return key[2]

    def remove(self, rid: str) -> None:
        key = self._by_rid.pop(rid)
        del self._keys[bisect.bisect_left(self._keys, key)]

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return (k[2] for k in list(self._keys))

    def by_priority(self) -> dict[int, int]:
        """Waiting requests per priority."""
        out: dict[int, int] = {}
        for p, _, _ in self._keys:
            out[p] = out.get(p, 0) + 1
        return out
