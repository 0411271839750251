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

from common import bus
from common.bus import BusTimeout, Channel, SyncRpcClient, configure
from common.envelope import Signer
from common.messages import ADMIN_IN, AdminReply
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
        await router.send_multipart([ident, forger.encode(AdminReply(req.request_id, False, "internal"))])
        await router.send_multipart([ident, server_ch.pack(AdminReply("r-other", False, "internal"))])
        await router.send_multipart([ident, good])
        reply = await call
        assert reply.body == AdminReply(req.request_id, True, "ok")
        assert client.channel.rejects.snapshot() == {"bad_frames": 1, "unknown_key": 1}
    finally:
        router.close(0)
