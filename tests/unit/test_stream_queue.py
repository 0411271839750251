"""The gateway's per-stream queue (services/gateway/core/request_stream.py StreamQueue): a
consumer cancelled while it waits (the client left) must not leave the next waiter (the
drain that took the stream over) deaf to the final chunk."""

from __future__ import annotations

import asyncio
import time
import types

from common.messages import ErrorCode, Tokens
from services.gateway.core.request_stream import RequestStream, StreamQueue


def test_a_cancelled_waiter_does_not_deafen_the_next_one():
    async def main() -> float:
        q = StreamQueue()
        consumer = asyncio.ensure_future(q.get_within(30))  # the client's generation
        await asyncio.sleep(0)
        drain = asyncio.ensure_future(q.get_within(30))  # the drain, started first ...
        await asyncio.sleep(0)
        consumer.cancel()  # ... then the consumer's task is cancelled
        await asyncio.sleep(0)
        t0 = time.monotonic()
        q.put_nowait(Tokens(request_id="r", tokens=[], index=0, finish_reason="abort"))
        got = await asyncio.wait_for(drain, 5)
        assert got.finish_reason == "abort" and q.final_at is not None
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0  # at once, not after the drain's own deadline


def test_a_waiter_times_out_with_none_and_later_items_still_arrive():
    async def main() -> None:
        q = StreamQueue()
        assert await q.get_within(0.01) is None
        q.put_nowait(Tokens(request_id="r", tokens=[1], index=0))
        got = await q.get_within(1)
        assert got.tokens == [1] and q.empty()

    asyncio.run(main())


def test_a_stream_ended_at_the_gateway_reads_as_rank_0s_final_chunk():
    async def main() -> None:
        s = RequestStream(types.SimpleNamespace(tokens_out=0), "r-1", prompt_len=3)
        s.end_here("error", "link closed", ErrorCode.RANK_LOST)
        body = await s.next(1)
        assert (body.request_id, body.finish_reason, body.error, body.error_code) \
            == ("r-1", "error", "link closed", ErrorCode.RANK_LOST)
        assert s.finished and s.finish_reason == "error" and s.queue.final_at is not None

    asyncio.run(main())
