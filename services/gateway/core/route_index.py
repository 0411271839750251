"""The approximate prefix index: per deployment, the token sequences the gateway sent
there lately (each prompt when routed, then prompt + output when the request finished
as the model ended it), LRU-bounded. It knows nothing of rank 0's evictions or clears,
only what it routed; services/gateway/core/cache_index.py is the precise one, fed by rank 0's
own cache events. Both answer `longest_prefix` the same way rank 0 matches: the longest
shared prefix with any entry, capped at len(prompt) - 1 (the last prompt token is always
computed)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_ENTRIES = 64  # twice rank 0's default entry budget: a routed prompt may not be stored


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RoutedIndex:
    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()  # LRU first
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, ids: Sequence[int]) -> int:
        if len(ids) < 2 or not self._entries:
            return 0
        p = np.asarray(ids, dtype=np.int64)
        return min(max(shared_prefix(p, e) for e in self._entries.values()), len(p) - 1)

    def add(self, ids: Sequence[int]) -> None:
        """Record a sequence sent here; entries it extends are dropped (it covers them),
        and one it repeats is only made recent."""
        t = np.asarray(ids, dtype=np.int64)
        if not len(t):
            return
        for key, e in list(self._entries.items()):
            n = shared_prefix(t, e)
            if n == len(t):  # held already (the same, or a longer one)
                self._entries.move_to_end(key)
                return
            if n == len(e):
                del self._entries[key]
        self._entries[self._next] = t
        self._next += 1
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
