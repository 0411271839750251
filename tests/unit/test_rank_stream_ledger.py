"""Rank 0's stream ledger (services/rank/streams.py): every open stream ends once, and
whatever the main thread sends after that is dropped."""

from __future__ import annotations

from common.messages import ErrorCode, Generate, Tokens
from services.rank.streams import StreamLedger

# -- stream ledger ---------------------------------------------------------------------


def test_ledger_ends_every_open_stream_once_and_drops_what_follows():
    led = StreamLedger()
    assert led.on_generate(b"a", Generate("r1", [1, 2, 3], 8)) is None
    assert led.on_generate(b"b", Generate("r2", [4], 8)) is None
    dup = led.on_generate(b"c", Generate("r1", [9], 8))
    assert (dup.finish_reason, dup.error_code) == ("error", ErrorCode.DUPLICATE_REQUEST)
    assert led.on_send(Tokens("r1", [7, 8], 0)) and led.on_send(Tokens("r1", [9], 2))
    finals = dict(led.end_all("abort", "peer lost: rank 1", ErrorCode.WATCHDOG_ABORT))
    assert finals[b"a"].index == 3 and finals[b"a"].finish_reason == "abort"
    assert finals[b"a"].prompt_tokens == 3 and finals[b"b"].index == 0
    assert led.end_all("error", "again", ErrorCode.RANK_STOPPED) == []  # each stream ends once
    # The step that was in flight, then the main thread's own end: never sent.
    assert not led.on_send(Tokens("r1", [10], 3))
    again = led.on_generate(b"a", Generate("r1", [1], 4))
    assert (again.finish_reason, again.error_code) == ("error", ErrorCode.DUPLICATE_REQUEST)
    assert "cancelled" in again.error  # the text says which case, for people
    assert not led.on_send(Tokens("r1", [], 4, finish_reason="abort"))
    assert led.on_generate(b"a", Generate("r1", [1], 4)) is None  # the id is free again
    assert led.dropped == 2
    assert led.on_send(Tokens("x", [], 0, finish_reason="error"))  # unknown: passes


def test_ledger_refuses_beyond_its_bound_until_a_stream_ends():
    led = StreamLedger(max_open=2)
    assert led.on_generate(b"a", Generate("r1", [1], 8)) is None
    assert led.on_generate(b"a", Generate("r2", [1], 8)) is None
    full = led.on_generate(b"b", Generate("r3", [1], 8))
    assert (full.request_id, full.finish_reason, full.tokens) == ("r3", "error", [])
    assert full.error_code == ErrorCode.OVERLOADED and led.refused == 1
    assert set(led.open) == {"r1", "r2"}  # the refused one was never opened
    assert led.on_send(Tokens("r1", [5], 0, finish_reason="length"))
    assert led.on_generate(b"b", Generate("r3", [1], 8)) is None  # room again
    dup = led.on_generate(b"b", Generate("r2", [1], 8))  # a duplicate stays a duplicate
    assert dup.error_code == ErrorCode.DUPLICATE_REQUEST
    assert StreamLedger().max_open == 0  # no bound unless given
