"""Finish reasons are a closed vocabulary on the wire (common/messages/vocab.py
FinishReason): TOKENS decodes them strictly, and the gateway's renderings (Finish, with
its own TOOL_CALLS) are a separate enum that maps every wire value one for one."""

from __future__ import annotations

import json

import pytest

from common.messages import FinishReason, Tokens
from common.schema import SchemaError, decode_into, to_wire
from services.gateway.core.generation import Finish


def chunk(reason) -> dict:
    return {**to_wire(Tokens("r", [1], 0)), "finish_reason": reason}


def test_tokens_decode_finish_reasons_as_members():
    for r in FinishReason:
        got = decode_into(Tokens, chunk(r.value)).finish_reason
        assert got is r and str(got) == r.value
    assert decode_into(Tokens, chunk(None)).finish_reason is None
    assert to_wire(Tokens("r", [], 0, FinishReason.ABORT))["finish_reason"] == "abort"


@pytest.mark.parametrize("bad", ["tool_calls", "content_filter", "STOP", "", 1, True, ["stop"]])
def test_a_value_outside_the_set_is_wrong_type(bad):
    with pytest.raises(SchemaError) as ei:
        decode_into(Tokens, chunk(bad))
    assert (ei.value.reason, ei.value.detail) == ("wrong_type",
                                                  "finish_reason: expected a FinishReason")


def test_the_gateways_renderings_are_apart_and_cover_the_wire():
    assert {f.value for f in FinishReason} == {"stop", "length", "abort", "error"}
    for r in FinishReason:
        assert Finish.of(r).value == r.value
    assert "tool_calls" not in {f.value for f in FinishReason}  # the gateway's alone
    assert json.dumps({"finish_reason": Finish.TOOL_CALLS}) == '{"finish_reason": "tool_calls"}'
    assert str(Finish.LENGTH) == "length"


def test_the_models_own_ends_are_members():
    # mlx-lm's BatchGenerator says "stop" or "length"; services/rank/engine.py types them
    assert FinishReason("stop") is FinishReason.STOP
    assert FinishReason("length") is FinishReason.LENGTH
