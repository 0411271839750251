"""The closed set of message kinds and one typed body per kind.

Channels (DESIGN.md §2) and who may send what, one module each:
  admin     ADMIN_REQUEST → ADMIN_REPLY                  (cluster key)        admin.py
  events    EVENT                                         (cluster key)        admin.py
  requests  GENERATE, ABORT, STATS_REQUEST → TOKENS, STATS (launch key "requests")
                                                                               requests.py
            (GENERATE's Sampling record, shared with PLAN's inserts: sampling.py)
            CACHE_SUBSCRIBE → CACHE_SNAPSHOT, CACHE_EVENTS (pushed)  cache_events.py
  plan      PLAN_HELLO → PLAN_WELCOME, PLAN, PLAN_FETCH → PLAN_BATCH, PING → PONG,
            DISK_INDEX (followers' disk tier, acknowledged in PING)
                                                          (launch key "plan")  plan.py
  control   CANCEL, SERVE, SHUTDOWN, LEASE, CACHE_CLEAR  (launch key "control") control.py
  report    RANK_READY, TELEMETRY, CANCEL_ACK, CACHE_CLEARED (launch key "report")
                                                                               report.py
  auth      AUTH_HELLO → AUTH_CHALLENGE → AUTH_PROOF → AUTH_OK (session handshake on the
            plan and report sockets, signed with that socket's key; common/handshake.py)
                                                                               auth.py
`Kind`, the kinds each channel accepts and the shared size caps are in base.py; the
states and names that cross processes (Phase, DeploymentState, FinishReason, CancelScope,
Backend, ProcState, EventTopic, EventName, ReapOutcome) are vocab.py's str enums. Every
public name is re-exported here: `from common.messages import X` is the way in.
`BODY` maps each kind to its one body class (common/envelope.py decodes by it).
"""

from __future__ import annotations

from common.messages.admin import AdminCode, AdminReply, AdminRequest, Event
from common.messages.auth import HANDSHAKE_BYTES, AuthChallenge, AuthHello, AuthOk, AuthProof
from common.messages.base import (
    ADMIN_IN,
    ADMIN_OUT,
    AUTH_TO_INITIATOR,
    AUTH_TO_RESPONDER,
    BIAS_LIST,
    BIG_LIST,
    CONTROL,
    EVENTS,
    GRAMMAR,
    PLAN_TO_FOLLOWER,
    PLAN_TO_LEADER,
    REPORT,
    REPORT_TO_RANK,
    REQUESTS_IN,
    REQUESTS_OUT,
    TEXT,
    Kind,
)
from common.messages.cache_events import (
    CacheEntry,
    CacheEvent,
    CacheEventKind,
    CacheEvents,
    CacheSnapshot,
    CacheSubscribe,
)
from common.messages.control import CacheClear, Cancel, Lease, Serve, Shutdown
from common.messages.plan import (
    CacheOp,
    CacheOpKind,
    DiskIndex,
    Ping,
    Plan,
    PlanBatch,
    PlanFetch,
    PlanHello,
    PlanInsert,
    PlanRemove,
    PlanWelcome,
    Pong,
)
from common.messages.report import (
    CacheCleared,
    CacheStats,
    CancelAck,
    KvStats,
    LoadProgress,
    PhaseTimes,
    RankReady,
    SpecStats,
    Telemetry,
)
from common.messages.requests import (
    Abort,
    ErrorCode,
    Generate,
    Stats,
    StatsRequest,
    Tokens,
    TokensBatch,
)
from common.messages.sampling import Sampling, SeededSampling, TokenBias
from common.messages.vocab import (
    DEAD_PHASES,
    FAILED_STATES,
    TORN_DOWN,
    Backend,
    CancelScope,
    DeploymentState,
    Determinism,
    EventName,
    EventTopic,
    FinishReason,
    Phase,
    ProcState,
    ReapOutcome,
    RemoveReason,
    Speculation,
)

__all__ = [
    "Determinism",
    "RemoveReason",
    "ReapOutcome",
    "ProcState",
    "Phase",
    "Speculation",
    "EventTopic",
    "EventName",
    "FinishReason",
    "DeploymentState",
    "CancelScope",
    "Backend",
    "TORN_DOWN",
    "FAILED_STATES",
    "DEAD_PHASES",
    "ADMIN_IN",
    "ADMIN_OUT",
    "AUTH_TO_INITIATOR",
    "AUTH_TO_RESPONDER",
    "Abort",
    "AdminCode",
    "AdminReply",
    "AdminRequest",
    "AuthChallenge",
    "AuthHello",
    "AuthOk",
    "AuthProof",
    "BIAS_LIST",
    "BIG_LIST",
    "BODY",
    "CONTROL",
    "CacheClear",
    "CacheCleared",
    "CacheEntry",
    "CacheEvent",
    "CacheEventKind",
    "CacheEvents",
    "CacheOp",
    "CacheOpKind",
    "CacheSnapshot",
    "CacheStats",
    "CacheSubscribe",
    "Cancel",
    "CancelAck",
    "EVENTS",
    "ErrorCode",
    "Event",
    "GRAMMAR",
    "Generate",
    "HANDSHAKE_BYTES",
    "KIND_OF",
    "Kind",
    "Lease",
    "LoadProgress",
    "PLAN_TO_FOLLOWER",
    "PLAN_TO_LEADER",
    "KvStats",
    "SpecStats",
    "PhaseTimes",
    "Ping",
    "Plan",
    "PlanBatch",
    "PlanFetch",
    "PlanHello",
    "PlanInsert",
    "PlanRemove",
    "PlanWelcome",
    "Pong",
    "DiskIndex",
    "REPORT",
    "REPORT_TO_RANK",
    "REQUESTS_IN",
    "REQUESTS_OUT",
    "RankReady",
    "Sampling",
    "SeededSampling",
    "Serve",
    "Shutdown",
    "Stats",
    "StatsRequest",
    "TEXT",
    "Telemetry",
    "TokenBias",
    "Tokens",
    "TokensBatch",
]

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
    Kind.DISK_INDEX: DiskIndex,
    Kind.CANCEL: Cancel,
    Kind.SERVE: Serve,
    Kind.SHUTDOWN: Shutdown,
    Kind.LEASE: Lease,
    Kind.RANK_READY: RankReady,
    Kind.TELEMETRY: Telemetry,
    Kind.CANCEL_ACK: CancelAck,
    Kind.CACHE_CLEAR: CacheClear,
    Kind.CACHE_CLEARED: CacheCleared,
    Kind.CACHE_SUBSCRIBE: CacheSubscribe,
    Kind.CACHE_EVENTS: CacheEvents,
    Kind.CACHE_SNAPSHOT: CacheSnapshot,
    Kind.AUTH_HELLO: AuthHello,
    Kind.AUTH_CHALLENGE: AuthChallenge,
    Kind.AUTH_PROOF: AuthProof,
    Kind.AUTH_OK: AuthOk,
}
KIND_OF: dict[type, Kind] = {cls: kind for kind, cls in BODY.items()}
assert set(BODY) == set(Kind), "every kind needs exactly one schema"
assert len(KIND_OF) == len(BODY), "every schema serves exactly one kind"
