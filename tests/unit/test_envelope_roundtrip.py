"""The signed envelope's round trips: every kind encodes and decodes to an equal,
correctly typed body; defaults, numeric widening, sequence numbers and the documented
prefix layout. Rejections are in the other tests/unit/test_envelope_*.py modules."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest

from common import messages as m
from common.envelope import MAC_LEN, MAGIC, PREFIX, PROTOCOL_VERSION
from common.messages import BODY, Kind
from common.schema import to_wire, wire_default
from tests.support.envelope import (
    KEY,
    NOW,
    SAMPLES,
    conforms,
    sign_raw,
    signer,
    verifier,
)


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


def test_prefix_layout_is_as_documented():
    assert PREFIX.size == 13 and MAC_LEN == 32
    frame = signer().encode(SAMPLES[Kind.AUTH_OK])
    magic, version, key_id, header_len = struct.unpack_from(">2sB8sH", frame)
    assert (magic, version, key_id) == (MAGIC, PROTOCOL_VERSION, KEY.key_id)
    assert msgpack.unpackb(frame[13:13 + header_len])[0] == "auth_ok"
