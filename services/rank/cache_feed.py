"""Rank 0's I/O thread: who gets the cache index events, and how.

A gateway connection subscribes with CACHE_SUBSCRIBE on the requests socket, saying
what it holds; it gets a snapshot unless it is current, then every plan's events as
they are taken (pushed right behind that drain's token chunks: a conversation's last
turn is in the index as soon as its final chunk is out). Nothing is queued here: an
event that cannot be sent now (the peer's pipe full) is not retried — the subscriber
sees the gap, or its next CACHE_SUBSCRIBE (every few seconds) shows it behind, and a
snapshot brings it current. A peer gone (EHOSTUNREACH) is dropped; at most
MAX_SUBSCRIBERS are kept, the least recently subscribed dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np
import zmq

from common.messages import CacheOp, CacheSubscribe
from services.rank.cache_events import CacheEventLog

MAX_SUBSCRIBERS = 16  # gateways (and tools) per rank 0; each re-subscribes periodically


class CacheFeed:
    def __init__(self, pack: Callable[[object], bytes],
                 send: Callable[[bytes, bytes], int], log: CacheEventLog | None = None) -> None:
        self.log = log or CacheEventLog()
        self._pack = pack  # body → signed bytes
        self._send = send  # (ident, bytes) → 0, or the errno
        self.subscribers: OrderedDict[bytes, None] = OrderedDict()
        self.snapshots = self.unsent = 0

    def on_subscribe(self, ident: bytes, body: CacheSubscribe) -> None:
        self.subscribers[ident] = None
        self.subscribers.move_to_end(ident)
        while len(self.subscribers) > MAX_SUBSCRIBERS:
            self.subscribers.popitem(last=False)
        if body.origin == self.log.origin and body.seq == self.log.seq:
            return  # current: a keep-alive
        self.snapshots += 1
        for part in self.log.snapshot():
            if self._deliver(ident, self._pack(part)):
                return

    def on_ops(self, ops: list[CacheOp], tokens: Mapping[int, np.ndarray]) -> None:
        events = self.log.on_ops(ops, tokens)
        if not events or not self.subscribers:
            return
        for msg in self.log.messages(events):
            data = self._pack(msg)  # signed once, the same bytes to every subscriber
            for ident in list(self.subscribers):
                self._deliver(ident, data)

    def _deliver(self, ident: bytes, data: bytes) -> bool:
        """Send; True if `ident` is gone (dropped) or full (it will resync)."""
        errno = self._send(ident, data)
        if errno == zmq.EHOSTUNREACH:
            self.subscribers.pop(ident, None)
        elif errno:
            self.unsent += 1
        return bool(errno)
