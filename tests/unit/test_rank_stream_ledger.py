"""Rank 0's stream ledger (services/rank/streams.py), the one owner of open streams:
every open stream ends once, whatever the main thread sends after that is dropped, and
every chunk is addressed and indexed here."""

from __future__ import annotations

from common.messages import ErrorCode, Generate
from services.rank.outbox import StreamChunk
from services.rank.streams import StreamLedger

# -- stream ledger ---------------------------------------------------------------------


def test_ledger_ends_every_open_stream_once_and_drops_what_follows():
    led = StreamLedger()
    assert led.on_generate(b"a", Generate("r1", [1, 2, 3], 8)) is None
    assert led.on_generate(b"b", Generate("r2", [4], 8)) is None
    dup = led.on_generate(b"c", Generate("r1", [9], 8))
    assert (dup.finish_reason, dup.error_code) == ("error", ErrorCode.DUPLICATE_REQUEST)
    first = led.on_chunk(StreamChunk("r1", [7, 8], step=4, model_ttft_ms=1.5))
    assert first[0] == b"a" and (first[1].index, first[1].tokens) == (0, [7, 8])
    assert (first[1].prompt_tokens, first[1].step, first[1].model_ttft_ms) == (3, 4, 1.5)
    assert led.on_chunk(StreamChunk("r1", [9]))[1].index == 2
    finals = dict(led.end_all("abort", "peer lost: rank 1", ErrorCode.WATCHDOG_ABORT))
    assert finals[b"a"].index == 3 and finals[b"a"].finish_reason == "abort"
    assert finals[b"a"].prompt_tokens == 3 and finals[b"b"].index == 0
    assert finals[b"b"].error_code == ErrorCode.WATCHDOG_ABORT
    assert led.end_all("error", "again", ErrorCode.RANK_STOPPED) == []  # each stream ends once
    # The step that was in flight, then the main thread's own end: never sent.
    assert led.on_chunk(StreamChunk("r1", [10])) is None
    again = led.on_generate(b"a", Generate("r1", [1], 4))
    assert (again.finish_reason, again.error_code) == ("error", ErrorCode.DUPLICATE_REQUEST)
    assert "cancelled" in again.error  # the text says which case, for people
    assert led.on_chunk(StreamChunk("r1", finish_reason="abort")) is None
    assert led.on_generate(b"a", Generate("r1", [1], 4)) is None  # the id is free again
    assert led.dropped == 2
    assert led.on_chunk(StreamChunk("x", finish_reason="error")) is None  # never opened
    assert led.dropped == 3


def test_ledger_refuses_beyond_its_bound_until_a_stream_ends():
    led = StreamLedger(max_open=2)
    assert led.on_generate(b"a", Generate("r1", [1], 8)) is None
    assert led.on_generate(b"a", Generate("r2", [1], 8)) is None
    full = led.on_generate(b"b", Generate("r3", [1], 8))
    assert (full.request_id, full.finish_reason, full.tokens) == ("r3", "error", [])
    assert full.error_code == ErrorCode.OVERLOADED and led.refused == 1
    assert set(led.open) == {"r1", "r2"}  # the refused one was never opened
    ident, last = led.on_chunk(StreamChunk("r1", [5], finish_reason="length"))
    assert (ident, last.finish_reason, last.index) == (b"a", "length", 0)
    assert led.on_generate(b"b", Generate("r3", [1], 8)) is None  # room again
    dup = led.on_generate(b"b", Generate("r2", [1], 8))  # a duplicate stays a duplicate
    assert dup.error_code == ErrorCode.DUPLICATE_REQUEST
    assert StreamLedger().max_open == 0  # no bound unless given
