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
  as fed, so a conversation's next turn hits its own reply too. Entries that the new one
  covers but for a few end tokens (SUPERSEDE_SLACK; a prefix of it, or the previous
  turn, whose reply the next prompt resends re-tokenized) are evicted (the new one
  serves them, trimmed, recomputing at most those tokens); then LRU entries
  until the entry and byte budgets hold. An entry bigger than the whole budget is not
  stored. Aborted or cancelled requests are never stored: nothing half-written.
- share a prefill: a request whose prompt shares at least SHARE_TOKENS more with a
  request still in prefill than with any entry waits (stays pending) until that prefill
  ends; its prompt KV is then stored from the running batch (a live STORE) and the
  waiting requests start from it. So n choices of one prompt, or a burst sharing one
  system prompt, compute the shared part once. A waiter never waits on nothing: once
  the request it waits on emits a token or leaves, it is matched again.
- clear: one CLEAR op, every rank empties its store at the same plan (and its disk).
- disk tier (services/rank/disk_plan.py): a store is written through to every rank's
  disk if it fits the disk budget; a prompt whose best entry is on disk only (held
  longer than any entry in memory) gets a LOAD op before its insert: every rank reads
  it into memory as a new entry, which the insert starts from. Rank 0 reads its own
  file first (`disk_load`): one that no longer checks out is dropped everywhere, and
  the prompt matches again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common.messages import CacheOp, CacheOpKind, CacheStats
from services.rank.disk_plan import DiskPlanner, shared_prefix
from services.rank.disk_tier import entry_key

MIN_HIT_TOKENS = 8  # below this a hit saves less than copying the entry costs
SHARE_TOKENS = 64  # wait for a running prefill when it would save at least this much
WAIT = -1  # plan_insert: keep the request pending (a running prefill will serve it)
SUPERSEDE_SLACK = 256  # a store evicts an entry it covers but for this many end tokens
SUPERSEDE_SHARE = 8  # ... and at most this share of the entry


def superseded(old: np.ndarray, new: np.ndarray) -> bool:
    """`new` serves `old`'s prompts (trimmed) but for at most SUPERSEDE_SLACK tokens (and
    an eighth of `old`) at its end: an agent's next turn resends its reply re-tokenized, which often differs
    from the tokens generated in its last few, so the old entry is not a strict prefix
    of the new. Holding both would keep a second copy of the whole conversation's KV per
    turn; measured on a CPU rank, the memory they held slowed later turns' prefill
    (bench/results/agent_session_bench.json's note)."""
    if len(old) > len(new):
        return False
    slack = min(SUPERSEDE_SLACK, len(old) // SUPERSEDE_SHARE)
    return shared_prefix(new, old) >= len(old) - slack


@dataclass
class Indexed:
    tokens: np.ndarray
    nbytes: int
    key: str = ""  # the content key (disk_tier.entry_key)


__all__ = ["WAIT", "CachePlanner", "shared_prefix"]


class CachePlanner:
    def __init__(self, max_entries: int, max_bytes: int, trimmable: bool,
                 disk: DiskPlanner | None = None) -> None:
        self.disk = disk  # None: no disk tier
        # Rank 0 reads a disk entry before planning its LOAD: its bytes in memory, or 0
        # if its file no longer checks out (set by the leader: PromptStore.preload).
        self.disk_load = None
        self.pinned: set[int] = set()  # entries this plan's inserts start from
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
        """The tokens the best entry for prompt `p` covers, in memory or on disk, without
        counting or touching it: (entry id, tokens); entry id 0 for a disk entry."""
        best, best_n, _, disk_n = self._best(p)
        return (best, best_n) if best_n >= disk_n else (0, disk_n)

    def _best(self, p: np.ndarray) -> tuple[int, int, str, int]:
        """(memory entry, its tokens, disk key, its tokens), each (0/"", 0) below
        MIN_HIT_TOKENS; the disk one only if it covers more than memory's."""
        limit = len(p) - 1
        best, best_n = 0, 0
        for eid, e in reversed(self.index.items()):  # most recent first: ties keep it
            n = min(shared_prefix(p, e.tokens), limit)
            if n < len(e.tokens) and not self.trimmable:
                continue  # it would have to be cut
            if n > best_n:
                best, best_n = eid, n
        if best_n < MIN_HIT_TOKENS:
            best, best_n = 0, 0
        key, disk_n = "", 0
        if self.disk is not None:
            key, disk_n = self.disk.best(p, limit, {e.key for e in self.index.values()},
                                         self.trimmable)
            if disk_n <= best_n or disk_n < MIN_HIT_TOKENS:
                key, disk_n = "", 0
        return best, best_n, key, disk_n

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
        p = np.asarray(prompt, dtype=np.int64)
        while True:
            best, best_n, key, disk_n = self._best(p)
            if not key:
                break
            eid = self._load(key, disk_n)
            if eid:
                return eid, disk_n
            if key in self.disk.index:  # kept, but no room now: memory's best, if any
                break
        if not best:
            self.misses += 1
            return 0, 0
        self.index.move_to_end(best)
        if self.disk is not None:
            self.disk.used(self.index[best].key)
        self.pinned.add(best)
        self.hits += 1
        self.hit_tokens += best_n
        return best, best_n

    def _load(self, key: str, n: int) -> int:
        """Plan a LOAD of disk entry `key` into memory: its new entry id, or 0 if rank 0's
        own copy no longer checks out (then it is dropped on every rank)."""
        nbytes = self.disk_load(key, len(self.disk.index[key].tokens)) if self.disk_load else 0
        if not nbytes:
            self.disk.lost(key)
            return 0
        if not self._make_room(nbytes):
            return 0
        tokens = self.disk.index[key].tokens
        eid = self.next_id
        self.next_id += 1
        self.index[eid] = Indexed(tokens, nbytes, key)
        self.store_tokens[eid] = tokens
        self.nbytes += nbytes
        self.pinned.add(eid)
        self.ops.append(CacheOp(kind=CacheOpKind.LOAD, entry_id=eid, key=key,
                                n_tokens=len(tokens), nbytes=nbytes))
        self.disk.used(key)
        self.disk.loaded(n)
        self.hits += 1
        self.hit_tokens += n
        return eid

    def _make_room(self, nbytes: int) -> bool:
        """Evict LRU entries (not one this plan's inserts start from) until one more
        entry of `nbytes` fits; False if it cannot (nothing evicted then)."""
        def fits(n_entries: int, held: int) -> bool:
            return n_entries + 1 <= self.max_entries and held + nbytes <= self.max_bytes

        free = [eid for eid in self.index if eid not in self.pinned]
        n, held = len(self.index), self.nbytes
        victims = []
        for eid in free:
            if fits(n, held):
                break
            victims.append(eid)
            n, held = n - 1, held - self.index[eid].nbytes
        if not fits(n, held):
            return False
        for eid in victims:
            self._evict(eid)
        return True

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
        extends: list[str] = []  # disk entries it extends: it serves them, trimmed
        if self.trimmable:  # entries it supersedes: it serves them, trimmed
            for eid, e in list(self.index.items()):
                if superseded(e.tokens, t) and eid not in self.pinned:
                    self._evict(eid)
            if self.disk is not None:
                extends = [k for k, e in self.disk.index.items()
                           if len(e.tokens) < len(t)
                           and shared_prefix(t, e.tokens) == len(e.tokens)]
        if not self._make_room(nbytes):
            self.not_stored += 1
            return
        key = entry_key(t)
        persist = self.disk is not None and self.disk.admit(key, t, nbytes, extends)
        eid = self.next_id
        self.next_id += 1
        self.index[eid] = Indexed(t, nbytes, key)
        self.store_tokens[eid] = t
        self.nbytes += nbytes
        self.ops.append(CacheOp(kind=CacheOpKind.STORE, entry_id=eid, request_id=request_id,
                                n_tokens=len(tokens), nbytes=nbytes, live=live, key=key,
                                persist=persist))

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
        if self.disk is not None:
            self.disk.clear()
        self.store_tokens = {}
        self.index.clear()
        self.nbytes = 0
        self.clears.append(clear_id)

    def take_cleared(self) -> list[int]:
        """Clear ids whose CLEAR went into the plan just taken (`take_ops`)."""
        out, self.cleared = self.cleared, []
        return out

    def has_ops(self) -> bool:
        return bool(self.ops) or (self.disk is not None and bool(self.disk.ops))

    def take_ops(self) -> list[CacheOp]:
        """The ops for the plan being built (its inserts are matched after this)."""
        self.pinned = set()
        ops, self.ops = self.ops, []
        if self.disk is not None:
            ops += self.disk.take_ops()
        self.taken_tokens, self.store_tokens = self.store_tokens, {}
        self.cleared.extend(self.clears)
        self.clears = []
        return ops

    def take_loads(self) -> list[CacheOp]:
        """The ops the inserts' matching added (LOADs, the evictions and drops they
        needed): applied after `take_ops()`'s, before the inserts."""
        ops, self.ops = self.ops, []
        if self.disk is not None:
            ops += self.disk.take_ops()
        self.taken_tokens.update(self.store_tokens)
        self.store_tokens = {}
        self.pinned = set()  # the plan is built: later stores may evict anything
        return ops

    def stats(self, store: CacheStats) -> CacheStats:
        """Rank 0's telemetry: its own store's figures plus the decisions' counters."""
        store.hits, store.misses, store.hit_tokens = self.hits, self.misses, self.hit_tokens
        if self.disk is not None:
            store.disk_hits, store.disk_hit_tokens = self.disk.hits, self.disk.hit_tokens
        return store
