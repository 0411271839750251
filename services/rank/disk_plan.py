"""Rank 0's view of the prefix cache's disk tier: which entries every rank holds on its
own disk, which to write through, which to drop. Rank 0 alone decides (as for the
memory tier, services/rank/prefix_cache.py); the plan carries the decisions as cache
ops (STORE with persist, LOAD, DROP) and every rank applies them to its DiskTier
(services/rank/disk_tier.py).

An entry is known by its content key (a hash of its tokens), the same on every rank and
across launches, so a restarted deployment finds the files of the last one. The tier is
usable only once every follower has said which entries it verified at start-up (its
DISK_INDEX): an entry is loadable only if every rank verified it (MAC, model, placement,
rank); the rest are dropped on every rank. A rank whose write failed, or whose file no
longer checks out when rank 0 reads its own, has the entry dropped everywhere — a
request then simply prefills.

Budget: rank 0's bytes, as for the memory tier (rank 0 holds at least every peer's
share); LRU by use, across restarts by file mtime.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common.messages import CacheOp, CacheOpKind, DiskIndex

log = logging.getLogger("lockstep.rank.disk_plan")


@dataclass
class OnDisk:
    tokens: np.ndarray
    nbytes: int


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def drop_op(key: str) -> CacheOp:
    return CacheOp(kind=CacheOpKind.DROP, key=key)


class DiskPlanner:
    def __init__(self, budget: int, followers: int, boot: dict[str, tuple[list[int], int, float]]):
        """`boot`: rank 0's own verified entries, key → (tokens, bytes, last used)."""
        self.budget = budget
        self.on = budget > 0
        self.waiting = set(range(1, followers + 1))  # followers yet to report
        self.seqs: dict[int, int] = {}  # rank → the last DISK_INDEX seq taken
        self.boot = boot
        self.verified: list[set[str]] = []
        self.index: OrderedDict[str, OnDisk] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.hits = self.hit_tokens = 0
        self.dropped_unverified = 0
        self.ops: list[CacheOp] = []
        if not self.waiting:
            self._reconcile()

    @property
    def ready(self) -> bool:
        return self.on and not self.waiting

    # -- start-up: every rank's verified entries ---------------------------------------

    def report(self, r: DiskIndex) -> None:
        """A follower's DISK_INDEX (re-sent until acknowledged: each seq taken once)."""
        if r.seq <= self.seqs.get(r.rank, 0):
            return
        self.seqs[r.rank] = r.seq
        if r.off and self.on:
            log.warning("rank %d's disk tier is off: the prefix cache keeps to memory", r.rank)
            self.on = False
        if r.rank in self.waiting:
            self.waiting.discard(r.rank)
            self.verified.append(set(r.verified))
            if not self.waiting:
                self._reconcile()
        for key in r.failed:
            self.lost(key)

    def _reconcile(self) -> None:
        """Every rank reported: keep what all verified, drop the rest everywhere."""
        everyone = set(self.boot).intersection(*self.verified)
        seen = set(self.boot).union(*self.verified)
        for key in sorted(seen - everyone):
            self.ops.append(drop_op(key))
            self.dropped_unverified += 1
        for key, (tokens, nbytes, _) in sorted(self.boot.items(), key=lambda kv: kv[1][2]):
            if key in everyone and self.on:
                self.index[key] = OnDisk(np.asarray(tokens, dtype=np.int64), nbytes)
                self.nbytes += nbytes
            elif key in everyone:  # the tier is off: nothing is kept
                self.ops.append(drop_op(key))
        self._fit(0)
        self.boot = {}
        self.verified = []

    def acks(self, world_size: int) -> list[int]:
        """What a PING acknowledges: the seq taken from each rank."""
        return [self.seqs.get(r, 0) for r in range(world_size)]

    # -- decisions -----------------------------------------------------------------------

    def admit(self, key: str, tokens: np.ndarray, nbytes: int,
              extends: list[str]) -> bool:
        """A STORE of `key`: write it through (True) if the tier is ready and it fits;
        entries it extends are dropped (it serves them), then LRU ones until it fits."""
        if not self.ready or nbytes > self.budget:
            return False
        if key in self.index:
            self.index.move_to_end(key)
            return False  # on disk already
        for k in extends:
            if k in self.index:
                self._drop(k)
        self._fit(nbytes)
        self.index[key] = OnDisk(tokens, nbytes)
        self.nbytes += nbytes
        return True

    def _fit(self, nbytes: int) -> None:
        while self.index and self.nbytes + nbytes > self.budget:
            self._drop(next(iter(self.index)))

    def _drop(self, key: str) -> None:
        e = self.index.pop(key)
        self.nbytes -= e.nbytes
        self.ops.append(drop_op(key))

    def lost(self, key: str) -> None:
        """`key` cannot be trusted on some rank (a failed write, a bad file): drop it on
        every rank."""
        if key in self.index:
            self._drop(key)

    def best(self, p: np.ndarray, limit: int, skip: set[str],
             trimmable: bool) -> tuple[str, int]:
        """The disk entry sharing the longest prefix with `p` (not in `skip`: held in
        memory), capped at `limit`; ("", 0) if none."""
        if not self.ready:
            return "", 0
        best, best_n = "", 0
        for key, e in reversed(self.index.items()):
            if key in skip:
                continue
            n = min(shared_prefix(p, e.tokens), limit)
            if n < len(e.tokens) and not trimmable:
                continue
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def used(self, key: str) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    def loaded(self, n: int) -> None:
        self.hits += 1
        self.hit_tokens += n

    def clear(self) -> None:
        """Admin cache-clear: the CLEAR op empties every rank's disk too."""
        self.index.clear()
        self.nbytes = 0
        self.ops = []

    def take_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops
