"""The signed envelope: round trips, every rejection path, and fuzzing.

Whatever arrives, `Verifier.decode` either returns a correctly typed body or raises
`Rejected` with one of `Reason`'s values, and counts that reason once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import struct
import types
import typing
from collections import Counter
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import messages as m
from common.envelope import (
    DEFAULT_MAX_SIZE,
    MAC_LEN,
    MAGIC,
    MIN_LEN,
    PREFIX,
    PROTOCOL_VERSION,
    REGISTRY,
    REPLAY_WINDOW,
    Key,
    Reason,
    RejectCounter,
    Rejected,
    ReplayWindow,
    Signer,
    Verifier,
)
from common.messages import BODY, Kind
from common.schema import DEFAULT_MAX_DICT, DEFAULT_MAX_LIST, DEFAULT_MAX_STR, to_wire, wire_default

KEY = Key.from_secret(b"k" * 32)
OTHER_KEY = Key.from_secret(b"o" * 32)
ALL_KINDS = frozenset(Kind)
REASONS = frozenset(Reason)
NOW = 1_700_000_000.0
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One valid body per kind, with every field set away from its default.
SAMPLES: dict[Kind, Any] = {
    Kind.ADMIN_REQUEST: m.AdminRequest(
        "r-1", "status", {"verbose": True, "n": 3, "nested": {"a": [1, 2.5, "x", b"y", None]}}
    ),
    Kind.ADMIN_REPLY: m.AdminReply("r-1", True, "ok", "fine", {"deployments": [{"id": "d1"}]}),
    Kind.EVENT: m.Event("events", "deployment_state", "dep-1", "serving", "canary ok", NOW + 0.5,
                        {"tp": 2}),
    Kind.GENERATE: m.Generate("r-2", [1, 2, 3], 16, 0.7, 0.9, 1234, [2], "gateway"),
    Kind.ABORT: m.Abort("r-2", "disconnect"),
    Kind.TOKENS: m.Tokens("r-2", [5, 6], 3, "stop", None, 3, 12.5, 9, [NOW, NOW + 0.01]),
    Kind.STATS_REQUEST: m.StatsRequest("r-3"),
    Kind.STATS: m.Stats("r-3", "serving", 10, 1, ["r-2"], 4),
    Kind.PLAN_HELLO: m.PlanHello(1),
    Kind.PLAN_WELCOME: m.PlanWelcome(1, 7),
    Kind.PLAN: m.Plan(7, 100, True, [m.PlanInsert("r-2", [1, 2, 3], 16, 0.7, 0.9, 1234, [2])],
                      [m.PlanRemove("r-1", "abort")], 3, True),
    Kind.PLAN_FETCH: m.PlanFetch(5),
    Kind.PLAN_BATCH: m.PlanBatch(
        [m.Plan(5, 98, True), m.Plan(6, 99, False, removes=[m.PlanRemove("r-9", "stop")])], True
    ),
    Kind.PING: m.Ping(42, NOW + 0.25),
    Kind.PONG: m.Pong(42, 1, 100, "serving"),
    Kind.CANCEL: m.Cancel("dep-1", 3, "requests", ["r-1"], "admin"),
    Kind.SERVE: m.Serve("dep-1", "job-1"),
    Kind.SHUTDOWN: m.Shutdown("dep-1", "job-1", "stop"),
    Kind.LEASE: m.Lease("dep-1", "job-1", 12, 45.0, 3),
    Kind.RANK_READY: m.RankReady("dep-1", "job-1", 1, "host-a", 4242, NOW - 3.125, "boot-1",
                                 {"plan": "tcp://127.0.0.1:40000"}),
    Kind.TELEMETRY: m.Telemetry("dep-1", "job-1", 1, 4242, "serving", 100, 2, 3, 1024, 2048, NOW,
                                "none"),
    Kind.CANCEL_ACK: m.CancelAck("dep-1", 3, 1, 101, ["r-1"]),
    Kind.AUTH_HELLO: m.AuthHello("dep-1", "job-1", 1, b"\x00" * 16),
    Kind.AUTH_CHALLENGE: m.AuthChallenge(b"n" * 16, b"p" * 32),
    Kind.AUTH_PROOF: m.AuthProof(b"p" * 32),
    Kind.AUTH_OK: m.AuthOk(1),
}


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(accept=ALL_KINDS, *, keys=(KEY,), clock=None, max_size=DEFAULT_MAX_SIZE,
             counter: RejectCounter | None = None) -> Verifier:
    counter = counter or RejectCounter("test", "envelope")
    return Verifier(keys, accept, counter, max_size=max_size, clock=clock or Clock())


def signer(sender: str = "tester", key: Key = KEY) -> Signer:
    return Signer(key, sender, clock=Clock())


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


# --- round trips -----------------------------------------------------------------------


def test_every_kind_has_a_sample():
    assert set(SAMPLES) == set(Kind)
    for kind, body in SAMPLES.items():
        assert type(body) is BODY[kind]
        assert conforms(body, BODY[kind])


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_round_trip_every_kind(kind):
    s = signer()
    v = verifier()
    frame = s.encode(SAMPLES[kind])
    msg = v.decode(frame)
    assert msg.kind is kind
    assert msg.body == SAMPLES[kind]
    assert conforms(msg.body, BODY[kind])
    assert (msg.header.sender, msg.header.boot, msg.header.seq) == ("tester", s.boot, 1)
    assert msg.header.ts == NOW and msg.header.key_id == KEY.key_id
    assert v.counter.snapshot() == {}


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_wire_default_packs_like_to_wire(kind):
    body = SAMPLES[kind]
    assert msgpack.packb(body, default=wire_default) == msgpack.packb(to_wire(body))


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_required_fields_only_get_defaults(kind):
    cls = BODY[kind]
    wire = to_wire(SAMPLES[kind])
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    frame = sign_raw({k: v for k, v in wire.items() if k in required}, kind=kind.value)
    body = verifier().decode(frame).body
    assert conforms(body, cls)
    for f in dataclasses.fields(cls):
        if f.name not in required:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert getattr(body, f.name) == default


def test_int_accepted_for_float_field():
    body = verifier().decode(sign_raw({"deployment_id": "d", "job_id": "j", "lease_seq": 1,
                                       "ttl_s": 45, "cancel_epoch": 0}, kind="lease")).body
    assert body.ttl_s == 45.0 and type(body.ttl_s) is float


def test_optional_none_accepted():
    wire = to_wire(SAMPLES[Kind.TOKENS]) | {"finish_reason": None, "model_ttft_ms": None}
    body = verifier().decode(sign_raw(wire, kind="tokens")).body
    assert body.finish_reason is None and body.model_ttft_ms is None


def test_signer_sequence_and_explicit_seq_ts():
    s = signer()
    v = verifier()
    seqs = [v.decode(s.encode(m.PlanFetch(i))).header.seq for i in range(3)]
    assert seqs == [1, 2, 3]
    msg = v.decode(s.encode(m.PlanFetch(9), seq=100, ts=NOW - 1))
    assert (msg.header.seq, msg.header.ts) == (100, NOW - 1)


# --- tampering, keys ---------------------------------------------------------------------


def expected_flip_reason(pos: int, frame_len: int) -> Reason:
    if pos < 2:
        return Reason.BAD_MAGIC
    if pos == 2:
        return Reason.BAD_VERSION
    if pos < 11:
        return Reason.UNKNOWN_KEY
    return Reason.BAD_MAC


@pytest.mark.parametrize("kind", [Kind.PLAN, Kind.TOKENS, Kind.AUTH_OK], ids=lambda k: k.value)
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipping_any_byte_is_rejected(kind, mask):
    v = verifier()
    frame = signer().encode(SAMPLES[kind])
    expected: Counter[str] = Counter()
    for pos in range(len(frame)):
        bad = bytearray(frame)
        bad[pos] ^= mask
        reason = reject(v, bytes(bad))
        assert reason is expected_flip_reason(pos, len(frame)), pos
        expected[reason.value] += 1
    assert v.counter.snapshot() == dict(expected)
    # No rejected frame burnt the sequence number: the original still goes through once.
    assert v.decode(frame).body == SAMPLES[kind]
    assert reject(v, frame) is Reason.REPLAY


def test_wrong_key_is_unknown_key():
    v = verifier()
    frame = signer(key=OTHER_KEY).encode(SAMPLES[Kind.ABORT])
    assert reject(v, frame) is Reason.UNKNOWN_KEY
    assert v.counter.snapshot() == {"unknown_key": 1}


def test_forged_key_id_is_bad_mac():
    forged = Key(secret=b"f" * 32, key_id=KEY.key_id)  # collides on id, wrong secret
    v = verifier()
    assert reject(v, signer(key=forged).encode(SAMPLES[Kind.ABORT])) is Reason.BAD_MAC
    assert v.counter.snapshot() == {"bad_mac": 1}


def test_verifier_accepts_any_of_its_keys():
    v = verifier(keys=(KEY, OTHER_KEY))
    assert v.decode(signer(key=OTHER_KEY).encode(SAMPLES[Kind.ABORT])).body == SAMPLES[Kind.ABORT]
    assert v.decode(signer(key=KEY).encode(SAMPLES[Kind.ABORT])).body == SAMPLES[Kind.ABORT]


def test_verifier_without_keys_fails_closed():
    with pytest.raises(ValueError, match="fail closed"):
        Verifier([], ALL_KINDS, RejectCounter("test", "nokey"))


def test_key_rules():
    with pytest.raises(ValueError):
        Key.from_secret(b"short")
    assert Key.from_secret(b"k" * 32) == KEY
    assert Key.from_secret(b"k" * 32).key_id != Key.from_secret(b"j" * 32).key_id
    assert "kkkk" not in repr(KEY) and KEY.key_id.hex() in repr(KEY)


def test_bad_magic_and_version():
    v = verifier()
    assert reject(v, sign_raw(to_wire(SAMPLES[Kind.ABORT]), magic=b"XX")) is Reason.BAD_MAGIC
    assert reject(v, sign_raw(to_wire(SAMPLES[Kind.ABORT]), version=2)) is Reason.BAD_VERSION
    assert v.counter.snapshot() == {"bad_magic": 1, "bad_version": 1}


# --- replay and time ---------------------------------------------------------------------


def test_replay_is_rejected():
    v = verifier()
    frame = signer().encode(SAMPLES[Kind.CANCEL])
    v.decode(frame)
    assert reject(v, frame) is Reason.REPLAY
    assert reject(v, frame) is Reason.REPLAY
    assert v.counter.snapshot() == {"replay": 2}


def test_reordered_within_window_accepted_once():
    s = signer()
    v = verifier()
    frames = [s.encode(m.PlanFetch(i)) for i in range(64)]
    order = list(range(64))
    order = order[::2][::-1] + order[1::2]  # descending evens, then ascending odds
    got = [v.decode(frames[i]).body.from_seq for i in order]
    assert got == order
    for i in (0, 7, 63):
        assert reject(v, frames[i]) is Reason.REPLAY
    assert v.counter.snapshot() == {"replay": 3}


def test_sequence_older_than_window_is_replay():
    s = signer()
    v = verifier()
    v.decode(s.encode(m.PlanFetch(0), seq=REPLAY_WINDOW + 10))
    assert reject(v, s.encode(m.PlanFetch(0), seq=10)) is Reason.REPLAY  # never seen, too old
    assert v.decode(s.encode(m.PlanFetch(0), seq=11)).header.seq == 11  # just inside
    big_jump = s.encode(m.PlanFetch(0), seq=10 * REPLAY_WINDOW)
    assert v.decode(big_jump).header.seq == 10 * REPLAY_WINDOW
    assert reject(v, big_jump) is Reason.REPLAY


def test_new_signer_is_a_new_boot():
    v = verifier()
    first = signer("rank-0")
    for i in range(3):
        v.decode(first.encode(m.PlanFetch(i)))
    second = signer("rank-0")  # restarted sender: same name, seq restarts at 1
    assert second.boot != first.boot
    msg = v.decode(second.encode(m.PlanFetch(0)))
    assert (msg.header.seq, msg.header.boot) == (1, second.boot)
    assert reject(v, first.encode(m.PlanFetch(9), seq=2)) is Reason.REPLAY


def test_replay_window_forgets_oldest_sender_beyond_capacity():
    w = ReplayWindow(size=8, max_senders=2)
    assert w.check_and_record("a", "1", 5)
    assert w.check_and_record("b", "1", 5)
    assert w.check_and_record("c", "1", 5)  # evicts a
    assert not w.check_and_record("b", "1", 5)
    assert w.check_and_record("a", "1", 5)  # a was forgotten


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(-30.5, Reason.STALE), (-3600.0, Reason.STALE), (30.5, Reason.FUTURE), (86400.0, Reason.FUTURE),
     (-30.0, None), (30.0, None), (0.0, None)],
)
def test_stale_and_future_timestamps(offset, reason):
    clock = Clock(NOW)
    v = verifier(clock=clock)
    frame = signer().encode(SAMPLES[Kind.LEASE], ts=NOW + offset)
    if reason is None:
        assert v.decode(frame).header.ts == NOW + offset
    else:
        assert reject(v, frame) is reason
        assert v.counter.snapshot() == {reason.value: 1}


def test_clock_moves_the_window():
    clock = Clock(NOW)
    v = verifier(clock=clock)
    s = Signer(KEY, "tester", clock=clock)
    early = s.encode(SAMPLES[Kind.LEASE])
    clock.now += 31
    assert reject(v, early) is Reason.STALE
    assert v.decode(s.encode(SAMPLES[Kind.LEASE])).header.ts == NOW + 31


@pytest.mark.parametrize(("ts", "reason"), [(math.nan, Reason.STALE), (math.inf, Reason.FUTURE),
                                             (-math.inf, Reason.STALE), (2**64 - 1, Reason.FUTURE)])
def test_non_finite_or_huge_timestamp(ts, reason):
    assert reject(verifier(), sign_raw(to_wire(SAMPLES[Kind.ABORT]), ts=ts)) is reason


# --- shape and size ---------------------------------------------------------------------


def test_truncated_frames():
    v = verifier()
    frame = signer().encode(SAMPLES[Kind.PLAN])
    for n in range(len(frame)):
        reason = reject(v, frame[:n])
        assert reason is (Reason.TOO_SHORT if n < MIN_LEN else Reason.BAD_MAC), n
    counts = v.counter.snapshot()
    assert counts == {"too_short": MIN_LEN, "bad_mac": len(frame) - MIN_LEN}


def test_oversize_dropped_unread():
    v = verifier(max_size=512)
    big = signer().encode(m.Generate("r", list(range(400)), 4))
    assert len(big) > 512
    assert reject(v, big) is Reason.OVERSIZE
    assert reject(verifier(), b"\x00" * (DEFAULT_MAX_SIZE + 1)) is Reason.OVERSIZE
    assert v.counter.snapshot() == {"oversize": 1}


def test_non_bytes_input_is_bad_frames():
    v = verifier()
    for junk in (None, "text", 12, ["list"]):
        assert reject(v, junk) is Reason.BAD_FRAMES
    frame = signer().encode(SAMPLES[Kind.ABORT])
    assert v.decode(bytearray(frame)).body == SAMPLES[Kind.ABORT]
    assert v.decode(memoryview(signer().encode(SAMPLES[Kind.ABORT]))).body == SAMPLES[Kind.ABORT]


def test_unknown_kind():
    v = verifier()
    assert reject(v, sign_raw({"request_id": "r"}, kind="launch_missiles")) is Reason.UNKNOWN_KIND
    assert reject(v, sign_raw({"request_id": "r"}, kind="ABORT")) is Reason.UNKNOWN_KIND  # exact
    assert v.counter.snapshot() == {"unknown_kind": 2}


def test_unexpected_kind_on_this_socket():
    v = verifier(m.ADMIN_IN)
    s = signer()
    assert v.decode(s.encode(SAMPLES[Kind.ADMIN_REQUEST])).kind is Kind.ADMIN_REQUEST
    for kind in (Kind.EVENT, Kind.ADMIN_REPLY, Kind.CANCEL):
        assert reject(v, s.encode(SAMPLES[kind])) is Reason.UNEXPECTED_KIND
    assert v.counter.snapshot() == {"unexpected_kind": 3}


@pytest.mark.parametrize(
    "header",
    [{"kind": "abort"}, ["abort", "s", "b", 1], ["abort", "s", "b", 1, NOW, "extra"],
     [1, "s", "b", 1, NOW], ["abort", b"s", "b", 1, NOW], ["abort", "s", None, 1, NOW],
     ["abort", "s", "b", 1.0, NOW], ["abort", "s", "b", True, NOW], ["abort", "s", "b", 1, "now"],
     ["abort", "s", "b", 1, None], ["abort", "s" * 300, "b", 1, NOW], "abort"],
    ids=lambda h: repr(h)[:40],
)
def test_bad_header(header):
    assert reject(verifier(), sign_raw({"request_id": "r"}, header=header)) is Reason.BAD_HEADER


def test_header_length_beyond_frame():
    hdr = msgpack.packb(["abort", "s", "b", 1, NOW])
    payload = msgpack.packb({"request_id": "r"})
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, KEY.key_id, 60000)
    mac = hmac.new(KEY.secret, prefix + hdr + payload, hashlib.sha256).digest()
    assert reject(verifier(), prefix + hdr + payload + mac) is Reason.BAD_HEADER


@pytest.mark.parametrize(
    "packed",
    [b"", b"\xc1", b"\x81", msgpack.packb({"request_id": "r"}) + b"\x00",
     msgpack.packb({1: "int key"}), msgpack.packb(msgpack.ExtType(5, b"x")),
     msgpack.packb({"request_id": msgpack.ExtType(1, b"abc")})],
    ids=["empty", "reserved", "truncated-map", "trailing", "int-key", "ext", "ext-value"],
)
def test_bad_body(packed):
    assert reject(verifier(), sign_raw(None, packed=packed)) is Reason.BAD_BODY


def test_deeply_nested_value_is_rejected_not_crashing():
    head = msgpack.packb({"request_id": "r", "command": "c", "args": {"a": None}})[:-1]
    packed = head + b"\x91" * 100_000 + b"\xc0"  # args.a = [[[... 100k deep ...]]]
    assert reject(verifier(), sign_raw(None, kind="admin_request", packed=packed)) is Reason.BAD_BODY


def wire(kind: Kind, **changes: Any) -> dict[str, Any]:
    d = to_wire(SAMPLES[kind])
    for k, v in changes.items():
        if v is DROP:
            del d[k]
        else:
            d[k] = v
    return d


DROP = object()
PLAN_INSERT = to_wire(SAMPLES[Kind.PLAN])["inserts"][0]

SCHEMA_CASES = [
    ("str-for-int", Kind.GENERATE, wire(Kind.GENERATE, max_tokens="16"), Reason.WRONG_TYPE),
    ("bool-for-int", Kind.GENERATE, wire(Kind.GENERATE, max_tokens=True), Reason.WRONG_TYPE),
    ("int-for-bool", Kind.PLAN, wire(Kind.PLAN, advance=1), Reason.WRONG_TYPE),
    ("float-for-int", Kind.PLAN_FETCH, {"from_seq": 1.0}, Reason.WRONG_TYPE),
    ("str-for-float", Kind.PING, {"nonce": 1, "sent_at": "now"}, Reason.WRONG_TYPE),
    ("bytes-for-str", Kind.ABORT, {"request_id": b"r"}, Reason.WRONG_TYPE),
    ("str-for-bytes", Kind.AUTH_PROOF, {"proof": "p"}, Reason.WRONG_TYPE),
    ("none-for-required", Kind.ABORT, {"request_id": None}, Reason.WRONG_TYPE),
    ("map-for-list", Kind.GENERATE, wire(Kind.GENERATE, prompt={"a": 1}), Reason.WRONG_TYPE),
    ("str-in-int-list", Kind.GENERATE, wire(Kind.GENERATE, prompt=[1, "2"]), Reason.WRONG_TYPE),
    ("bool-in-int-list", Kind.TOKENS, wire(Kind.TOKENS, tokens=[1, False]), Reason.WRONG_TYPE),
    ("int-in-str-list", Kind.STATS, wire(Kind.STATS, active_ids=["a", 2]), Reason.WRONG_TYPE),
    ("list-for-map", Kind.ADMIN_REQUEST, wire(Kind.ADMIN_REQUEST, args=[1]), Reason.WRONG_TYPE),
    ("bytes-map-key", Kind.ADMIN_REQUEST, wire(Kind.ADMIN_REQUEST, args={b"k": 1}),
     Reason.WRONG_TYPE),
    ("str-in-dict-str-str", Kind.RANK_READY, wire(Kind.RANK_READY, endpoints={"plan": 1}),
     Reason.WRONG_TYPE),
    ("body-not-map", Kind.ABORT, ["r-1", "client"], Reason.WRONG_TYPE),
    ("body-nil", Kind.ABORT, None, Reason.WRONG_TYPE),
    ("nested-not-map", Kind.PLAN, wire(Kind.PLAN, inserts=["x"]), Reason.WRONG_TYPE),
    ("nested-wrong-type", Kind.PLAN, wire(Kind.PLAN, inserts=[PLAN_INSERT | {"seed": "s"}]),
     Reason.WRONG_TYPE),
    ("nested-nested", Kind.PLAN_BATCH,
     {"plans": [to_wire(SAMPLES[Kind.PLAN]) | {"removes": [{"request_id": 1, "reason": "x"}]}]},
     Reason.WRONG_TYPE),
    ("extra-field", Kind.ABORT, {"request_id": "r", "reason": "x", "admin": True},
     Reason.EXTRA_FIELD),
    ("extra-bytes-key", Kind.ABORT, {"request_id": "r", b"request_id": "r"}, Reason.EXTRA_FIELD),
    ("nested-extra", Kind.PLAN, wire(Kind.PLAN, inserts=[PLAN_INSERT | {"uid": 3}]),
     Reason.EXTRA_FIELD),
    ("missing-field", Kind.GENERATE, wire(Kind.GENERATE, max_tokens=DROP), Reason.MISSING_FIELD),
    ("empty-map", Kind.CANCEL_ACK, {}, Reason.MISSING_FIELD),
    ("nested-missing", Kind.PLAN, wire(Kind.PLAN, inserts=[{"request_id": "r"}]),
     Reason.MISSING_FIELD),
    ("str-over-default-cap", Kind.ABORT, {"request_id": "r", "reason": "x" * (DEFAULT_MAX_STR + 1)},
     Reason.FIELD_TOO_LARGE),
    ("str-over-text-cap", Kind.ADMIN_REPLY, wire(Kind.ADMIN_REPLY, message="x" * 65537),
     Reason.FIELD_TOO_LARGE),
    ("list-over-default-cap", Kind.TOKENS, wire(Kind.TOKENS, tokens=[1] * (DEFAULT_MAX_LIST + 1)),
     Reason.FIELD_TOO_LARGE),
    ("list-over-big-cap", Kind.GENERATE, wire(Kind.GENERATE, prompt=[1] * 262145),
     Reason.FIELD_TOO_LARGE),
    ("str-item-over-cap", Kind.STATS, wire(Kind.STATS, active_ids=["x" * (DEFAULT_MAX_STR + 1)]),
     Reason.FIELD_TOO_LARGE),
    ("bytes-over-cap", Kind.AUTH_PROOF, {"proof": b"p" * 65537}, Reason.FIELD_TOO_LARGE),
    ("map-over-cap", Kind.ADMIN_REQUEST,
     wire(Kind.ADMIN_REQUEST, args={f"k{i}": i for i in range(DEFAULT_MAX_DICT + 1)}),
     Reason.FIELD_TOO_LARGE),
    ("map-key-over-cap", Kind.ADMIN_REQUEST,
     wire(Kind.ADMIN_REQUEST, args={"k" * (DEFAULT_MAX_STR + 1): 1}), Reason.FIELD_TOO_LARGE),
]


@pytest.mark.parametrize(("kind", "body", "reason"), [c[1:] for c in SCHEMA_CASES],
                         ids=[c[0] for c in SCHEMA_CASES])
def test_schema_violations(kind, body, reason):
    v = verifier()
    frame = sign_raw(body, kind=kind.value)
    assert reject(v, frame) is reason
    assert v.counter.snapshot() == {reason.value: 1}
    # A rejected body does not burn the sequence: a valid frame with the same seq passes.
    ok = sign_raw(to_wire(SAMPLES[kind]), kind=kind.value)
    assert v.decode(ok).body == SAMPLES[kind]


@pytest.mark.parametrize(
    ("kind", "body"),
    [(Kind.ABORT, {"request_id": "r", "reason": "x" * DEFAULT_MAX_STR}),
     (Kind.ADMIN_REPLY, wire(Kind.ADMIN_REPLY, message="x" * 65536)),
     (Kind.TOKENS, wire(Kind.TOKENS, tokens=[1] * DEFAULT_MAX_LIST)),
     (Kind.GENERATE, wire(Kind.GENERATE, prompt=[1] * 262144))],
    ids=["str", "text", "list", "big-list"],
)
def test_fields_at_their_cap_are_accepted(kind, body):
    assert conforms(verifier().decode(sign_raw(body, kind=kind.value)).body, BODY[kind])


def test_each_rejection_counted_under_its_own_reason():
    clock = Clock()
    counter = RejectCounter("test-svc", "one-of-each")
    v = Verifier([KEY], m.REQUESTS_IN, counter, max_size=8192, clock=clock)
    s = Signer(KEY, "tester", clock=clock)
    good = s.encode(m.Abort("r-1"))
    v.decode(good)
    cases = {
        Reason.TOO_SHORT: good[:10],
        Reason.OVERSIZE: b"\x00" * 9000,
        Reason.BAD_MAGIC: b"XX" + good[2:],
        Reason.BAD_VERSION: good[:2] + b"\x09" + good[3:],
        Reason.UNKNOWN_KEY: Signer(OTHER_KEY, "x", clock=clock).encode(m.Abort("r")),
        Reason.BAD_MAC: good[:-1] + bytes([good[-1] ^ 1]),
        Reason.BAD_HEADER: sign_raw({}, header=[1, 2, 3]),
        Reason.UNKNOWN_KIND: sign_raw({}, kind="nope"),
        Reason.UNEXPECTED_KIND: s.encode(SAMPLES[Kind.EVENT]),
        Reason.STALE: s.encode(m.Abort("r"), ts=NOW - 100),
        Reason.FUTURE: s.encode(m.Abort("r"), ts=NOW + 100),
        Reason.REPLAY: good,
        Reason.BAD_BODY: sign_raw(None, packed=b"\xc1"),
        Reason.MISSING_FIELD: sign_raw({}, seq=2),
        Reason.EXTRA_FIELD: sign_raw({"request_id": "r", "x": 1}, seq=3),
        Reason.WRONG_TYPE: sign_raw({"request_id": 5}, seq=4),
        Reason.FIELD_TOO_LARGE: sign_raw({"request_id": "r" * 5000}, seq=5),
        Reason.BAD_FRAMES: None,
    }
    for reason, frame in cases.items():
        assert reject(v, frame) is reason, reason
    assert counter.snapshot() == {r.value: 1 for r in cases}
    rows = [r for r in REGISTRY.snapshot() if (r["service"], r["socket"]) == ("test-svc", "one-of-each")]
    assert {r["reason"]: r["count"] for r in rows} == {r.value: 1 for r in cases}


# --- property-based fuzzing ------------------------------------------------------------

FUZZ_COUNTER = RejectCounter("test", "fuzz")
ints64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = (st.none() | st.booleans() | ints64 | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12) | st.sampled_from([0, 1, -1, "", "r-1", 0.5]))
msgpack_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), children, max_size=4),
    max_leaves=16,
)
exts = (st.builds(msgpack.ExtType, st.integers(min_value=0, max_value=127), st.binary(max_size=12))
        | st.builds(msgpack.Timestamp, st.integers(min_value=0, max_value=2**34),
                    st.integers(min_value=0, max_value=999_999_999)))


def decode_only_rejected(v: Verifier, data: bytes) -> Any:
    try:
        return v.decode(data)
    except Rejected as exc:
        assert exc.reason in REASONS
        return None


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_are_rejected(data):
    with pytest.raises(Rejected):
        verifier(counter=FUZZ_COUNTER).decode(data)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_after_valid_prefix_are_bad_mac(tail):
    data = PREFIX.pack(MAGIC, PROTOCOL_VERSION, KEY.key_id, len(tail) // 2) + tail
    reason = reject(verifier(counter=FUZZ_COUNTER), data)
    assert reason in (Reason.TOO_SHORT, Reason.BAD_MAC)


BASE_FRAMES = {kind: Signer(KEY, "fuzzer", clock=Clock()).encode(body) for kind, body in SAMPLES.items()}
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
    st.tuples(st.just("insert"), st.integers(min_value=0), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(min_value=0), st.integers(min_value=1, max_value=8)),
    st.tuples(st.just("truncate"), st.integers(min_value=0), st.just(0)),
    st.tuples(st.just("set"), st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
)


def mutate(frame: bytes, ops: list[tuple[str, int, Any]]) -> bytes:
    data = bytearray(frame)
    for op, pos, arg in ops:
        if not data:
            break
        pos %= len(data)
        if op == "flip":
            data[pos] ^= arg
        elif op == "insert":
            data[pos:pos] = arg
        elif op == "delete":
            del data[pos:pos + arg]
        elif op == "truncate":
            del data[pos:]
        else:
            data[pos] = arg
    return bytes(data)


@FUZZ
@given(st.sampled_from(list(Kind)), st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_mutated_envelopes(kind, ops):
    frame = BASE_FRAMES[kind]
    bad = mutate(frame, ops)
    v = verifier(counter=FUZZ_COUNTER)
    if bad == frame:
        assert v.decode(bad).body == SAMPLES[kind]
    else:
        with pytest.raises(Rejected) as info:
            v.decode(bad)
        assert info.value.reason in REASONS


def check_signed_body(kind_s: str, body_bytes: bytes) -> None:
    v = verifier(counter=FUZZ_COUNTER)
    msg = decode_only_rejected(v, sign_raw(None, kind=kind_s, packed=body_bytes))
    if msg is not None:
        assert msg.kind.value == kind_s
        assert conforms(msg.body, BODY[msg.kind])


kinds_or_junk = st.sampled_from([k.value for k in Kind]) | st.text(max_size=16)


@FUZZ
@given(kinds_or_junk, msgpack_values | st.dictionaries(st.text(max_size=14), msgpack_values,
                                                       max_size=8))
def test_fuzz_random_signed_bodies(kind_s, body):
    check_signed_body(kind_s, msgpack.packb(body))


@FUZZ
@given(kinds_or_junk, st.recursive(scalars | exts, lambda c: st.lists(c, max_size=3), max_leaves=6))
def test_fuzz_signed_ext_and_odd_values(kind_s, body):
    check_signed_body(kind_s, msgpack.packb(body))


@st.composite
def mutated_sample(draw):
    """A valid sample's wire map with fields replaced, dropped or added: reaches the
    typed checks far more often than random maps do."""
    kind = draw(st.sampled_from(list(Kind)))
    d = to_wire(SAMPLES[kind])
    for name in list(d):
        choice = draw(st.integers(min_value=0, max_value=5))
        if choice == 0:
            del d[name]
        elif choice == 1:
            d[name] = draw(msgpack_values)
        elif choice == 2 and isinstance(d[name], list) and d[name]:
            d[name] = d[name] + [draw(msgpack_values)]
        elif choice == 3 and isinstance(d[name], list) and d[name] and isinstance(d[name][0], dict):
            inner = dict(d[name][0])
            key = draw(st.sampled_from(sorted(inner)))
            inner[key] = draw(msgpack_values)
            d[name] = [inner]
    if draw(st.booleans()):
        d[draw(st.text(max_size=10))] = draw(msgpack_values)
    return kind.value, d


@FUZZ
@given(mutated_sample())
def test_fuzz_mutated_sample_bodies(case):
    kind_s, body = case
    check_signed_body(kind_s, msgpack.packb(body))


@FUZZ
@given(st.lists(msgpack_values, max_size=7) | msgpack_values)
def test_fuzz_signed_headers(header):
    v = verifier(counter=FUZZ_COUNTER, accept=ALL_KINDS)
    msg = decode_only_rejected(v, sign_raw(to_wire(SAMPLES[Kind.ABORT]), header=header))
    if msg is not None:  # only a well-formed, fresh header can pass
        assert msg.kind is Kind.ABORT and msg.body == SAMPLES[Kind.ABORT]
        assert type(msg.header.sender) is str and type(msg.header.seq) is int
        assert abs(msg.header.ts - NOW) <= 30


def test_fuzz_counter_only_holds_known_reasons():
    assert set(FUZZ_COUNTER.snapshot()) <= {r.value for r in Reason}


def test_prefix_layout_is_as_documented():
    assert PREFIX.size == 13 and MAC_LEN == 32
    frame = signer().encode(SAMPLES[Kind.AUTH_OK])
    magic, version, key_id, header_len = struct.unpack_from(">2sB8sH", frame)
    assert (magic, version, key_id) == (MAGIC, PROTOCOL_VERSION, KEY.key_id)
    assert msgpack.unpackb(frame[13:13 + header_len])[0] == "auth_ok"
