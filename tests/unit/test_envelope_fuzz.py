"""Property-based fuzzing of the envelope: whatever arrives (random bytes, mutated frames,
random or mutated signed bodies and headers), `Verifier.decode` either returns a
correctly typed body or raises `Rejected` with one of `Reason`'s values."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.envelope import (
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Reason,
    RejectCounter,
    Rejected,
    Signer,
    Verifier,
)
from common.messages import BODY, Kind
from common.schema import to_wire
from tests.support.clock import FakeClock
from tests.support.envelope import (
    ALL_KINDS,
    KEY,
    NOW,
    REASONS,
    SAMPLES,
    conforms,
    reject,
    sign_raw,
    verifier,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

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


BASE_FRAMES = {kind: Signer(KEY, "fuzzer", clock=FakeClock(NOW)).encode(body)
               for kind, body in SAMPLES.items()}
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
