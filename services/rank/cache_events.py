"""Rank 0's prefix-cache index as typed events (common/messages/cache_events.py).

Fed with the cache ops of each plan as rank 0 publishes it (and the tokens of its
STOREs, which the plan does not carry), so an event describes what every rank holds once
that plan is applied — not the planner's own view, which runs ahead of the plans between
a finish and the next plan. It keeps the index those ops leave (entry id → tokens: the
planner's own arrays, shared, never copied) to tell an extension from an addition and to
answer a snapshot.

A STORE whose tokens extend an entry the same plan evicts becomes one EXTENDED (that
entry's id and the new suffix only: a conversation's next turn costs its new tokens, not
the whole history) instead of EVICTED + ADDED; the longest such entry is the base.
Sequence numbers run on per rank 0 process (`origin`), one per event, none skipped.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping

import numpy as np

from common.messages import CacheOp, CacheOpKind
from common.messages.cache_events import (
    ENTRY_TOKENS,
    MESSAGE_EVENTS,
    MESSAGE_TOKENS,
    STREAM_ID,
    CacheEntry,
    CacheEvent,
    CacheEventKind,
    CacheEvents,
    CacheSnapshot,
)

EMPTY = np.zeros(0, dtype=np.int64)


def _is_prefix(base: np.ndarray, t: np.ndarray) -> bool:
    return 0 < len(base) < len(t) and bool(np.array_equal(t[:len(base)], base))


class CacheEventLog:
    def __init__(self, origin: str | None = None) -> None:
        self.origin = origin or secrets.token_hex(8)
        self.seq = 0  # the last event's (0: none yet)
        self.entries: dict[int, np.ndarray] = {}

    def on_ops(self, ops: list[CacheOp], tokens: Mapping[int, np.ndarray]) -> list[CacheEvent]:
        """The events of one plan's cache ops, numbered; the index updated."""
        out: list[CacheEvent | None] = []
        gone: dict[int, tuple[np.ndarray, int]] = {}  # evicted by these ops: tokens, event slot
        for op in ops:
            if op.kind is CacheOpKind.DROP:
                continue  # the disk tier's: memory (what routing sees) is unchanged
            if op.kind is CacheOpKind.STORE or op.kind is CacheOpKind.LOAD:
                t = np.asarray(tokens[op.entry_id], dtype=np.int64)
                base = max((eid for eid, (b, _) in gone.items() if _is_prefix(b, t)),
                           key=lambda eid: len(gone[eid][0]), default=0)
                if base:
                    b, slot = gone.pop(base)
                    out[slot] = None  # the EXTENDED says it is gone
                    out.append(CacheEvent(0, CacheEventKind.EXTENDED, op.entry_id, base,
                                          t[len(b):ENTRY_TOKENS].tolist(), len(t),
                                          op.request_id))
                else:
                    out.append(CacheEvent(0, CacheEventKind.ADDED, op.entry_id, 0,
                                          t[:ENTRY_TOKENS].tolist(), len(t), op.request_id))
                self.entries[op.entry_id] = t
            elif op.kind is CacheOpKind.EVICT:
                gone[op.entry_id] = (self.entries.pop(op.entry_id, EMPTY), len(out))
                out.append(CacheEvent(0, CacheEventKind.EVICTED, op.entry_id))
            else:  # CLEAR: nothing before it can be a base any more
                gone.clear()
                self.entries.clear()
                out.append(CacheEvent(0, CacheEventKind.CLEARED))
        events = [e for e in out if e is not None]
        for e in events:
            self.seq += 1
            e.seq = self.seq
        return events

    def messages(self, events: list[CacheEvent]) -> Iterator[CacheEvents]:
        """`events` in messages within the size caps, in order."""
        for part in _parts(events, lambda e: len(e.tokens)):
            yield CacheEvents(STREAM_ID, self.origin, part)

    def snapshot(self) -> list[CacheSnapshot]:
        """The index after event `seq`, in parts within the size caps (at least one)."""
        entries = [CacheEntry(eid, t[:ENTRY_TOKENS].tolist(), len(t))
                   for eid, t in self.entries.items()]
        parts = list(_parts(entries, lambda e: len(e.tokens))) or [[]]
        return [CacheSnapshot(STREAM_ID, self.origin, self.seq, i, i == len(parts) - 1, p)
                for i, p in enumerate(parts)]


def _parts(items: list, size) -> Iterator[list]:
    part: list = []
    n = 0
    for it in items:
        k = size(it)
        if part and (n + k > MESSAGE_TOKENS or len(part) >= MESSAGE_EVENTS):
            yield part
            part, n = [], 0
        part.append(it)
        n += k
    if part:
        yield part
