"""PUB/SUB on real sockets (loopback tcp and ipc): sequence gaps, the slow-joiner
handshake (`wait_subscribed`) and acknowledged broadcasts (`AckCollector`) that re-send
until every peer acked and name the one that never did."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter

import pytest
import zmq
import zmq.asyncio

from common.bus import AckCollector, BusTimeout, Channel, GapTracker, configure, wait_subscribed
from common.envelope import Signer
from common.messages import CONTROL, REPORT, Cancel, CancelAck, Lease, Telemetry
from tests.support.bus import KEY, bind
from tests.support.polling import apoll_for

TOPIC = b"ctl:dep-1"

# --- PUB/SUB: gaps and slow joiners -----------------------------------------------------


class Pub:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, sender: str = "supervisor") -> None:
        self.sock = configure(ctx.socket(zmq.PUB))
        self.endpoint = bind(self.sock, endpoint)
        self.channel = Channel("test-pub", "control", sender=sender, send_key=KEY, accept=())

    async def publish(self, body, topic: bytes = TOPIC) -> None:
        await self.sock.send_multipart([topic, self.channel.pack(body)])


def lease(n: int) -> Lease:
    return Lease("dep-1", "job-1", n, 45.0, 0)


def sub_socket(ctx: zmq.asyncio.Context, endpoint: str, topic: bytes = TOPIC) -> zmq.asyncio.Socket:
    sock = configure(ctx.socket(zmq.SUB))
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(30)
async def test_pubsub_gap_detection(endpoints, actx):
    pub = Pub(actx, endpoints("control"))
    sub = sub_socket(actx, pub.endpoint)
    sub_ch = Channel("test-sub", "control", sender="rank-1", send_key=KEY, accept=CONTROL)
    gaps: list[tuple[str, int, int]] = []
    tracker = GapTracker(on_gap=lambda sender, prev, seq: gaps.append((sender, prev, seq)))

    async def receive():
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        return sub_ch.unpack_sub(frames, TOPIC)

    try:
        # Join: publish until one arrives (drops before the subscription are not gaps).
        while True:
            await pub.publish(lease(0))
            with contextlib.suppress(asyncio.TimeoutError):
                msg = await asyncio.wait_for(receive(), 0.05)
                if msg is not None:
                    break
        assert tracker.observe(msg) is False
        while await sub.poll(100):  # drain the extra hellos
            assert tracker.observe(await receive()) is False
        start = tracker.last[("supervisor", pub.channel.signer.boot)]

        await pub.publish(lease(1))  # seq start+1
        assert tracker.observe(await receive()) is False
        pub.channel.pack(lease(2))  # signed, never sent: lost
        await pub.publish(lease(3))
        m3 = await receive()
        assert m3.body.lease_seq == 3 and tracker.observe(m3) is True
        assert gaps == [("supervisor", start + 1, start + 3)]

        await pub.publish(lease(4), topic=b"ctl:dep-2")  # not subscribed: filtered by zmq
        await pub.publish(lease(5))
        assert tracker.observe(await receive()) is True
        await pub.publish(lease(6), topic=TOPIC + b"0")  # prefix match reaches the SUB...
        assert await receive() is None  # ...and the exact topic check drops it
        await pub.publish(lease(7))
        m7 = await receive()
        assert tracker.observe(m7) is True and m7.body.lease_seq == 7
        assert tracker.gaps == 3 and gaps[-1] == ("supervisor", start + 5, start + 7)
        assert sub_ch.rejects.snapshot() == {"bad_frames": 1}

        # A restarted publisher (same name, new boot, seq from 1) is no false gap.
        restarted = sub_ch.unpack(Signer(KEY, "supervisor").encode(lease(8)))
        assert restarted.header.seq == 1 and tracker.observe(restarted) is False
        assert tracker.gaps == 3
    finally:
        sub.close(0)
        pub.sock.close(0)


class Subscriber:
    """A rank-like subscriber: SUB on control; on a DEALER to the publisher's ROUTER it
    confirms every LEASE (hello) unless `confirm=False`, and acks every CANCEL from its
    `ack_after`-th copy on unless `ack=False`."""

    def __init__(self, ctx, pub_endpoint: str, reply_endpoint: str, rank: int, *,
                 confirm: bool = True, ack: bool = True, ack_after: int = 1) -> None:
        self.rank = rank
        self.confirm = confirm
        self.ack = ack
        self.ack_after = ack_after
        self.sub = sub_socket(ctx, pub_endpoint)
        self.dealer = configure(ctx.socket(zmq.DEALER))
        self.dealer.connect(reply_endpoint)
        self.channel = Channel("test-rank", "control", sender=f"rank-{rank}", send_key=KEY,
                               accept=CONTROL)
        self.seen: Counter[str] = Counter()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            msg = self.channel.unpack_sub(await self.sub.recv_multipart(), TOPIC)
            if msg is None:
                continue
            self.seen[msg.kind.value] += 1
            if isinstance(msg.body, Lease) and self.confirm:
                body = Telemetry("dep-1", "job-1", self.rank, os.getpid(), "starting", 0, 0, 0)
            elif (isinstance(msg.body, Cancel) and self.ack
                  and self.seen["cancel"] >= self.ack_after):
                body = CancelAck("dep-1", msg.body.epoch, self.rank, 41, msg.body.request_ids)
            else:
                continue
            await self.dealer.send(self.channel.pack(body))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sub.close(0)
        self.dealer.close(0)


class Reports:
    """The publisher's ROUTER where subscribers confirm and ack."""

    def __init__(self, ctx, endpoint: str) -> None:
        self.sock = configure(ctx.socket(zmq.ROUTER))
        self.endpoint = bind(self.sock, endpoint)
        self.channel = Channel("test-sup", "report", sender="supervisor", send_key=KEY,
                               accept=REPORT)

    async def next(self):
        got = self.channel.unpack_router(await self.sock.recv_multipart())
        return None if got is None else got[1]

    async def next_confirmation(self) -> str | None:
        msg = await self.next()
        return f"rank-{msg.body.rank}" if msg is not None and isinstance(msg.body, Telemetry) else None


async def close_all(pub: Pub, reports: Reports, subs: list[Subscriber]) -> None:
    for s in subs:
        await s.close()
    pub.sock.close(0)
    reports.sock.close(0)


@pytest.mark.timeout(30)
async def test_wait_subscribed_slow_joiner_handshake(endpoints, actx):
    pub = Pub(actx, endpoints("control"))
    reports = Reports(actx, endpoints("report"))
    subs = [Subscriber(actx, pub.endpoint, reports.endpoint, 1)]

    async def late_joiner():
        await asyncio.sleep(0.3)
        subs.append(Subscriber(actx, pub.endpoint, reports.endpoint, 2))

    joiner = asyncio.ensure_future(late_joiner())
    try:
        t0 = time.monotonic()
        result = await wait_subscribed(lambda: pub.publish(lease(0)), ["rank-1", "rank-2"],
                                       reports.next_confirmation, deadline_s=10, resend_s=0.05)
        assert time.monotonic() - t0 >= 0.3
        assert sorted(result.acked) == ["rank-1", "rank-2"] and result.missing == []
        assert result.sends >= 2  # re-published until the late joiner confirmed
        # Joined means joined: the very next message reaches every subscriber.
        await pub.publish(Cancel("dep-1", 1, "all"))
        await apoll_for(lambda: all(s.seen["cancel"] == 1 for s in subs), 5.0, "cancel seen")
    finally:
        joiner.cancel()
        await close_all(pub, reports, subs)


@pytest.mark.timeout(30)
async def test_wait_subscribed_names_the_peer_that_never_confirmed(endpoints, actx):
    pub = Pub(actx, endpoints("control"))
    reports = Reports(actx, endpoints("report"))
    good = Subscriber(actx, pub.endpoint, reports.endpoint, 1)
    mute = Subscriber(actx, pub.endpoint, reports.endpoint, 3, confirm=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(BusTimeout) as info:
            await wait_subscribed(lambda: pub.publish(lease(0)), ["rank-1", "rank-3", "rank-7"],
                                  reports.next_confirmation, deadline_s=0.8, resend_s=0.1)
        assert 0.75 <= time.monotonic() - t0 < 2.0
        assert "rank-3" in str(info.value) and "rank-7" in str(info.value)
        assert "rank-1" not in str(info.value)
        assert mute.seen["lease"] >= 1  # it heard us; it just never answered
    finally:
        await close_all(pub, reports, [good, mute])


@pytest.mark.timeout(30)
async def test_wait_subscribed_surfaces_a_broken_confirmation_source():
    async def broken() -> str | None:
        raise RuntimeError("socket gone")

    with pytest.raises(RuntimeError, match="socket gone"):
        await wait_subscribed(lambda: None, ["rank-1"], broken, deadline_s=0.3, resend_s=0.05)


@pytest.mark.timeout(30)
async def test_ack_collector_resends_until_acked_and_names_the_silent_peer(endpoints, actx):
    pub = Pub(actx, endpoints("control"))
    reports = Reports(actx, endpoints("report"))
    subs = [Subscriber(actx, pub.endpoint, reports.endpoint, 0),
            Subscriber(actx, pub.endpoint, reports.endpoint, 1, ack_after=3),
            Subscriber(actx, pub.endpoint, reports.endpoint, 2, ack=False)]
    await wait_subscribed(lambda: pub.publish(lease(0)), ["rank-0", "rank-1", "rank-2"],
                          reports.next_confirmation, deadline_s=10, resend_s=0.05)

    cancel = Cancel("dep-1", 7, "requests", ["r-1"], "test")
    collector = AckCollector(["0", "1", "2"], lambda: pub.publish(cancel))

    async def feed_acks():
        while True:
            msg = await reports.next()
            if msg is not None and isinstance(msg.body, CancelAck) and msg.body.epoch == 7:
                collector.ack(str(msg.body.rank), msg.body)

    feeder = asyncio.ensure_future(feed_acks())
    try:
        t0 = time.monotonic()
        result = await collector.run(deadline_s=1.0, resend_s=0.1)
        elapsed = time.monotonic() - t0
        assert result.missing == ["2"]
        assert sorted(result.acked) == ["0", "1"]
        assert result.acked["1"] == CancelAck("dep-1", 7, 1, 41, ["r-1"])
        assert subs[1].seen["cancel"] >= 3  # acked only after re-sends
        assert 0.95 <= elapsed < 2.0
        assert 3 <= result.sends <= 12  # re-sent every ~0.1 s, never after the deadline
        await apoll_for(lambda: subs[2].seen["cancel"] == result.sends,
                        5.0, "the silent rank hearing every copy")
    finally:
        feeder.cancel()
        await close_all(pub, reports, subs)


@pytest.mark.timeout(10)
async def test_ack_collector_done_at_once_and_forget():
    sends = []
    c = AckCollector([], lambda: sends.append(1))
    assert (await c.run(deadline_s=5)).sends == 0 and sends == []  # nobody to tell

    c = AckCollector(["a", "b"], lambda: sends.append(1))

    async def later():
        await asyncio.sleep(0.05)
        c.ack("a", {"step": 3})
        c.ack("zz")  # unknown peer: ignored
        c.forget("b")  # declared dead

    asyncio.ensure_future(later())
    t0 = time.monotonic()
    result = await c.run(deadline_s=5, resend_s=1.0)
    assert time.monotonic() - t0 < 1.0
    assert result.acked == {"a": {"step": 3}} and result.missing == []
