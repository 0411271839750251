"""Requests channel (launch key "requests"), gateway/supervisor ↔ rank 0:
GENERATE, ABORT, STATS_REQUEST in; TOKENS (or TOKENS_BATCH, several streams' chunks
for one requester) and STATS out. A stream that ends in error says why in a typed
ErrorCode; its `error` text is for people.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.messages.base import BIG_LIST, TEXT
from common.messages.sampling import Sampling
from common.messages.vocab import FinishReason, Phase


@dataclass
class Generate:
    request_id: str
    prompt: list[int] = field(metadata=BIG_LIST)
    max_tokens: int
    # How tokens are chosen (common/messages/sampling.py), seed included: the sender
    # decides it. The default is greedy with everything off.
    sampling: Sampling = field(default_factory=Sampling)
    stop_token_ids: list[int] = field(default_factory=list)
    client: str = ""
    top_logprobs: int = -1  # per token: its logprob and this many alternatives; -1: none
    # A continuation (the gateway resumes a request whose deployment failed): the last
    # `resumed` prompt tokens are the request's own output so far. Its sampling keys go
    # on from token `resumed`, penalties count those tokens as output, and the grammar is
    # advanced over them on every rank (services/rank/sampling.py).
    resumed: int = 0
    # Scheduling (rank 0 alone reads it): lower runs first, as vLLM's extension; rank 0's
    # queue orders by it, then arrival, and a waiting request may preempt a running one
    # of a larger value (services/rank/leader.py). In common/request_params.py's range.
    priority: int = 0
    # Fair share (rank 0 alone reads it): the API key's name the request runs for ("":
    # an open gateway), never the key, and its weight; within a priority rank 0 serves
    # tenants in turn by weight (services/rank/wait_queue.py).
    tenant: str = ""
    tenant_weight: int = 1


@dataclass
class Abort:
    request_id: str
    reason: str = "client"


class ErrorCode(str, enum.Enum):
    """Why rank 0 ended a request with an error, typed (the `error` text is for people).
    A closed set: a value outside it fails the schema. The gateway maps each member to
    an HTTP status and an OpenAI error code in one table (services/gateway/core/generation.py)."""

    INVALID_REQUEST = "invalid_request"  # a GENERATE rank 0 refused (ids, sampling params)
    PROMPT_TOO_LONG = "prompt_too_long"  # beyond the context, or the plan's byte bound
    KV_BUDGET = "kv_budget"  # its KV alone is more than the deployment's KV budget
    DUPLICATE_REQUEST = "duplicate_request"  # that request_id is open, or still leaving
    NOT_SERVING = "not_serving"  # rank 0 is not (yet, or any more) serving
    OVERLOADED = "overloaded"  # rank 0 has max_open_requests open: retry later
    RANK_STOPPED = "rank_stopped"  # rank 0 left (shutdown, failure) with the stream open
    WATCHDOG_ABORT = "watchdog_abort"  # the abort stage ended the stream (finish abort)
    RANK_LOST = "rank_lost"  # the gateway lost its link to rank 0 (never sent by a rank)
    # the supervisor reported the deployment failed (gateway-side too, never from a rank)
    DEPLOYMENT_FAILED = "deployment_failed"


@dataclass
class Tokens:
    """A chunk of one request's stream; the last one has finish_reason set (and only it)."""

    request_id: str
    tokens: list[int]
    index: int  # position of tokens[0] in the completion
    finish_reason: FinishReason | None = None
    error: str | None = field(default=None, metadata=TEXT)
    prompt_tokens: int = 0
    model_ttft_ms: float | None = None
    step: int = 0
    token_times: list[float] = field(default_factory=list)  # wall clock per token
    error_code: ErrorCode | None = None  # why, for the receiver to act on
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first chunk)
    # Asked for (Generate.top_logprobs >= 0): one entry per token, aligned with `tokens`:
    # its logprob, and the top alternatives' ids and logprobs, best first.
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # No tokens, not final: rank 0 still holds the request without output (waiting in its
    # queue, preempted, prefilling), re-sent every WAITING_HEARTBEAT_S: the gateway's read
    # timeout is for a model that stopped, not a queue that is long.
    waiting: bool = False


@dataclass
class TokensBatch:
    """Several streams' chunks for one requester, in one signed message: rank 0 sends
    one per requester per step instead of one per request. Chunks keep their order."""

    chunks: list[Tokens] = field(metadata={"max_len": 1024})


@dataclass
class StatsRequest:
    request_id: str


@dataclass
class Stats:
    request_id: str
    phase: Phase
    step: int
    active: int
    active_ids: list[str]
    cancel_epoch: int
    # False while rank 0's peer watchdog is in its abort stage (a peer not answering);
    # True again once it answers: then what the abort ended may resume on this rank 0
    peers_ok: bool = True
