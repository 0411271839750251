"""Tampered frames and keys: a flipped byte anywhere, a wrong or forged key, key rules,
bad magic and version. Each rejection is counted under its own reason."""

from __future__ import annotations

from collections import Counter

import pytest

from common.envelope import Key, Reason, RejectCounter, Verifier
from common.messages import Kind
from common.schema import to_wire
from tests.support.envelope import (
    ALL_KINDS,
    KEY,
    OTHER_KEY,
    SAMPLES,
    reject,
    sign_raw,
    signer,
    verifier,
)


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
