"""Rank 0's prefix-cache index, pushed to gateways on the requests channel (launch key
"requests"): CACHE_SUBSCRIBE in; CACHE_EVENTS and CACHE_SNAPSHOT out.

A gateway connection subscribes (and re-subscribes every few seconds, which also says
what it holds); rank 0 answers a subscriber that is not current with a snapshot, then
pushes every change of its index as typed events, numbered by one sequence per rank 0
process (`origin`): a receiver that sees a gap, or another origin, asks again.

Sizes: an event carries at most ENTRY_TOKENS tokens of an entry (the entry's first ones;
`n_tokens` is its true length), so a receiver knows every entry's first ENTRY_TOKENS
tokens exactly and no more. One message carries at most MESSAGE_TOKENS tokens and
MESSAGE_EVENTS events (or snapshot entries): ~5 bytes a token id, well under the
envelope's 4 MiB cap. A snapshot bigger than that is sent in parts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ENTRY_TOKENS = 65536  # tokens of one entry a gateway indexes (routing needs no more)
MESSAGE_TOKENS = 131072  # tokens per CACHE_EVENTS / CACHE_SNAPSHOT message at most
MESSAGE_EVENTS = 512  # events (or snapshot entries) per message at most
STREAM_ID = "cache-index"  # the request id every push carries (the gateway routes by it)

_TOKENS = {"max_len": ENTRY_TOKENS}
_ITEMS = {"max_len": MESSAGE_EVENTS}


class CacheEventKind(str, enum.Enum):
    ADDED = "added"  # entry_id holds `tokens`
    EXTENDED = "extended"  # entry_id holds base_id's tokens + `tokens`; base_id is gone
    EVICTED = "evicted"  # entry_id is gone
    CLEARED = "cleared"  # every entry is gone


@dataclass
class CacheEvent:
    seq: int  # this origin's sequence: one more than the event before
    kind: CacheEventKind
    entry_id: int = 0
    base_id: int = 0  # EXTENDED: the entry it supersedes
    tokens: list[int] = field(default_factory=list, metadata=_TOKENS)  # ADDED: the first
    # ENTRY_TOKENS; EXTENDED: the suffix, as far as it stays within ENTRY_TOKENS
    n_tokens: int = 0  # ADDED, EXTENDED: the tokens the entry covers (all of them)
    request_id: str = ""  # ADDED, EXTENDED: the request whose KV it is


@dataclass
class CacheSubscribe:
    """Push me the index. `origin`, `seq`: what the sender holds (\"\": nothing); rank 0
    sends a snapshot unless that is its origin and last sequence."""

    request_id: str = STREAM_ID
    origin: str = ""
    seq: int = 0


@dataclass
class CacheEvents:
    request_id: str
    origin: str  # rank 0's process: its sequence and entry ids start afresh with it
    events: list[CacheEvent] = field(metadata=_ITEMS)


@dataclass
class CacheEntry:
    entry_id: int
    tokens: list[int] = field(metadata=_TOKENS)  # the first ENTRY_TOKENS
    n_tokens: int = 0


@dataclass
class CacheSnapshot:
    """The whole index after event `seq` (parts 0..last, sent back to back)."""

    request_id: str
    origin: str
    seq: int
    part: int
    last: bool
    entries: list[CacheEntry] = field(metadata=_ITEMS)
