"""Typed bodies: every schema violation (wrong type, extra, missing, over its cap) is
rejected with its own reason without burning the sequence; fields at their cap pass."""

from __future__ import annotations

from typing import Any

import pytest

from common.envelope import Reason
from common.messages import BODY, Kind
from common.schema import DEFAULT_MAX_DICT, DEFAULT_MAX_LIST, DEFAULT_MAX_STR, to_wire
from tests.support.envelope import (
    SAMPLES,
    conforms,
    reject,
    sign_raw,
    verifier,
)


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
    ("nested-wrong-type", Kind.PLAN, wire(Kind.PLAN, inserts=[
        PLAN_INSERT | {"sampling": PLAN_INSERT["sampling"] | {"seed": "s"}}]), Reason.WRONG_TYPE),
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
