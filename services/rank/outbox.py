"""What the other threads hand the I/O thread (`RankIO.post`): a closed set of typed
commands, the mirror of `events.py` (what the I/O thread hands the main thread).

The main thread sends a stream's chunks by request id only (`StreamChunk`): which
connection a stream belongs to, how many tokens its client has received and whether it
is still open is the I/O thread's stream ledger's (services/rank/streams.py), the one
owner of rank 0's open streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from common.messages import (
    CacheCleared,
    CacheOp,
    CancelAck,
    ErrorCode,
    FinishReason,
    Ping,
    Plan,
    RankReady,
    RemoveReason,
)


@dataclass(frozen=True)
class PublishPlan:  # rank 0: to every joined follower, and kept for replay
    plan: Plan


@dataclass(frozen=True)
class StreamChunk:  # rank 0: a request's next chunk; the ledger adds index and connection
    request_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # the last chunk's
    step: int = 0
    model_ttft_ms: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None  # for people
    error_code: ErrorCode | None = None  # for the receiver to act on
    cached_tokens: int = 0  # prompt tokens the prefix cache served (the first chunk)
    # Only for a request that asked (top_logprobs >= 0): aligned with `tokens`.
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    waiting: bool = False  # a heartbeat of a request still without output (Tokens.waiting)


@dataclass(frozen=True)
class CacheOpsTaken:  # rank 0: a published plan's cache ops, for the cache index events
    ops: list[CacheOp]
    tokens: Mapping[int, np.ndarray]  # each STORE's tokens (the planner's arrays)


@dataclass(frozen=True)
class Report:  # to the supervisor on the report socket
    body: CancelAck | CacheCleared


@dataclass(frozen=True)
class AnnounceReady:  # RANK_READY now, then re-sent until SERVE
    msg: RankReady


@dataclass(frozen=True)
class Served:  # SERVE seen (or a plan, which implies it): stop re-sending RANK_READY
    pass


@dataclass(frozen=True)
class Probe:  # rank 0's peer watchdog: one PING to every joined follower
    ping: Ping


@dataclass(frozen=True)
class AbortAll:
    """The abort stage (any thread): every open stream ends now with `abort` (`detail`
    as its error text); the main thread then removes every request (`reason`)."""

    reason: RemoveReason
    detail: str | None


@dataclass(frozen=True)
class Stop:  # flush, end every stream still open (`rank 0 <why>`), close every socket
    why: str = "stopped"


Command = PublishPlan | StreamChunk | CacheOpsTaken | Report | AnnounceReady | Served | Probe | AbortAll | Stop
