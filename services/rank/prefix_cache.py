"""Rank 0's prefix-cache decisions: which entry an insert starts from, what is stored,
what is evicted. Followers never decide; they apply the ops the plan carries
(services/rank/prefix_store.py).

The index mirrors every rank's store: entry id → the tokens it covers and rank 0's bytes
for it (the budget's unit: rank 0 holds the most layers under PP and the same heads as
every peer under TP, so its bytes bound every rank's). LRU order is plan order: an entry
is used when an insert starts from it, and new when stored.

- match: the entry sharing the longest prefix with the prompt, capped at len(prompt)-1
  (the last prompt token is always computed: its logits start the completion). An entry
  longer than the shared prefix is cut to it, which needs trimmable caches.
- store: a request the model finished (stop or length) leaves prompt + generated tokens
  as fed, so a conversation's next turn hits its own reply too. Entries that are a
  prefix of the new one are evicted (the new one serves them, trimmed); then LRU entries
  until the entry and byte budgets hold. An entry bigger than the whole budget is not
  stored. Aborted or cancelled requests are never stored: nothing half-written.
- share a prefill: a request whose prompt shares at least SHARE_TOKENS more with a
  request still in prefill than with any entry waits (stays pending) until that prefill
  ends; its prompt KV is then stored from the running batch (a live STORE) and the
  waiting requests start from it. So n choices of one prompt, or a burst sharing one
  system prompt, compute the shared part once. A waiter never waits on nothing: once
  the request it waits on emits a token or leaves, it is matched again.
- clear: one CLEAR op, every rank empties its store at the same plan.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common.messages import CacheOp, CacheOpKind, CacheStats

MIN_HIT_TOKENS = 8  # below this a hit saves less than copying the entry costs
SHARE_TOKENS = 64  # wait for a running prefill when it would save at least this much
WAIT = -1  # plan_insert: keep the request pending (a running prefill will serve it)


@dataclass
class Indexed:
    tokens: np.ndarray
    nbytes: int


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class CachePlanner:
    def __init__(self, max_entries: int, max_bytes: int, trimmable: bool) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.trimmable = trimmable
        self.index: OrderedDict[int, Indexed] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.next_id = 1
        self.ops: list[CacheOp] = []  # for the next plan
        # the tokens of the STOREs in `ops`, then (take_ops) of the plan just taken: what
        # rank 0's cache events carry (services/rank/cache_events.py)
        self.store_tokens: dict[int, np.ndarray] = {}
        self.taken_tokens: dict[int, np.ndarray] = {}
        self.hits = self.misses = self.hit_tokens = 0
        self.not_stored = 0  # finished requests bigger than the whole budget
        self.prefilling: dict[str, np.ndarray] = {}  # in the batch, no token yet
        self.waited_on: set[str] = set()  # of those, the ones a pending request waits for
        self.clears: list[int] = []  # requested, not yet in a plan
        self.cleared: list[int] = []  # in the plan just taken

    # -- inserts -----------------------------------------------------------------------

    def plan_insert(self, request_id: str, prompt: list[int]) -> tuple[int, int]:
        """(entry, tokens) for inserting `request_id` now, or (WAIT, 0): leave it pending
        until the request in prefill that shares most of its prompt has a token."""
        p = np.asarray(prompt, dtype=np.int64)
        limit = len(prompt) - 1
        best_rid, best_share = None, 0
        for rid, other in self.prefilling.items():
            n = min(shared_prefix(p, other), limit)
            if n > best_share:
                best_rid, best_share = rid, n
        _, held = self.peek(p)
        if best_rid is not None and best_share >= held + SHARE_TOKENS:
            self.waited_on.add(best_rid)
            return WAIT, 0
        entry, n = self.match(prompt)
        if len(prompt) > SHARE_TOKENS:
            self.prefilling[request_id] = p
        return entry, n

    def peek(self, p: np.ndarray) -> tuple[int, int]:
        """The best entry for prompt `p`, without counting or touching it."""
        limit = len(p) - 1
        best, best_n = 0, 0
        for eid, e in reversed(self.index.items()):  # most recent first: ties keep it
            n = min(shared_prefix(p, e.tokens), limit)
            if n < len(e.tokens) and not self.trimmable:
                continue  # it would have to be cut
            if n > best_n:
                best, best_n = eid, n
        return (best, best_n) if best_n >= MIN_HIT_TOKENS else (0, 0)

    def first_token(self, request_id: str) -> bool:
        """`request_id` emitted its first token (its prompt is prefilled), or left the
        batch: True if requests wait for its prompt's KV (store it live now)."""
        self.prefilling.pop(request_id, None)
        if request_id in self.waited_on:
            self.waited_on.discard(request_id)
            return True
        return False

    def left(self, request_id: str) -> None:
        """`request_id` left the batch (removed, or finished)."""
        self.prefilling.pop(request_id, None)
        self.waited_on.discard(request_id)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(entry id, tokens it covers) for an insert of `prompt`; (0, 0) for a miss.
        Call after `take_ops()`: the index then is what every rank holds at inserts."""
        best, best_n = self.peek(np.asarray(prompt, dtype=np.int64))
        if not best:
            self.misses += 1
            return 0, 0
        self.index.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_n
        return best, best_n

    # -- stores, evictions, clears -----------------------------------------------------

    def finished(self, request_id: str, tokens: list[int], nbytes: int, *,
                 live: bool = False) -> None:
        """The model finished `request_id` at the last step (or, `live`, it is still in
        the batch with its prompt prefilled); its KV (`tokens`, rank 0's `nbytes`) can
        be stored by the next plan."""
        if not tokens or nbytes > self.max_bytes:
            self.not_stored += 1
            return
        t = np.asarray(tokens, dtype=np.int64)
        for eid, e in list(self.index.items()):
            if len(e.tokens) == len(t) and shared_prefix(t, e.tokens) == len(t):
                self.index.move_to_end(eid)  # the same tokens are held already
                return
        if self.trimmable:  # entries it extends: it serves them, trimmed
            for eid, e in list(self.index.items()):
                if len(e.tokens) < len(t) and shared_prefix(t, e.tokens) == len(e.tokens):
                    self._evict(eid)
        while self.index and (len(self.index) + 1 > self.max_entries
                              or self.nbytes + nbytes > self.max_bytes):
            self._evict(next(iter(self.index)))
        eid = self.next_id
        self.next_id += 1
        self.index[eid] = Indexed(t, nbytes)
        self.store_tokens[eid] = t
        self.nbytes += nbytes
        self.ops.append(CacheOp(kind=CacheOpKind.STORE, entry_id=eid, request_id=request_id,
                                n_tokens=len(tokens), nbytes=nbytes, live=live))

    def _evict(self, eid: int) -> None:
        e = self.index.pop(eid)
        self.nbytes -= e.nbytes
        self.ops.append(CacheOp(kind=CacheOpKind.EVICT, entry_id=eid))

    def request_clear(self, clear_id: int = 0) -> None:
        """Empty every rank's store at the next plan (admin cache-clear); `clear_id` is
        handed back by `take_cleared()` once that plan is built, to acknowledge it."""
        # Pending stores and evictions are moot: the KV of a store not applied is
        # dropped at that plan anyway.
        self.ops = [CacheOp(kind=CacheOpKind.CLEAR)]
        self.store_tokens = {}
        self.index.clear()
        self.nbytes = 0
        self.clears.append(clear_id)

    def take_cleared(self) -> list[int]:
        """Clear ids whose CLEAR went into the plan just taken (`take_ops`)."""
        out, self.cleared = self.cleared, []
        return out

    def has_ops(self) -> bool:
        return bool(self.ops)

    def take_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        self.taken_tokens, self.store_tokens = self.store_tokens, {}
        self.cleared.extend(self.clears)
        self.clears = []
        return ops

    def stats(self, store: CacheStats) -> CacheStats:
        """Rank 0's telemetry: its own store's figures plus the decisions' counters."""
        store.hits, store.misses, store.hit_tokens = self.hits, self.misses, self.hit_tokens
        return store
