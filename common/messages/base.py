"""What every channel's messages share: the closed set of kinds, which kinds each
channel accepts, and the size caps several bodies use.

The bodies live one module per channel (DESIGN.md §2): admin.py (admin, events),
requests.py (gateway/supervisor ↔ rank 0; rank 0's cache index: cache_events.py), plan.py (rank 0 ↔ followers), control.py
(supervisor → ranks), report.py (ranks → supervisor), auth.py (the session handshake);
`common/messages/__init__.py` maps each kind to its one body.
"""

from __future__ import annotations

import enum

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
    DISK_INDEX = "disk_index"
    CANCEL = "cancel"
    SERVE = "serve"
    SHUTDOWN = "shutdown"
    LEASE = "lease"
    RANK_READY = "rank_ready"
    TELEMETRY = "telemetry"
    CANCEL_ACK = "cancel_ack"
    CACHE_CLEAR = "cache_clear"
    CACHE_CLEARED = "cache_cleared"
    CACHE_SUBSCRIBE = "cache_subscribe"
    CACHE_EVENTS = "cache_events"
    CACHE_SNAPSHOT = "cache_snapshot"
    AUTH_HELLO = "auth_hello"
    AUTH_CHALLENGE = "auth_challenge"
    AUTH_PROOF = "auth_proof"
    AUTH_OK = "auth_ok"


# Which kinds each channel accepts (a receiver rejects anything else as unexpected_kind).
ADMIN_IN = frozenset({Kind.ADMIN_REQUEST})
ADMIN_OUT = frozenset({Kind.ADMIN_REPLY})
EVENTS = frozenset({Kind.EVENT})
REQUESTS_IN = frozenset({Kind.GENERATE, Kind.ABORT, Kind.STATS_REQUEST, Kind.CACHE_SUBSCRIBE})
REQUESTS_OUT = frozenset({Kind.TOKENS, Kind.TOKENS_BATCH, Kind.STATS, Kind.CACHE_EVENTS,
                          Kind.CACHE_SNAPSHOT})
# Session handshake (common/handshake.py) on the plan and report sockets.
AUTH_TO_RESPONDER = frozenset({Kind.AUTH_HELLO, Kind.AUTH_PROOF})
AUTH_TO_INITIATOR = frozenset({Kind.AUTH_CHALLENGE, Kind.AUTH_OK})
PLAN_TO_FOLLOWER = frozenset({Kind.PLAN_WELCOME, Kind.PLAN, Kind.PLAN_BATCH, Kind.PING}) \
    | AUTH_TO_INITIATOR
PLAN_TO_LEADER = frozenset({Kind.PLAN_HELLO, Kind.PLAN_FETCH, Kind.PONG, Kind.DISK_INDEX}) \
    | AUTH_TO_RESPONDER
CONTROL = frozenset({Kind.CANCEL, Kind.SERVE, Kind.SHUTDOWN, Kind.LEASE, Kind.CACHE_CLEAR})
REPORT = frozenset({Kind.RANK_READY, Kind.TELEMETRY, Kind.CANCEL_ACK, Kind.CACHE_CLEARED}) \
    | AUTH_TO_RESPONDER
REPORT_TO_RANK = AUTH_TO_INITIATOR  # the supervisor only ever answers the handshake
