"""The precise prefix index: per deployment, what rank 0's prefix cache holds, kept from
rank 0's own cache events (common/messages/cache_events.py, services/rank/cache_feed.py).
route_index.py is the approximate one; both answer `longest_prefix` alike (the longest
shared prefix with any entry, capped at len(ids) - 1 as rank 0's match is), so the router
(router.py) reads either.

`follow(client)` subscribes on the deployment's request channel: the pushes carry
request id STREAM_ID, so the channel's client routes them here like a stream's chunks,
and each is applied as it is read (no task, no queue). It re-subscribes every
KEEPALIVE_S, saying what it holds: rank 0 answers only if that is not current (a missed
push, a late connection, rank 0 restarted), with a snapshot. A gap in the sequence, an
unknown base or another origin asks at once (at most every RETRY_S while one is due).

Entries are known up to ENTRY_TOKENS tokens each (the cap the events carry): a prompt
sharing more with an entry is counted as sharing ENTRY_TOKENS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.messages import (
    CacheEntry,
    CacheEventKind,
    CacheEvents,
    CacheSnapshot,
    CacheSubscribe,
)
from common.messages.cache_events import STREAM_ID
from common.rpc_client import AsyncRpcClient

log = logging.getLogger("lockstep.gateway.cache_index")
KEEPALIVE_S = 5.0  # re-subscribe: catches a push lost to a full pipe, or a new rank 0
RETRY_S = 0.5  # a resync asked and not answered yet: asked again after this
STORED_KEPT = 256  # request id → when its entry's event arrived (the delay's evidence)


@dataclass
class Held:
    tokens: np.ndarray  # the first ENTRY_TOKENS
    n_tokens: int


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PreciseIndex:
    def __init__(self) -> None:
        self.origin = ""  # rank 0's process whose events these are ("": none yet)
        self.seq = 0  # the last event applied
        self.synced = False  # False: events are dropped until a snapshot arrives
        self.entries: dict[int, Held] = {}
        self.applied = self.gaps = self.resyncs = self.stale = 0
        self.stored_at: OrderedDict[str, float] = OrderedDict()  # monotonic, newest last
        self._parts: list[CacheEntry] = []
        self._part_of: tuple[str, int, int] | None = None  # (origin, seq, next part)

    def longest_prefix(self, ids: Sequence[int]) -> int:
        if len(ids) < 2 or not self.entries:
            return 0
        p = np.asarray(ids, dtype=np.int64)
        return min(max(shared_prefix(p, e.tokens) for e in self.entries.values()), len(p) - 1)

    def view(self) -> dict[int, int]:
        """entry id → tokens it covers: rank 0's own record's form (prefix_store.py)."""
        return {eid: e.n_tokens for eid, e in self.entries.items()}

    def summary(self) -> dict:
        """admin status: entries as rank 0's record lists them ([[id, n_tokens], ...])."""
        return {"synced": self.synced, "seq": self.seq,
                "entries": [[eid, e.n_tokens] for eid, e in sorted(self.entries.items())],
                "applied": self.applied, "gaps": self.gaps, "resyncs": self.resyncs}

    # -- what rank 0 sends --------------------------------------------------------------

    def apply(self, body: object) -> bool:
        """Apply one push; False: out of step with rank 0, a snapshot is needed."""
        if isinstance(body, CacheSnapshot):
            return self._snapshot(body)
        if not isinstance(body, CacheEvents):
            return True
        if not self.synced:
            self.stale += len(body.events)
            return False
        if body.origin != self.origin:
            self.gaps += 1
            self.synced = False
            return False
        for ev in body.events:
            if ev.seq <= self.seq:
                self.stale += 1
                continue
            if ev.seq != self.seq + 1 or not self._event(ev):
                self.gaps += 1
                self.synced = False
                return False
            self.seq = ev.seq
            self.applied += 1
        return True

    def _event(self, ev) -> bool:
        if ev.kind is CacheEventKind.ADDED:
            self.entries[ev.entry_id] = Held(np.asarray(ev.tokens, dtype=np.int64), ev.n_tokens)
        elif ev.kind is CacheEventKind.EXTENDED:
            base = self.entries.pop(ev.base_id, None)
            if base is None:
                return False
            tokens = np.concatenate([base.tokens, np.asarray(ev.tokens, dtype=np.int64)])
            self.entries[ev.entry_id] = Held(tokens, ev.n_tokens)
        elif ev.kind is CacheEventKind.EVICTED:
            self.entries.pop(ev.entry_id, None)
        else:
            self.entries.clear()
        if ev.request_id:
            self.stored_at[ev.request_id] = time.monotonic()
            while len(self.stored_at) > STORED_KEPT:
                self.stored_at.popitem(last=False)
        return True

    def _snapshot(self, s: CacheSnapshot) -> bool:
        if s.part == 0:
            self._parts, self._part_of = [], (s.origin, s.seq, 0)
        if self._part_of != (s.origin, s.seq, s.part):
            return True  # a part of an interrupted snapshot: the next one comes whole
        self._parts.extend(s.entries)
        self._part_of = (s.origin, s.seq, s.part + 1)
        if s.last:
            self.entries = {e.entry_id: Held(np.asarray(e.tokens, dtype=np.int64), e.n_tokens)
                            for e in self._parts}
            self.origin, self.seq, self.synced = s.origin, s.seq, True
            self.resyncs += 1
            self._parts, self._part_of = [], None
        return True


class _Follower:
    """Feeds `index` from the pushes `client` routes to STREAM_ID, and subscribes."""

    def __init__(self, client: AsyncRpcClient, index: PreciseIndex, keepalive_s: float) -> None:
        self.client, self.index, self.keepalive_s = client, index, keepalive_s
        self.loop = asyncio.get_running_loop()
        self.asked_at = -1e9
        self._retry: asyncio.TimerHandle | None = None  # a resync asked for, not sent yet
        self._tasks: set[asyncio.Task] = set()
        client.open_stream(STREAM_ID, self)  # type: ignore[arg-type] - put_nowait is all it needs
        self.loop.call_soon(self._tick)

    def put_nowait(self, item) -> None:
        """The client's stream hand-over: one push, applied now."""
        if not self.index.apply(getattr(item, "body", item)) and self._retry is None:
            wait = self.asked_at + RETRY_S - time.monotonic()  # a snapshot may be on its way
            self._retry = self.loop.call_later(max(0.0, wait), self._resync)

    def _resync(self) -> None:
        self._retry = None
        if not self.index.synced and not self.client.closed:
            self._ask()

    def _tick(self) -> None:
        if self.client.closed:
            return
        self._ask()
        self.loop.call_later(self.keepalive_s, self._tick)

    def _ask(self) -> None:
        self.asked_at = time.monotonic()
        i = self.index
        body = CacheSubscribe(STREAM_ID, i.origin if i.synced else "", i.seq)
        t = self.loop.create_task(self._send(body))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _send(self, body: CacheSubscribe) -> None:
        try:
            await asyncio.wait_for(self.client.send(body), self.keepalive_s)
        except Exception as exc:  # noqa: BLE001 - closed, or rank 0 away: the next tick asks
            log.debug("cache subscribe to %s not sent: %s", self.client.endpoint, exc)


def follow(client: AsyncRpcClient, keepalive_s: float = KEEPALIVE_S) -> PreciseIndex:
    """A PreciseIndex kept current from the rank 0 at the other end of `client` (called in
    the event loop, where the client lives)."""
    index = PreciseIndex()
    _Follower(client, index, keepalive_s)
    return index


def metric_families(backends: Iterable) -> list:
    """/metrics (metrics.py): each deployment's precise index, as the gateway holds it."""
    fams = {n: CounterMetricFamily(f"lockstep_gateway_cache_index_{n}", h, labels=["deployment"])
            for n, h in (("events_applied", "Rank 0 cache events applied to the precise index"),
                         ("gaps", "Cache event sequence gaps (or origin changes) seen"),
                         ("resyncs", "Cache index snapshots applied (the first one included)"),
                         ("stale", "Cache events dropped: already applied, or while resyncing"))}
    gauges = {n: GaugeMetricFamily(f"lockstep_gateway_cache_index_{n}", h, labels=["deployment"])
              for n, h in (("entries", "Entries rank 0's prefix cache holds, per its events"),
                           ("tokens", "Tokens those entries cover"),
                           ("seq", "The last cache event applied"))}
    for b in backends:
        i = getattr(b, "cache_index", None)
        if not isinstance(i, PreciseIndex):
            continue
        labels = [b.deployment_id]
        for name, v in (("events_applied", i.applied), ("gaps", i.gaps),
                        ("resyncs", i.resyncs), ("stale", i.stale)):
            fams[name].add_metric(labels, v)
        gauges["entries"].add_metric(labels, len(i.entries))
        gauges["tokens"].add_metric(labels, sum(e.n_tokens for e in i.entries.values()))
        gauges["seq"].add_metric(labels, i.seq)
    return [*fams.values(), *gauges.values()]
