"""Request-reply on real sockets (loopback tcp and ipc): deadlines that hold even with a
full send queue, recovery after a timeout or a late server, late replies dropped, and
bad replies skipped by the client."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import pytest
import zmq

from common import bus, rpc_client
from common.bus import BusTimeout, Channel, configure
from common.envelope import Signer
from common.messages import ADMIN_IN, AdminReply
from common.rpc_client import AsyncRpcClient, SyncRpcClient
from tests.support.bus import KEY, WRONG_KEY, bind, client_channel, request
from tests.support.polling import apoll_for, poll_for

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
    await apoll_for(lambda: server.served == 2, 5.0, "queued request served")


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
    await apoll_for(lambda: any("dropped late reply" in r.getMessage() and first.request_id
                                in r.getMessage() for r in caplog.records),
                    5.0, "late reply dropped")
    await apoll_for(lambda: server.served == 2, 5.0, "both answered")
    assert client._waiters == {}


@pytest.mark.timeout(30)
def test_sync_call_interrupted_ends_the_wait_long_before_its_deadline(endpoints, servers, sctx):
    # `lockstep up` waits up to minutes for a redeploy's stop; Ctrl-C must end that wait.
    server = servers(endpoints("admin"), answering=False)
    client = SyncRpcClient(sctx, server.endpoint, client_channel())
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(bus.BusInterrupted):
            client.call(request("held"), timeout=25.0, interrupted=stop.is_set)
        assert time.monotonic() - t0 < 10.0  # the slice, not the 25 s deadline, ended it
        assert len(server.received) == 1
        assert issubclass(bus.BusInterrupted, BusTimeout)  # callers reset the socket alike
    finally:
        timer.cancel()
        client.close()


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
        poll_for(lambda: server.served == 6, 5.0, "late and new requests answered", 0.01)
    finally:
        client.close()


@pytest.mark.timeout(30)
async def test_async_call_deadline_covers_a_full_send_queue(endpoints, aclients, monkeypatch):
    """Nobody listening and the send queue full: `call` still ends at its deadline."""
    monkeypatch.setattr(rpc_client, "configure", functools.partial(configure, hwm=1))
    client = aclients(endpoints("nobody"))
    for _ in range(4):
        t0 = time.monotonic()
        with pytest.raises(BusTimeout):
            await client.call(request(), timeout=0.2)
        assert time.monotonic() - t0 < 1.5


@pytest.mark.timeout(30)
def test_sync_call_deadline_covers_a_full_send_queue(endpoints, sctx, monkeypatch):
    monkeypatch.setattr(rpc_client, "configure", functools.partial(configure, hwm=1))
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
        await router.send_multipart([ident, forger.encode(AdminReply(req.request_id, False, "internal"))])
        await router.send_multipart([ident, server_ch.pack(AdminReply("r-other", False, "internal"))])
        await router.send_multipart([ident, good])
        reply = await call
        assert reply.body == AdminReply(req.request_id, True, "ok")
        assert client.channel.rejects.snapshot() == {"bad_frames": 1, "unknown_key": 1}
    finally:
        router.close(0)


# --- the reader callback: libzmq's FD is edge-triggered ------------------------------------


@pytest.mark.timeout(30)
async def test_async_stream_gets_replies_queued_before_it_started_and_across_sends(
        endpoints, actx, aclients):
    """Replies already queued when the client starts reading (their FD edge came before
    the reader existed), more than one callback's burst of them, and replies that arrive
    while the client keeps sending (a send can take the FD's edge): every one arrives,
    in order."""
    router = configure(actx.socket(zmq.ROUTER))
    endpoint = bind(router, endpoints("stream"))
    server_ch = Channel("stream", "admin", sender="server", send_key=KEY, accept=ADMIN_IN)
    client = AsyncRpcClient(actx, endpoint, client_channel(),
                            options={zmq.ROUTING_ID: b"reader-test"})
    burst = 3 * AsyncRpcClient.BURST
    try:
        # Connected but not reading (no loop reader yet): queue replies for its stream.
        await apoll_for(lambda: router.getsockopt(zmq.EVENTS) & zmq.POLLOUT, 5.0, "connected")
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sent = 0
        deadline = time.monotonic() + 5
        while sent < burst and time.monotonic() < deadline:
            try:
                await router.send_multipart([b"reader-test", server_ch.pack(
                    AdminReply("s", True, "ok", f"early-{sent}"))])
                sent += 1
            except zmq.ZMQError:  # EHOSTUNREACH until the handshake completed
                await asyncio.sleep(0.01)
        assert sent == burst
        await asyncio.sleep(0.2)  # all of them in the DEALER's queue, its FD edge gone
        q = client.open_stream("s")  # starts the reader
        got = [(await asyncio.wait_for(q.get(), 5)).body.message for _ in range(burst)]
        assert got == [f"early-{i}" for i in range(burst)]

        # Interleaved: the client sends while replies stream in.
        async def serve() -> None:
            for i in range(burst):
                await router.send_multipart([b"reader-test", server_ch.pack(
                    AdminReply("s", True, "ok", f"late-{i}"))])
                if i % 7 == 0:
                    await asyncio.sleep(0)

        server = asyncio.ensure_future(serve())
        for i in range(40):
            await client.send(request(f"ping-{i}"))
        late = [(await asyncio.wait_for(q.get(), 5)).body.message for _ in range(burst)]
        await server
        assert late == [f"late-{i}" for i in range(burst)]
        pings = 0
        while pings < 40:
            frames = await asyncio.wait_for(router.recv_multipart(), 5)
            pings += server_ch.unpack(frames[1]) is not None
        assert client.channel.rejects.snapshot() == {}
    finally:
        client.close()
        router.close(0)


@pytest.mark.timeout(30)
async def test_async_send_that_takes_the_fd_edge_still_delivers_the_queued_replies(
        endpoints, actx):
    """Replies reach the DEALER while the loop is busy; the next thing the client does is
    a send, which processes libzmq's commands and resets the FD, so the loop never sees
    it readable: the send's own look at the socket must find them."""
    router = configure(actx.socket(zmq.ROUTER))
    endpoint = bind(router, endpoints("edge"))
    server_ch = Channel("edge", "admin", sender="server", send_key=KEY, accept=ADMIN_IN)
    client = AsyncRpcClient(actx, endpoint, client_channel(),
                            options={zmq.ROUTING_ID: b"edge-test"})
    try:
        q = client.open_stream("s")
        await client.send(request("hello"))  # the server has seen us: the route exists
        await asyncio.wait_for(router.recv_multipart(), 5)
        for i in range(5):
            await router.send_multipart([b"edge-test", server_ch.pack(
                AdminReply("s", True, "ok", f"r-{i}"))])
        time.sleep(0.3)  # noqa: ASYNC251 - the loop must not run: replies arrive unseen
        await client.send(request("takes-the-edge"))
        got = [(await asyncio.wait_for(q.get(), 5)).body.message for _ in range(5)]
        assert got == [f"r-{i}" for i in range(5)]
    finally:
        client.close()
        router.close(0)


@pytest.mark.timeout(30)
async def test_async_send_waiting_for_room_goes_out_when_a_server_appears(
        endpoints, servers, aclients, monkeypatch):
    """A send queue of one, nobody listening: the second send waits for room (POLLOUT on
    the reader callback, not a timer); once a server binds, the queue drains and the
    waiting send goes out — both requests are answered."""
    monkeypatch.setattr(rpc_client, "configure", functools.partial(configure, hwm=1))
    endpoint = endpoints("late-room")
    client = aclients(endpoint)
    first, second = request("first"), request("second")
    await client.send(first)  # queued in the pipe
    waiting = asyncio.ensure_future(client.send(second))
    await asyncio.sleep(0.3)
    assert not waiting.done() and client._writable  # no room: it waits
    server = servers(endpoint)
    await asyncio.wait_for(waiting, 10)
    await apoll_for(lambda: server.served == 2, 10.0, "both requests served")


@pytest.mark.timeout(30)
async def test_async_stream_routed_through_the_owners_registry(endpoints, actx):
    """`route`: replies for an id the owner keeps in its own registry go there (the
    gateway's Backend.streams); once the owner drops the id, late ones are dropped."""
    router = configure(actx.socket(zmq.ROUTER))
    endpoint = bind(router, endpoints("route"))
    server_ch = Channel("route", "admin", sender="server", send_key=KEY, accept=ADMIN_IN)
    registry: dict[str, asyncio.Queue] = {"s": asyncio.Queue()}
    client = AsyncRpcClient(actx, endpoint, client_channel(),
                            options={zmq.ROUTING_ID: b"route-test"}, route=registry.get)
    try:
        q = registry["s"]
        await client.send(request("hello"))  # the server has seen us: the route exists
        await asyncio.wait_for(router.recv_multipart(), 5)
        await router.send_multipart([b"route-test", server_ch.pack(AdminReply("s", True, "ok", "a"))])
        assert (await asyncio.wait_for(q.get(), 5)).body.message == "a"
        del registry["s"]  # the owner's teardown: nothing else to close
        await router.send_multipart([b"route-test", server_ch.pack(AdminReply("s", True, "ok", "late"))])
        await asyncio.sleep(0.3)
        assert q.empty()
    finally:
        client.close()
        router.close(0)
