"""The closed set of message kinds and one typed body per kind.

Channels (DESIGN.md §2) and who may send what:
  admin     ADMIN_REQUEST → ADMIN_REPLY                  (cluster key)
  events    EVENT                                         (cluster key)
  requests  GENERATE, ABORT, STATS_REQUEST → TOKENS, STATS (launch key "requests")
  plan      PLAN_HELLO → PLAN_WELCOME, PLAN, PLAN_FETCH → PLAN_BATCH, PING → PONG
                                                          (launch key "plan")
  control   CANCEL, SERVE, SHUTDOWN, LEASE, CACHE_CLEAR  (launch key "control")
  report    RANK_READY, TELEMETRY, CANCEL_ACK, CACHE_CLEARED (launch key "report")
  auth      AUTH_HELLO → AUTH_CHALLENGE → AUTH_PROOF → AUTH_OK (session handshake on the
            plan and report sockets, signed with that socket's key; common/handshake.py)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

BIG_LIST = {"max_len": 262144}
TEXT = {"max_len": 65536}
BIAS_LIST = {"max_len": 1024}  # logit_bias entries per request
GRAMMAR = {"max_len": 262144}  # a serialized llguidance grammar (services/rank/grammar.py)


class Kind(str, enum.Enum):
    ADMIN_REQUEST = "admin_request"
    ADMIN_REPLY = "admin_reply"
    EVENT = "event"
    GENERATE = "generate"
    ABORT = "abort"
    TOKENS = "tokens"
    TOKENS_BATCH = "tokens_batch"
    STATS_REQUEST = "stats_request"
    STATS = "stats"
    PLAN_HELLO = "plan_hello"
    PLAN_WELCOME = "plan_welcome"
    PLAN = "plan"
    PLAN_FETCH = "plan_fetch"
    PLAN_BATCH = "plan_batch"
    PING = "ping"
    PONG = "pong"
    CANCEL = "cancel"
    SERVE = "serve"
    SHUTDOWN = "shutdown"
    LEASE = "lease"
    RANK_READY = "rank_ready"
    TELEMETRY = "telemetry"
    CANCEL_ACK = "cancel_ack"
    CACHE_CLEAR = "cache_clear"
    CACHE_CLEARED = "cache_cleared"
    AUTH_HELLO = "auth_hello"
    AUTH_CHALLENGE = "auth_challenge"
    AUTH_PROOF = "auth_proof"
    AUTH_OK = "auth_ok"


# --- admin / events (cluster key) -------------------------------------------------


@dataclass
class AdminRequest:
    request_id: str
    command: str
    args: dict[str, object] = field(default_factory=dict)


class AdminCode(str, enum.Enum):
    """How an admin command ended, typed: `ok`, or why not (the message is for people).
    A closed set: a value outside it fails the schema. The gateway maps each failure to
    an HTTP status in one table (services/gateway/errors.py ADMIN_STATUS)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    UNKNOWN_COMMAND = "unknown_command"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    ACTIVE_REQUESTS = "active_requests"
    LAUNCH_FAILED = "launch_failed"
    TEARDOWN_FAILED = "teardown_failed"
    REAP_BLOCKED = "reap_blocked"
    SIGNATURE_MISMATCH = "signature_mismatch"
    TIMEOUT = "timeout"  # the ranks did not confirm in time (e.g. a cache clear)
    INTERNAL = "internal"

    def __str__(self) -> str:  # the wire string, in logs, metric labels and f-strings
        return self.value


@dataclass
class AdminReply:
    request_id: str
    ok: bool
    code: AdminCode
    message: str = field(default="", metadata=TEXT)
    data: dict[str, object] = field(default_factory=dict)


@dataclass
class Event:
    topic: str
    name: str
    deployment_id: str
    state: str
    reason: str = field(default="", metadata=TEXT)
    at: float = 0.0
    data: dict[str, object] = field(default_factory=dict)


# --- requests (gateway/supervisor ↔ rank 0) --------------------------------------


@dataclass
class TokenBias:
    """OpenAI's `logit_bias` entry: `bias` added to token `token`'s logit every step."""

    token: int
    bias: float


@dataclass
class Generate:
    request_id: str
    prompt: list[int] = field(metadata=BIG_LIST)
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    client: str = ""
    # Sampling (services/rank/sampling.py); each default means "off", so an older sender
    # still decodes and means what it meant.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: list[TokenBias] = field(default_factory=list, metadata=BIAS_LIST)
    top_logprobs: int = -1  # per token: its logprob and this many alternatives; -1: none
    # Constrained decoding: a serialized llguidance grammar ("" : none), built and
    # checked by the gateway (services/gateway/structured.py), compiled on every rank.
    grammar: str = field(default="", metadata=GRAMMAR)


@dataclass
class Abort:
    request_id: str
    reason: str = "client"


class ErrorCode(str, enum.Enum):
    """Why rank 0 ended a request with an error, typed (the `error` text is for people).
    A closed set: a value outside it fails the schema. The gateway maps each member to
    an HTTP status and an OpenAI error code in one table (services/gateway/generation.py)."""

    INVALID_REQUEST = "invalid_request"  # a GENERATE rank 0 refused (ids, sampling params)
    PROMPT_TOO_LONG = "prompt_too_long"  # beyond the context, or the plan's byte bound
    DUPLICATE_REQUEST = "duplicate_request"  # that request_id is open, or still leaving
    NOT_SERVING = "not_serving"  # rank 0 is not (yet, or any more) serving
    OVERLOADED = "overloaded"  # rank 0 has max_open_requests open: retry later
    RANK_STOPPED = "rank_stopped"  # rank 0 left (shutdown, failure) with the stream open
    WATCHDOG_ABORT = "watchdog_abort"  # the abort stage ended the stream (finish abort)
    RANK_LOST = "rank_lost"  # the gateway lost its link to rank 0 (never sent by a rank)


@dataclass
class Tokens:
    """A chunk of one request's stream; the last one has finish_reason set."""

    request_id: str
    tokens: list[int]
    index: int  # position of tokens[0] in the completion
    finish_reason: str | None = None  # stop | length | abort | error
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
    phase: str
    step: int
    active: int
    active_ids: list[str]
    cancel_epoch: int


# --- plan (rank 0 ↔ followers) ----------------------------------------------------


@dataclass
class PlanInsert:
    request_id: str
    prompt: list[int] = field(metadata=BIG_LIST)
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: list[int] = field(default_factory=list)
    # Prefix cache (services/rank/prefix_cache.py): start from entry `cache_entry` (0:
    # none) trimmed to its first `cached_tokens` tokens, which equal the prompt's.
    cache_entry: int = 0
    cached_tokens: int = 0
    # Sampling, as in Generate (validated by rank 0; every rank applies the same).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: list[TokenBias] = field(default_factory=list, metadata=BIAS_LIST)
    top_logprobs: int = -1  # rank 0 alone reads it (followers send no tokens)
    grammar: str = field(default="", metadata=GRAMMAR)  # as in Generate; every rank masks alike


@dataclass
class PlanRemove:
    request_id: str
    reason: str


class CacheOpKind(str, enum.Enum):
    """What a plan does to every rank's prompt-cache store (applied in plan order)."""

    STORE = "store"  # keep the KV of `request_id`, which finished at the previous step
    EVICT = "evict"  # drop entry `entry_id`
    CLEAR = "clear"  # drop every entry


@dataclass
class LoadProgress:
    """A loading rank's progress (services/rank/load_progress.py): bytes this process
    has read since loading began (capped at the total) of its model's *.safetensors."""

    read_bytes: int = 0
    total_bytes: int = 0


@dataclass
class CacheOp:
    kind: CacheOpKind
    entry_id: int = 0
    request_id: str = ""
    n_tokens: int = 0  # STORE: the tokens the entry covers (prompt + generated, as fed)
    nbytes: int = 0  # STORE: rank 0's bytes for it, the budget's unit; a rank holding more fails
    live: bool = False  # STORE of a request still in the batch (its prompt, once prefilled)


@dataclass
class CacheStats:
    """One rank's prompt-cache store, in telemetry. The counters are cumulative; hits,
    misses and hit tokens are rank 0's decisions (zero on followers)."""

    entries: int = 0
    tokens: int = 0
    bytes: int = 0
    stored: int = 0
    evicted: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0


@dataclass
class PhaseTimes:
    """Where one rank's threads spent their time since it started, in telemetry
    (services/rank/phase_clock.py): wall seconds and runs per phase of its loop, by the
    phase's name, for the phases that ran."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    """Everything every rank applies before step `step` (advance=False: apply only):
    removes, then cache ops, then inserts."""

    seq: int
    step: int
    advance: bool
    inserts: list[PlanInsert] = field(default_factory=list)
    removes: list[PlanRemove] = field(default_factory=list)
    cancel_epoch: int = 0  # epoch folded into this plan, 0 if none
    shutdown: bool = False
    cache: list[CacheOp] = field(default_factory=list)
    prefill_step: int = 0  # prompt tokens per chunk from this step on (0: the settings')


@dataclass
class PlanHello:
    rank: int


@dataclass
class PlanWelcome:
    rank: int
    next_seq: int


@dataclass
class PlanFetch:
    from_seq: int


@dataclass
class PlanBatch:
    plans: list[Plan]
    missing: bool = False  # the replay buffer no longer holds from_seq


@dataclass
class Ping:
    nonce: int
    sent_at: float


@dataclass
class Pong:
    nonce: int
    rank: int
    step: int
    phase: str


# --- control (supervisor PUB → ranks) ----------------------------------------------


@dataclass
class Cancel:
    deployment_id: str
    epoch: int
    scope: str  # all | requests
    request_ids: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass
class Serve:
    deployment_id: str
    job_id: str


@dataclass
class Shutdown:
    deployment_id: str
    job_id: str
    reason: str = ""


@dataclass
class CacheClear:
    """Admin `cache_clear`: rank 0 folds a CLEAR op into its next plan (every rank empties
    its prefix cache at that step) and answers CACHE_CLEARED. Re-sent until answered;
    rank 0 applies each `clear_id` once and answers every copy."""

    deployment_id: str
    clear_id: int


@dataclass
class Lease:
    deployment_id: str
    job_id: str
    lease_seq: int
    ttl_s: float
    cancel_epoch: int


# --- report (ranks → supervisor) ---------------------------------------------------


@dataclass
class RankReady:
    deployment_id: str
    job_id: str
    rank: int
    host: str
    pid: int
    start_time: float
    boot_id: str
    endpoints: dict[str, str] = field(default_factory=dict)


@dataclass
class Telemetry:
    deployment_id: str
    job_id: str
    rank: int
    pid: int
    phase: str
    step: int
    active: int
    cancel_epoch: int
    mem_active: int = 0
    mem_peak: int = 0
    at: float = 0.0
    error: str | None = field(default=None, metadata=TEXT)
    rejects: dict[str, int] = field(default_factory=dict)  # "socket.reason" -> count
    cache: CacheStats | None = None  # the prompt-cache store (None: caching off)
    load: LoadProgress | None = None  # while loading: bytes read of the weights' total
    phases: PhaseTimes | None = None  # cumulative time per loop phase (None: an older rank)


@dataclass
class CancelAck:
    deployment_id: str
    epoch: int
    rank: int
    step_applied: int
    cancelled: list[str] = field(default_factory=list)


@dataclass
class CacheCleared:
    """Rank 0: the plan carrying clear `clear_id`'s CLEAR was published for step `step`."""

    deployment_id: str
    clear_id: int
    rank: int
    step: int


# --- session handshake ---------------------------------------------------------------


HANDSHAKE_BYTES = {"max_len": 64}  # nonces are 16 bytes, proofs 32 (common/handshake.py)


@dataclass
class AuthHello:
    deployment_id: str
    job_id: str
    rank: int
    nonce: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthChallenge:
    nonce: bytes = field(metadata=HANDSHAKE_BYTES)  # responder's nonce
    # responder proves K(rank, "down") over the transcript (both nonces, ids)
    proof: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthProof:
    # initiator proves K(rank, "up") over the transcript
    proof: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthOk:
    rank: int


BODY: dict[Kind, type] = {
    Kind.ADMIN_REQUEST: AdminRequest,
    Kind.ADMIN_REPLY: AdminReply,
    Kind.EVENT: Event,
    Kind.GENERATE: Generate,
    Kind.ABORT: Abort,
    Kind.TOKENS: Tokens,
    Kind.TOKENS_BATCH: TokensBatch,
    Kind.STATS_REQUEST: StatsRequest,
    Kind.STATS: Stats,
    Kind.PLAN_HELLO: PlanHello,
    Kind.PLAN_WELCOME: PlanWelcome,
    Kind.PLAN: Plan,
    Kind.PLAN_FETCH: PlanFetch,
    Kind.PLAN_BATCH: PlanBatch,
    Kind.PING: Ping,
    Kind.PONG: Pong,
    Kind.CANCEL: Cancel,
    Kind.SERVE: Serve,
    Kind.SHUTDOWN: Shutdown,
    Kind.LEASE: Lease,
    Kind.RANK_READY: RankReady,
    Kind.TELEMETRY: Telemetry,
    Kind.CANCEL_ACK: CancelAck,
    Kind.CACHE_CLEAR: CacheClear,
    Kind.CACHE_CLEARED: CacheCleared,
    Kind.AUTH_HELLO: AuthHello,
    Kind.AUTH_CHALLENGE: AuthChallenge,
    Kind.AUTH_PROOF: AuthProof,
    Kind.AUTH_OK: AuthOk,
}
KIND_OF: dict[type, Kind] = {cls: kind for kind, cls in BODY.items()}
assert set(BODY) == set(Kind), "every kind needs exactly one schema"

# Which kinds each channel accepts (a receiver rejects anything else as unexpected_kind).
ADMIN_IN = frozenset({Kind.ADMIN_REQUEST})
ADMIN_OUT = frozenset({Kind.ADMIN_REPLY})
EVENTS = frozenset({Kind.EVENT})
REQUESTS_IN = frozenset({Kind.GENERATE, Kind.ABORT, Kind.STATS_REQUEST})
REQUESTS_OUT = frozenset({Kind.TOKENS, Kind.TOKENS_BATCH, Kind.STATS})
# Session handshake (common/handshake.py) on the plan and report sockets.
AUTH_TO_RESPONDER = frozenset({Kind.AUTH_HELLO, Kind.AUTH_PROOF})
AUTH_TO_INITIATOR = frozenset({Kind.AUTH_CHALLENGE, Kind.AUTH_OK})
PLAN_TO_FOLLOWER = frozenset({Kind.PLAN_WELCOME, Kind.PLAN, Kind.PLAN_BATCH, Kind.PING}) \
    | AUTH_TO_INITIATOR
PLAN_TO_LEADER = frozenset({Kind.PLAN_HELLO, Kind.PLAN_FETCH, Kind.PONG}) | AUTH_TO_RESPONDER
CONTROL = frozenset({Kind.CANCEL, Kind.SERVE, Kind.SHUTDOWN, Kind.LEASE, Kind.CACHE_CLEAR})
REPORT = frozenset({Kind.RANK_READY, Kind.TELEMETRY, Kind.CANCEL_ACK, Kind.CACHE_CLEARED}) \
    | AUTH_TO_RESPONDER
REPORT_TO_RANK = AUTH_TO_INITIATOR  # the supervisor only ever answers the handshake
