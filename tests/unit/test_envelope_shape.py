"""Frame shape and size: truncated, oversize and non-bytes input, unknown and unexpected
kinds, malformed headers and bodies; and one frame for every rejection reason, each
counted once under its own reason."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import pytest

from common import messages as m
from common.envelope import (
    DEFAULT_MAX_SIZE,
    MAGIC,
    MIN_LEN,
    PREFIX,
    PROTOCOL_VERSION,
    REGISTRY,
    Reason,
    RejectCounter,
    Signer,
    Verifier,
)
from common.messages import Kind
from tests.support.clock import FakeClock
from tests.support.envelope import (
    KEY,
    NOW,
    OTHER_KEY,
    SAMPLES,
    reject,
    sign_raw,
    signer,
    verifier,
)


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


def test_each_rejection_counted_under_its_own_reason():
    clock = FakeClock(NOW)
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
