"""Shared pieces of the envelope tests (tests/unit/test_envelope_*.py): keys, one valid
body per kind, a verifier and signer on a fake clock, hand-built frames, and an
independent type check of decoded bodies."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import types
import typing
from typing import Any

import msgpack
import pytest

from common import messages as m
from common.envelope import (
    DEFAULT_MAX_SIZE,
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Key,
    Reason,
    RejectCounter,
    Rejected,
    Signer,
    Verifier,
)
from common.messages import Kind
from tests.support.clock import FakeClock

KEY = Key.from_secret(b"k" * 32)
OTHER_KEY = Key.from_secret(b"o" * 32)
ALL_KINDS = frozenset(Kind)
REASONS = frozenset(Reason)
NOW = 1_700_000_000.0

# Every sampling field away from its default (GENERATE's, and PLAN's insert seeded).
SAMPLING = m.Sampling(temperature=0.7, top_p=0.9, seed=1234, top_k=40, min_p=0.05,
                      presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                      repetition_context_size=64, logit_bias=[m.TokenBias(3, -1.5)],
                      grammar='{"grammars": []}')
# One valid body per kind, with every field set away from its default.
SAMPLES: dict[Kind, Any] = {
    Kind.ADMIN_REQUEST: m.AdminRequest(
        "r-1", "status", {"verbose": True, "n": 3, "nested": {"a": [1, 2.5, "x", b"y", None]}}
    ),
    Kind.ADMIN_REPLY: m.AdminReply("r-1", True, m.AdminCode.OK, "fine", {"deployments": [{"id": "d1"}]}),
    Kind.EVENT: m.Event(m.EventTopic.DEPLOYMENT, m.EventName.STATE, "dep-1",
                        m.DeploymentState.SERVING, "canary ok", NOW + 0.5, {"tp": 2},
                        m.ReapOutcome.OK),
    Kind.GENERATE: m.Generate("r-2", [1, 2, 3], 16, SAMPLING, [2], "gateway", 3, 1),
    Kind.ABORT: m.Abort("r-2", "disconnect"),
    Kind.TOKENS: m.Tokens("r-2", [5, 6], 3, m.FinishReason.STOP, None, 3, 12.5, 9, [NOW, NOW + 0.01],
                          m.ErrorCode.OVERLOADED),
    Kind.TOKENS_BATCH: m.TokensBatch([m.Tokens("r-2", [5, 6], 3), m.Tokens("r-3", [7], 0, m.FinishReason.STOP)]),
    Kind.STATS_REQUEST: m.StatsRequest("r-3"),
    Kind.STATS: m.Stats("r-3", m.Phase.SERVING, 10, 1, ["r-2"], 4),
    Kind.PLAN_HELLO: m.PlanHello(1),
    Kind.PLAN_WELCOME: m.PlanWelcome(1, 7),
    Kind.PLAN: m.Plan(7, 100, True, [m.PlanInsert("r-2", [1, 2, 3], 16, SAMPLING.seeded(1234),
                                                  [2], 4, 2, 3, 1)],
                      [m.PlanRemove("r-1", m.RemoveReason.ABORT)], 3, True),
    Kind.PLAN_FETCH: m.PlanFetch(5),
    Kind.PLAN_BATCH: m.PlanBatch(
        [m.Plan(5, 98, True), m.Plan(6, 99, False, removes=[m.PlanRemove("r-9", m.RemoveReason.SHUTDOWN)])], True
    ),
    Kind.PING: m.Ping(42, NOW + 0.25),
    Kind.PONG: m.Pong(42, 1, 100, m.Phase.SERVING),
    Kind.DISK_INDEX: m.DiskIndex(1, 2, verified=["a" * 32], failed=["b" * 32]),
    Kind.CANCEL: m.Cancel("dep-1", 3, m.CancelScope.REQUESTS, ["r-1"], "admin"),
    Kind.SERVE: m.Serve("dep-1", "job-1"),
    Kind.SHUTDOWN: m.Shutdown("dep-1", "job-1", "stop"),
    Kind.LEASE: m.Lease("dep-1", "job-1", 12, 45.0, 3),
    Kind.RANK_READY: m.RankReady("dep-1", "job-1", 1, "host-a", 4242, NOW - 3.125, "boot-1",
                                 {"plan": "tcp://127.0.0.1:40000"}),
    Kind.TELEMETRY: m.Telemetry("dep-1", "job-1", 1, 4242, m.Phase.SERVING, 100, 2, 3, 1024, 2048, NOW,
                                "none"),
    Kind.CANCEL_ACK: m.CancelAck("dep-1", 3, 1, 101, ["r-1"]),
    Kind.CACHE_CLEAR: m.CacheClear("dep-1", 5),
    Kind.CACHE_CLEARED: m.CacheCleared("dep-1", 5, 0, 120),
    Kind.CACHE_SUBSCRIBE: m.CacheSubscribe("cache-index", "a1b2", 7),
    Kind.CACHE_EVENTS: m.CacheEvents("cache-index", "a1b2", [
        m.CacheEvent(8, m.CacheEventKind.ADDED, 3, 0, [1, 2, 3], 3, "r-1"),
        m.CacheEvent(9, m.CacheEventKind.EXTENDED, 4, 3, [4, 5], 5, "r-2"),
        m.CacheEvent(10, m.CacheEventKind.EVICTED, 4), m.CacheEvent(11, m.CacheEventKind.CLEARED)]),
    Kind.CACHE_SNAPSHOT: m.CacheSnapshot("cache-index", "a1b2", 11, 0, True,
                                         [m.CacheEntry(5, [1, 2], 2)]),
    Kind.AUTH_HELLO: m.AuthHello("dep-1", "job-1", 1, b"\x00" * 16),
    Kind.AUTH_CHALLENGE: m.AuthChallenge(b"n" * 16, b"p" * 32, 1),
    Kind.AUTH_PROOF: m.AuthProof(b"p" * 32, 1, b"i" * 16, b"n" * 16, 1),
    Kind.AUTH_OK: m.AuthOk(1),
}


def verifier(accept=ALL_KINDS, *, keys=(KEY,), clock=None, max_size=DEFAULT_MAX_SIZE,
             counter: RejectCounter | None = None) -> Verifier:
    counter = counter or RejectCounter("test", "envelope")
    return Verifier(keys, accept, counter, max_size=max_size, clock=clock or FakeClock(NOW))


def signer(sender: str = "tester", key: Key = KEY) -> Signer:
    return Signer(key, sender, clock=FakeClock(NOW))


def sign_raw(body: Any, *, kind: Any = "abort", key: Key = KEY, sender: Any = "forger",
             boot: Any = "boot-x", seq: Any = 1, ts: Any = NOW, header: Any = None,
             magic: bytes = MAGIC, version: int = PROTOCOL_VERSION, packed: bytes | None = None) -> bytes:
    """A frame built by hand (valid MAC for `key`) with arbitrary header and body."""
    hdr = msgpack.packb([kind, sender, boot, seq, ts] if header is None else header)
    payload = msgpack.packb(body) if packed is None else packed
    prefix = PREFIX.pack(magic, version, key.key_id, len(hdr))
    mac = hmac.new(key.secret, prefix + hdr + payload, hashlib.sha256).digest()
    return prefix + hdr + payload + mac


def reject(v: Verifier, data: Any) -> Reason:
    with pytest.raises(Rejected) as info:
        v.decode(data)
    assert info.value.reason in REASONS
    return info.value.reason


def conforms(value: Any, tp: Any) -> bool:
    """Independent type check of a decoded body against its annotations."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is object:
        return True
    if tp in (bool, int, str, bytes):
        return type(value) is tp
    if tp is float:
        return type(value) is float
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return type(value) is tp
    if origin is list:
        (item,) = typing.get_args(tp)
        return type(value) is list and all(conforms(v, item) for v in value)
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return type(value) is dict and all(conforms(k, kt) and conforms(v, vt) for k, v in value.items())
    if dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            return False
        hints = typing.get_type_hints(tp)
        return all(conforms(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(tp))
    raise AssertionError(f"unexpected annotation {tp!r}")
