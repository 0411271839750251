"""A real gateway Backend in front of a rank-0 stand-in (a ROUTER with rank 0's own cache
feed, services/rank/cache_feed.py): the Backend subscribes by itself, gets a snapshot of
what was cached before it connected, then every change pushed; a push lost on the way
shows as a gap and the snapshot it asks for makes its index equal rank 0's again."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from common import messages as m
from common.bus import Channel
from services.gateway.core.request_channel import Backend
from services.rank.cache_feed import CacheFeed
from services.rank.prefix_cache import CachePlanner
from tests.support.bus import KEY
from tests.support.deployment import deployment_info
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)


class Rank0:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(endpoint)
        self.chan = Channel("rank", "requests", sender="d-1/rank-0", send_key=KEY,
                            accept=m.REQUESTS_IN)
        self.drop_next = False
        self.feed = CacheFeed(self.chan.pack, self._send)
        self.planner = CachePlanner(3, 10**6, True)
        self.subscribes = 0

    def _send(self, ident: bytes, data: bytes) -> int:
        if self.drop_next:  # a push lost on the way (as to a full pipe)
            self.drop_next = False
            return 0
        try:
            self.sock.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc.errno
        return 0

    def plan(self, *finished: tuple[str, list[int]]) -> None:
        for rid, tokens in finished:
            self.planner.finished(rid, tokens, 100)
        self.feed.on_ops(self.planner.take_ops(), self.planner.taken_tokens)

    async def serve(self) -> None:
        while True:
            while self.sock.poll(0):
                got = self.chan.unpack_router(self.sock.recv_multipart())
                if got is not None and isinstance(got[1].body, m.CacheSubscribe):
                    self.subscribes += 1
                    self.feed.on_subscribe(got[0], got[1].body)
            await asyncio.sleep(0.005)

    def held(self) -> dict[int, int]:
        return {eid: len(e.tokens) for eid, e in self.planner.index.items()}

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


async def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_a_backend_follows_rank_0s_cache_through_a_late_start_and_a_lost_push():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rank0 = Rank0(endpoint)
    conv = list(range(10, 50))
    rank0.plan(("before", conv))  # cached before the gateway connects
    server = asyncio.get_running_loop().create_task(rank0.serve())
    ctx = zmq.asyncio.Context()
    b = Backend(ctx, deployment_info(requests_endpoint=endpoint), key=KEY)
    try:
        idx = b.cache_index
        await until(lambda: idx.synced and idx.view() == rank0.held(), 10, "the first snapshot")
        assert idx.longest_prefix(conv + [1]) == 40
        rank0.plan(("turn-2", conv + [7, 8, 9]))
        await until(lambda: idx.view() == rank0.held() == {2: 43}, 5, "the extension")
        assert idx.resyncs == 1 and idx.applied == 1 and idx.gaps == 0
        rank0.drop_next = True
        rank0.plan(("lost", list(range(100, 130))))
        rank0.plan(("next", list(range(200, 230))))  # its seq is one past what arrived
        await until(lambda: idx.gaps == 1 and idx.synced and idx.view() == rank0.held(), 10,
                    "the resync after the gap")
        assert idx.resyncs == 2 and rank0.subscribes == 2
        for i in range(4):  # LRU evictions through the 3-entry budget
            rank0.plan((f"more-{i}", list(range(300 + 40 * i, 330 + 40 * i))))
        await until(lambda: idx.view() == rank0.held() and idx.seq == rank0.feed.log.seq, 5,
                    "the evictions")
        assert len(idx.view()) == 3
    finally:
        server.cancel()
        b.close()
        ctx.destroy(linger=0)
        rank0.close()
