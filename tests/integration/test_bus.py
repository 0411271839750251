"""The bus on real sockets (loopback tcp and ipc): deadlines, recovery, gaps, slow
joiners, acknowledged broadcasts, size caps and forged traffic on a live ROUTER."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common import bus
from common.bus import (
    AckCollector,
    AsyncRpcClient,
    BusTimeout,
    Channel,
    GapTracker,
    SyncRpcClient,
    configure,
    new_request_id,
    wait_subscribed,
)
from common.envelope import DEFAULT_MAX_SIZE, Key, Signer
from common.messages import (
    ADMIN_IN,
    ADMIN_OUT,
    CONTROL,
    REPORT,
    AdminReply,
    AdminRequest,
    Cancel,
    CancelAck,
    Lease,
    Telemetry,
)

KEY = Key.from_secret(b"c" * 32)
WRONG_KEY = Key.from_secret(b"w" * 32)
TRANSPORTS = ["tcp", "ipc"]
TOPIC = b"ctl:dep-1"


def poll_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def apoll_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="ls-", dir="/tmp")  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture
def endpoints(transport, ipc_dir):
    """endpoints(name) -> a fresh endpoint of this test's transport, not yet bound."""
    def make(name: str) -> str:
        if transport == "tcp":
            return f"tcp://127.0.0.1:{free_port()}"
        return f"ipc://{ipc_dir}/{name}"
    return make


def bind(sock: zmq.Socket, endpoint: str) -> str:
    sock.bind(endpoint)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def client_channel(name: str = "client", key: Key = KEY) -> Channel:
    return Channel("test-client", "admin", sender=name, send_key=key, accept=ADMIN_OUT)


def request(command: str = "status", **args) -> AdminRequest:
    return AdminRequest(new_request_id(), command, dict(args))


class RouterServer:
    """An admin-style ROUTER on its own thread. Answers ADMIN_REQUESTs while `answering`
    is set; otherwise holds them (they can be answered late with `release_held`)."""

    def __init__(self, endpoint: str, *, answering: bool = True, max_size: int = DEFAULT_MAX_SIZE,
                 monitor: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = configure(self.ctx.socket(zmq.ROUTER), max_size=max_size)
        self.monitor = self.sock.get_monitor_socket() if monitor else None
        self.endpoint = bind(self.sock, endpoint)
        self.channel = Channel("test-server", "admin", sender="server", send_key=KEY,
                               accept=ADMIN_IN, max_size=max_size)
        self.answering = threading.Event()
        if answering:
            self.answering.set()
        self.received: list[str] = []
        self.served = 0
        self.held: list[tuple[bytes, AdminRequest]] = []
        self._release = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-server", daemon=True)
        self._thread.start()

    def _reply(self, ident: bytes, req: AdminRequest) -> None:
        reply = AdminReply(req.request_id, True, "ok", data={"command": req.command})
        self.sock.send_multipart([ident, self.channel.pack(reply)])
        self.served += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._release.is_set():
                self._release.clear()
                for ident, req in self.held:
                    self._reply(ident, req)
                self.held.clear()
            if not self.sock.poll(10):
                continue
            got = self.channel.unpack_router(self.sock.recv_multipart())
            if got is None:
                continue  # counted and logged by the channel; keep serving
            ident, msg = got
            self.received.append(msg.body.request_id)
            if self.answering.is_set():
                self._reply(ident, msg.body)
            else:
                self.held.append((ident, msg.body))

    def release_held(self) -> None:
        self._release.set()

    def rejects(self) -> dict[str, int]:
        return self.channel.rejects.snapshot()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def servers():
    made: list[RouterServer] = []

    def start(endpoint: str, **kw) -> RouterServer:
        s = RouterServer(endpoint, **kw)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


@pytest.fixture
async def actx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def sctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def aclients(actx):
    made: list[AsyncRpcClient] = []

    def make(endpoint: str, channel: Channel | None = None) -> AsyncRpcClient:
        c = AsyncRpcClient(actx, endpoint, channel or client_channel())
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    await asyncio.sleep(0)


# --- request-reply: deadlines and recovery ----------------------------------------------


@pytest.mark.timeout(30)
async def test_async_call_times_out_then_recovers(endpoints, servers, aclients):
    server = servers(endpoints("admin"), answering=False)
    client = aclients(server.endpoint)
    t0 = time.monotonic()
    with pytest.raises(BusTimeout, match="within 0.3s"):
        await client.call(request(), timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.29 <= elapsed < 1.5, elapsed
    assert len(server.received) == 1  # it arrived; nobody answered

    server.answering.set()
    for i in range(5):  # the same client, no socket recreated: no REQ-style lockup
        req = request(f"cmd-{i}")
        reply = await client.call(req, timeout=5)
        assert reply.body.request_id == req.request_id and reply.body.data == {"command": f"cmd-{i}"}
    assert client._waiters == {}
    assert client.channel.rejects.snapshot() == {} and server.rejects() == {}


@pytest.mark.timeout(30)
async def test_async_call_before_server_exists_then_recovers(endpoints, servers, aclients):
    endpoint = endpoints("late")
    client = aclients(endpoint)
    with pytest.raises(BusTimeout):
        await client.call(request(), timeout=0.3)
    server = servers(endpoint)
    req = request("after-start")
    reply = await client.call(req, timeout=10)
    assert reply.body.request_id == req.request_id
    # The request queued while the server was down is answered too, and dropped unseen.
    await apoll_until(lambda: server.served == 2, what="queued request served")


@pytest.mark.timeout(30)
async def test_async_late_reply_is_dropped(endpoints, servers, aclients, caplog):
    caplog.set_level(logging.DEBUG, logger="lockstep.bus")
    server = servers(endpoints("admin"), answering=False)
    client = aclients(server.endpoint)
    first = request("slow")
    with pytest.raises(BusTimeout):
        await client.call(first, timeout=0.3)

    server.answering.set()
    server.release_held()  # the late reply for `first` goes out just before our next call
    second = request("fast")
    reply = await client.call(second, timeout=5)
    assert reply.body.request_id == second.request_id
    await apoll_until(lambda: any("dropped late reply" in r.getMessage() and first.request_id
                                  in r.getMessage() for r in caplog.records),
                      what="late reply dropped")
    await apoll_until(lambda: server.served == 2, what="both answered")
    assert client._waiters == {}


@pytest.mark.timeout(30)
def test_sync_call_times_out_then_recovers(endpoints, servers, sctx):
    server = servers(endpoints("admin"), answering=False)
    client = SyncRpcClient(sctx, server.endpoint, client_channel())
    try:
        slow = request("slow")
        t0 = time.monotonic()
        with pytest.raises(BusTimeout):
            client.call(slow, timeout=0.3)
        assert 0.29 <= time.monotonic() - t0 < 1.5

        server.answering.set()
        server.release_held()  # late reply for `slow` arrives before/while we wait
        for i in range(5):
            req = request(f"cmd-{i}")
            assert client.call(req, timeout=5).body.request_id == req.request_id
        poll_until(lambda: server.served == 6, what="late and new requests answered")
    finally:
        client.close()


@pytest.mark.timeout(30)
async def test_async_call_deadline_covers_a_full_send_queue(endpoints, aclients, monkeypatch):
    """Nobody listening and the send queue full: `call` still ends at its deadline."""
    monkeypatch.setattr(bus, "configure", functools.partial(configure, hwm=1))
    client = aclients(endpoints("nobody"))
    for _ in range(4):
        t0 = time.monotonic()
        with pytest.raises(BusTimeout):
            await client.call(request(), timeout=0.2)
        assert time.monotonic() - t0 < 1.5


@pytest.mark.timeout(30)
def test_sync_call_deadline_covers_a_full_send_queue(endpoints, sctx, monkeypatch):
    monkeypatch.setattr(bus, "configure", functools.partial(configure, hwm=1))
    client = SyncRpcClient(sctx, endpoints("nobody"), client_channel())
    try:
        for _ in range(4):
            t0 = time.monotonic()
            with pytest.raises(BusTimeout):
                client.call(request(), timeout=0.2)
            assert time.monotonic() - t0 < 1.5
    finally:
        client.close()


@pytest.mark.timeout(30)
async def test_async_client_skips_bad_replies(endpoints, actx, aclients):
    """A misbehaving server: wrong frame count, wrong key, someone else's request id —
    all skipped (bad ones counted), and the real reply is returned."""
    router = configure(actx.socket(zmq.ROUTER))
    endpoint = bind(router, endpoints("rogue"))
    server_ch = Channel("rogue", "admin", sender="server", send_key=KEY, accept=ADMIN_IN)
    forger = Signer(WRONG_KEY, "server")
    client = aclients(endpoint)
    try:
        req = request()
        call = asyncio.ensure_future(client.call(req, timeout=5))
        ident, frame = await asyncio.wait_for(router.recv_multipart(), 5)
        assert server_ch.unpack(frame).body == req
        good = server_ch.pack(AdminReply(req.request_id, True, "ok"))
        await router.send_multipart([ident, b"junk", good])
        await router.send_multipart([ident, forger.encode(AdminReply(req.request_id, False, "x"))])
        await router.send_multipart([ident, server_ch.pack(AdminReply("r-other", False, "x"))])
        await router.send_multipart([ident, good])
        reply = await call
        assert reply.body == AdminReply(req.request_id, True, "ok")
        assert client.channel.rejects.snapshot() == {"bad_frames": 1, "unknown_key": 1}
    finally:
        router.close(0)


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
        await apoll_until(lambda: all(s.seen["cancel"] == 1 for s in subs), what="cancel seen")
    finally:
        joiner.cancel()
        for s in subs:
            await s.close()
        pub.sock.close(0)
        reports.sock.close(0)


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
        await good.close()
        await mute.close()
        pub.sock.close(0)
        reports.sock.close(0)


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
        await apoll_until(lambda: subs[2].seen["cancel"] == result.sends,
                          what="the silent rank hearing every copy")
    finally:
        feeder.cancel()
        for s in subs:
            await s.close()
        pub.sock.close(0)
        reports.sock.close(0)


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


# --- ROUTER robustness ------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_router_counts_wrong_frame_counts_and_keeps_serving(endpoints, servers, actx, aclients):
    server = servers(endpoints("admin"))
    rogue = configure(actx.socket(zmq.DEALER))
    rogue.connect(server.endpoint)
    ch = client_channel("rogue")
    try:
        await rogue.send_multipart([b"", ch.pack(request())])  # REQ-style empty delimiter
        await rogue.send_multipart([b"x", b"y", ch.pack(request())])
        await rogue.send_multipart([ch.pack(request()), b"tail"])
        await apoll_until(lambda: server.rejects().get("bad_frames") == 3, what="bad_frames")
        client = aclients(server.endpoint)
        req = request()
        assert (await client.call(req, timeout=5)).body.request_id == req.request_id
        assert server.rejects() == {"bad_frames": 3}
        assert not await rogue.poll(100)  # nothing was answered to the rogue
    finally:
        rogue.close(0)


@pytest.mark.timeout(30)
async def test_oversize_frame_dropped_by_libzmq_and_service_continues(endpoints, servers, actx,
                                                                     aclients):
    cap = 64 * 1024
    server = servers(endpoints("admin"), max_size=cap, monitor=True)
    rogue = actx.socket(zmq.DEALER)  # not `configure`d: this peer ignores the cap
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(server.endpoint)
    try:
        big = client_channel("rogue").pack(request(blob="x" * (cap + 1024)))
        assert len(big) > cap
        await rogue.send(big)
        events = []

        def disconnected() -> bool:
            while server.monitor.poll(0):
                events.append(recv_monitor_message(server.monitor)["event"])
            return zmq.EVENT_DISCONNECTED in events

        await apoll_until(disconnected, what="libzmq disconnecting the oversize peer")
        # Dropped unread: never reached the verifier, never counted, never served.
        assert server.received == [] and server.rejects() == {}

        client = aclients(server.endpoint, client_channel())
        near = request(blob="y" * (cap - 1024))  # just under the cap: served
        assert (await client.call(near, timeout=5)).body.request_id == near.request_id
        for _ in range(3):
            req = request()
            assert (await client.call(req, timeout=5)).body.request_id == req.request_id
        await apoll_until(lambda: server.served == 4, what="all served")
    finally:
        rogue.close(0)


@pytest.mark.timeout(60)
async def test_forged_frames_on_a_live_router_are_counted_while_a_client_is_served(
        endpoints, servers, actx, aclients):
    server = servers(endpoints("admin"))
    forger = configure(actx.socket(zmq.DEALER))
    forger.connect(server.endpoint)
    wrong_key = Signer(WRONG_KEY, "gateway")
    sniffed_req = request("sniffed")
    sniffed = client_channel("gateway").pack(sniffed_req)  # a real client's frame
    valid = client_channel("gateway").pack(request("template"))
    flipped = valid[:-5] + bytes([valid[-5] ^ 0x40]) + valid[-4:]
    rounds = 100
    plan = {
        "unknown_key": lambda i: wrong_key.encode(request("stop")),
        "bad_mac": lambda i: flipped,
        "bad_magic": lambda i: b"XX" + os.urandom(78),
        "too_short": lambda i: b"LS",
        "replay": lambda i: sniffed,
    }
    expected = {reason: rounds for reason in plan}
    expected["replay"] = rounds - 1  # the first copy of the sniffed frame is genuine

    async def forge():
        for i in range(rounds):
            for make in plan.values():
                await forger.send(make(i))
            await asyncio.sleep(0.001)

    client = aclients(server.endpoint)
    attack = asyncio.ensure_future(forge())
    try:
        served = 0
        while not attack.done() or served < 20:
            req = request(f"real-{served}")
            reply = await client.call(req, timeout=5)
            assert reply.body.request_id == req.request_id
            served += 1
        await attack
        await apoll_until(lambda: sum(server.rejects().values()) == sum(expected.values()),
                          timeout=15, what="every forged frame counted")
        assert server.rejects() == expected
        assert server.received.count(sniffed_req.request_id) == 1
        await apoll_until(lambda: server.served == served + 1, what="all served")  # + sniffed
        assert served >= 20
        assert client.channel.rejects.snapshot() == {}
    finally:
        attack.cancel()
        forger.close(0)
