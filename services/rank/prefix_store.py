"""Every rank's prompt-cache store: its own part of each entry's KV, changed only by plans.

An entry is the KV one finished request left behind (its prompt and the generated tokens
that were fed back), on this rank: its heads under TP, its layers under PP. Rank 0
decides everything (services/rank/prefix_cache.py) and the plan carries it: `CacheOp`s
store, evict and clear; an insert names the entry it starts from and how many of its
tokens to keep. This module only applies those decisions and checks them: an entry the
plan names but this rank does not hold, tokens that differ from the prompt, or more bytes
than rank 0 accounted for are a `Divergence` — the rank fails closed instead of
computing from a KV its peers do not have.

`rank-<r>.cache.jsonl` (next to the removal record) gets one line per plan that changed
the store, `{"seq", "step", "entries": [[id, n_tokens], ...], "bytes", "at"}`, so tests
and incident forensics can check that every rank's index equals rank 0's after every
plan (bytes differ per rank under PP; ids and token counts never do).
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import KVCache, trim_prompt_cache

from common.home import Paths, marker_dir
from common.messages import CacheOp, CacheOpKind, CacheStats


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
    def __init__(self, max_entries: int, max_bytes: int) -> None:
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
            else:  # CLEAR
                self.evicted += len(self.entries)
                self.entries.clear()
                self.nbytes = 0
        self.finished.clear()
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

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self.entries),
                          tokens=sum(len(e.tokens) for e in self.entries.values()),
                          bytes=self.nbytes, stored=self.stored, evicted=self.evicted)


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
               "at": time.time()}
        os.write(self._fd, (json.dumps(rec) + "\n").encode())  # one O_APPEND write a line

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
