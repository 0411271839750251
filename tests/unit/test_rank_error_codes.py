"""Typed causes instead of text: rank 0's error codes (common.messages.ErrorCode) and the
gateway's one table from code to HTTP status and OpenAI error (services/gateway/
generation.py); the one classifier of a failed step's exception; where the main thread
is, as the watchdog thread asks it."""

from __future__ import annotations

import msgpack
import pytest

from common.messages import ErrorCode, Tokens
from common.schema import SchemaError, decode_into, to_wire
from services.gateway.core.errors import TYPES
from services.gateway.core.generation import NO_CODE, rank_error
from services.rank.errors import StepCause, step_cause
from services.rank.watchdog_thread import Leave, may_ask
from services.rank.watchdogs import Inside, Where


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_renders_as_an_openai_error(code):
    """Whatever code rank 0 sends on an error chunk (decoded from the wire as the gateway
    receives it) becomes an OpenAI-shaped error the gateway renders: a status it knows, a
    stable code, a sentence before the rank's own text."""
    chunk = Tokens("r1", [], 0, finish_reason="error", error="its own words", error_code=code)
    got = decode_into(Tokens, msgpack.unpackb(msgpack.packb(to_wire(chunk))))
    err = rank_error(got.error_code, got.error)
    assert err.status in TYPES and err.code and err.type, code
    assert err.message.endswith("its own words") and err.message != "its own words", code
    body = err.body()["error"]
    assert (body["code"], body["type"]) == (err.code, err.type)


# What each code means, independent of the table: whose fault it is decides the class
# of status (the table's own rows are not restated here).
REQUEST_FAULTS = {ErrorCode.INVALID_REQUEST: "invalid_request",
                  ErrorCode.PROMPT_TOO_LONG: "invalid_request",
                  ErrorCode.DUPLICATE_REQUEST: "invalid_request",
                  # its own code: the deployment's budget, not the request's form
                  ErrorCode.KV_BUDGET: "kv_budget_exceeded"}  # resending cannot help
RETRY_LATER = {ErrorCode.OVERLOADED: 429, ErrorCode.NOT_SERVING: 503}  # the same, later


@pytest.mark.parametrize("code", list(ErrorCode))
def test_code_maps_to_a_status_by_whose_fault_it_is(code):
    err = rank_error(code, "whatever the text says")
    assert err.type == TYPES[err.status]  # the OpenAI type follows the status
    if code in REQUEST_FAULTS:
        assert (err.status, err.code) == (400, REQUEST_FAULTS[code])
    elif code in RETRY_LATER:
        assert err.status == RETRY_LATER[code]
    else:  # the rank failed it: a backend error, resumable where resume is on
        assert (err.status, err.code) == (502, "backend_error")
    assert err.message.endswith("whatever the text says")  # the text is kept, for people


def test_the_text_never_decides_the_status():
    # The same words under different codes: the code alone decides.
    for text in ("empty prompt", "not serving (phase loading)", "rank 0 stopped: x", ""):
        assert rank_error(ErrorCode.RANK_STOPPED, text).status == 502
        assert rank_error(ErrorCode.INVALID_REQUEST, text).status == 400
    none = rank_error(None, None)  # an error chunk without a code: an engine failure
    assert (none.status, none.code) == (NO_CODE.status, "backend_error")
    assert none.message.endswith("unknown error")


def test_error_code_is_typed_on_the_wire_and_closed():
    t = Tokens("r1", [], 0, finish_reason="error", error="x", error_code=ErrorCode.NOT_SERVING)
    raw = msgpack.unpackb(msgpack.packb(to_wire(t)))
    assert raw["error_code"] == "not_serving"
    back = decode_into(Tokens, raw)
    assert back.error_code is ErrorCode.NOT_SERVING
    assert decode_into(Tokens, {**raw, "error_code": None}).error_code is None
    for bad in ("no_such_code", "NOT_SERVING", 3, b"not_serving"):
        with pytest.raises(SchemaError) as e:
            decode_into(Tokens, {**raw, "error_code": bad})
        assert e.value.reason == "wrong_type"


# -- the one classifier of exceptions out of an MLX step (services/rank/errors.py) -------


@pytest.mark.parametrize(("exc", "cause"), [
    (RuntimeError("[ring] connection to a peer was lost"), StepCause.PEER_LOST),
    (RuntimeError("[ring] Recv failed: Connection reset by peer"), StepCause.PEER_LOST),
    (ConnectionResetError(104, "reset"), StepCause.PEER_LOST),
    (BrokenPipeError(32, "broken pipe"), StepCause.PEER_LOST),
    (RuntimeError("[metal] out of memory"), StepCause.FAILED),
    (ValueError("shapes (1,2) and (3,4) do not match"), StepCause.FAILED),
    (KeyError("r1"), StepCause.FAILED),
])
def test_step_cause_sorts_a_peer_loss_from_other_failures(exc, cause):
    assert step_cause(exc) is cause


def test_may_ask_the_main_thread_to_leave_by_where_it_is():
    step, init = Where(Inside.STEP, 4), Where(Inside.DISTRIBUTED_INIT)
    assert (str(step), str(init), str(Where(Inside.LAST_STEP))) == \
        ("step 4", "distributed init", "the last step")
    assert may_ask(Leave.ALWAYS, None) and may_ask(Leave.ALWAYS, step)
    assert not may_ask(Leave.ALWAYS, init) and not may_ask(Leave.ALWAYS, Where(Inside.LOAD))
    assert may_ask(Leave.IF_FREE, None) and not may_ask(Leave.IF_FREE, step)
    assert not may_ask(Leave.NEVER, None) and not may_ask(Leave.NEVER, step)
