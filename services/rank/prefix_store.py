"""Every rank's prompt-cache store: its own part of each entry's KV, changed only by plans.

An entry is the KV one finished request left behind (its prompt and the generated tokens
that were fed back), on this rank: its heads under TP, its layers under PP. Rank 0
decides everything (services/rank/prefix_cache.py) and the plan carries it: `CacheOp`s
store, evict and clear; an insert names the entry it starts from and how many of its
tokens to keep. This module only applies those decisions and checks them: an entry the
plan names but this rank does not hold, tokens that differ from the prompt, or more bytes
than rank 0 accounted for are a `Divergence` — the rank fails closed instead of
computing from a KV its peers do not have.

The disk tier (services/rank/disk_tier.py) is the store's too: a STORE with `persist`
is written through to this rank's disk (off the step path), a LOAD reads an entry back
into memory (its MAC checked), a DROP deletes one, a CLEAR deletes every one. A LOAD
this rank cannot make (its file gone bad since start-up) is a `Divergence` like any
other: rank 0 checks its own copy first, and every follower's start-up scan is what
rank 0 planned from.

`rank-<r>.cache.jsonl` (next to the removal record) gets one line per plan that changed
the store, `{"seq", "step", "entries": [[id, n_tokens], ...], "bytes", "disk": [[key,
n_tokens], ...], "at"}`, so tests and incident forensics can check that every rank's
index equals rank 0's after every plan (bytes differ per rank under PP; ids, keys and
token counts never do).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import KVCache, trim_prompt_cache

from common.home import Paths, marker_dir
from common.messages import CacheOp, CacheOpKind, CacheStats
from services.rank.disk_tier import DiskEntry, DiskEntryError, DiskTier, entry_key

log = logging.getLogger("lockstep.rank.prefix_store")


class CacheDivergence(Exception):
    """The plan's cache decision cannot be applied here as rank 0 applied it."""


@dataclass
class Entry:
    cache: list  # this rank's per-layer caches (mlx-lm cache objects)
    tokens: list[int]  # the tokens the KV covers
    nbytes: int  # this rank's bytes for it


def cache_bytes(cache: list) -> int:
    return int(sum(c.nbytes for c in cache))


def prefix_copy(cache: list, n: int) -> list:
    """A fresh cache holding the first `n` tokens of `cache`, which is left untouched.
    Plain KV caches are sliced (no copy until the batch merges them); any other kind is
    deep-copied and trimmed, as mlx-lm's LRUPromptCache does."""
    if all(type(c) is KVCache for c in cache):
        out = []
        for c in cache:
            k = KVCache()
            if c.keys is not None and n > 0:
                k.keys = c.keys[..., :n, :]
                k.values = c.values[..., :n, :]
                k.offset = n
            out.append(k)
        return out
    out = copy.deepcopy(cache)
    size = max((c.size() for c in out), default=0)
    if size > n and trim_prompt_cache(out, size - n) != size - n:
        raise CacheDivergence(f"cannot trim a cache of {size} tokens to {n}")
    return out


class PromptStore:
    def __init__(self, max_entries: int, max_bytes: int, disk: DiskTier | None = None,
                 verified: dict[str, DiskEntry] | None = None) -> None:
        self.disk = disk  # None: no disk tier on this rank
        # this rank's disk entries as the plans left them (key → tokens): the start-up
        # scan's, then STORE(persist) adds, DROP and CLEAR remove
        self.disk_index: dict[str, list[int]] = {
            k: list(e.tokens) for k, e in (verified or {}).items()}
        self.disk_boot = dict(verified or {})  # rank 0's planner starts from it
        self.preloaded: dict[str, list] = {}  # rank 0: read and checked before its LOAD
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: dict[int, Entry] = {}
        self.nbytes = 0
        self.stored = 0
        self.evicted = 0
        # KV of requests the model finished at the last step, until the next plan says
        # which to keep (every rank finished the same ones; the rest are dropped then).
        self.finished: dict[str, tuple[list, list[int]]] = {}

    # -- plan application ------------------------------------------------------------

    def apply(self, ops: list[CacheOp]) -> None:
        for op in ops:
            if op.kind is CacheOpKind.STORE:
                self._store(op)
            elif op.kind is CacheOpKind.EVICT:
                e = self.entries.pop(op.entry_id, None)
                if e is None:
                    raise CacheDivergence(f"plan evicts cache entry {op.entry_id}, not held here")
                self.nbytes -= e.nbytes
                self.evicted += 1
            elif op.kind is CacheOpKind.LOAD:
                self._load(op)
            elif op.kind is CacheOpKind.DROP:
                self.disk_index.pop(op.key, None)  # a rank that never had it: nothing to do
                if self.disk is not None:
                    self.disk.drop(op.key)
            else:  # CLEAR
                self.evicted += len(self.entries)
                self.entries.clear()
                self.nbytes = 0
                self.disk_index.clear()
                self.preloaded.clear()
                if self.disk is not None:
                    self.disk.clear()
        self.finished.clear()
        self.preloaded.clear()  # one plan's: what it did not load is read again if needed
        if self.nbytes > self.max_bytes:
            raise CacheDivergence(f"prompt cache holds {self.nbytes} bytes on this rank, "
                                  f"over its budget of {self.max_bytes}")

    def _store(self, op: CacheOp) -> None:
        got = self.finished.pop(op.request_id, None)
        if got is None:
            raise CacheDivergence(f"plan stores {op.request_id!r}, which did not finish here")
        if op.entry_id in self.entries:
            raise CacheDivergence(f"plan stores cache entry {op.entry_id}, already held")
        cache, tokens = got
        if len(tokens) != op.n_tokens:
            raise CacheDivergence(f"plan stores {op.n_tokens} tokens of {op.request_id!r}; "
                                  f"this rank holds {len(tokens)}")
        nbytes = cache_bytes(cache)
        if nbytes > op.nbytes:
            # The budget is counted in rank 0's bytes, which must bound every rank's
            # (rank 0 holds the most layers under PP, equal heads under TP).
            raise CacheDivergence(f"cache entry {op.entry_id} takes {nbytes} bytes here, "
                                  f"rank 0 accounted {op.nbytes}")
        self.entries[op.entry_id] = Entry(cache, list(tokens), nbytes)
        self.nbytes += nbytes
        self.stored += 1
        if op.persist:
            if op.key != entry_key(tokens):
                raise CacheDivergence(f"plan persists cache entry {op.entry_id} as {op.key}; "
                                      "its tokens here have another key")
            self.disk_index[op.key] = list(tokens)
            if self.disk is not None:  # off here: rank 0 was told (DISK_INDEX off)
                self.disk.write(op.key, list(tokens), cache)

    def _load(self, op: CacheOp) -> None:
        tokens = self.disk_index.get(op.key)
        if tokens is None or len(tokens) != op.n_tokens:
            raise CacheDivergence(f"plan loads disk entry {op.key}, not held here")
        if op.entry_id in self.entries:
            raise CacheDivergence(f"plan loads cache entry {op.entry_id}, already held")
        cache = self.preloaded.pop(op.key, None)
        if cache is None:
            if self.disk is None:
                raise CacheDivergence(f"plan loads disk entry {op.key}; no disk tier here")
            try:
                cache = self.disk.load(op.key, op.n_tokens)
            except DiskEntryError as exc:
                self.disk_index.pop(op.key, None)
                raise CacheDivergence(f"disk entry {op.key}: {exc}") from exc
        nbytes = cache_bytes(cache)
        if nbytes > op.nbytes:
            raise CacheDivergence(f"disk entry {op.key} takes {nbytes} bytes here, "
                                  f"rank 0 accounted {op.nbytes}")
        self.entries[op.entry_id] = Entry(cache, list(tokens), nbytes)
        self.nbytes += nbytes

    def preload(self, key: str, n_tokens: int) -> int:
        """Rank 0, before planning a LOAD of `key`: read and check its own copy now, so a
        file gone bad is dropped (on every rank) instead of failing the plan. Its bytes
        in memory, or 0."""
        if self.disk is None or key not in self.disk_index:
            return 0
        try:
            cache = self.disk.load(key, n_tokens)
        except DiskEntryError as exc:
            log.warning("disk entry %s: %s; the prompt prefills instead", key, exc)
            return 0
        self.preloaded[key] = cache
        return cache_bytes(cache)

    def start_from(self, entry_id: int, n: int, prompt: list[int]) -> list:
        """The cache an insert starts from: entry `entry_id`'s first `n` tokens, which
        must equal the prompt's (n < len(prompt): the last prompt token is computed)."""
        e = self.entries.get(entry_id)
        if e is None:
            raise CacheDivergence(f"insert starts from cache entry {entry_id}, not held here")
        if not 0 < n < len(prompt) or n > len(e.tokens):
            raise CacheDivergence(f"insert keeps {n} tokens of entry {entry_id} "
                                  f"({len(e.tokens)} tokens) for a {len(prompt)}-token prompt")
        if e.tokens[:n] != list(prompt[:n]):
            raise CacheDivergence(f"cache entry {entry_id} does not start with the prompt")
        return prefix_copy(e.cache, n)

    # -- views -------------------------------------------------------------------------

    def index(self) -> list[list[int]]:
        return [[i, len(e.tokens)] for i, e in self.entries.items()]

    def disk_view(self) -> list[list]:
        return [[k, len(t)] for k, t in sorted(self.disk_index.items())]

    def stats(self) -> CacheStats:
        s = CacheStats(entries=len(self.entries),
                       tokens=sum(len(e.tokens) for e in self.entries.values()),
                       bytes=self.nbytes, stored=self.stored, evicted=self.evicted)
        if self.disk is not None:
            d = self.disk.stats()
            s.disk_entries, s.disk_bytes, s.disk_written = d.entries, d.bytes, d.written
            s.disk_write_errors, s.disk_rejected, s.disk_loaded = \
                d.write_errors, d.rejected, d.loaded
        return s


def cache_index_path(paths: Paths, deployment_id: str, rank: int) -> Path:
    return marker_dir(paths, deployment_id) / f"rank-{rank}.cache.jsonl"


def read_cache_index(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


class CacheIndexLog:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def append(self, seq: int, step: int, store: PromptStore) -> None:
        rec = {"seq": seq, "step": step, "entries": store.index(), "bytes": store.nbytes,
               "disk": store.disk_view(), "at": time.time()}
        os.write(self._fd, (json.dumps(rec) + "\n").encode())  # one O_APPEND write a line

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
