"""A live ROUTER under abuse (loopback tcp and ipc): wrong frame counts, oversize frames
dropped by libzmq, and forged frames counted by reason while a real client is served."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.bus import configure
from common.envelope import Signer
from tests.support.bus import WRONG_KEY, client_channel, request
from tests.support.polling import apoll_for

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
        await apoll_for(lambda: server.rejects().get("bad_frames") == 3, 5.0, "bad_frames")
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

        await apoll_for(disconnected, 5.0, "libzmq disconnecting the oversize peer")
        # Dropped unread: never reached the verifier, never counted, never served.
        assert server.received == [] and server.rejects() == {}

        client = aclients(server.endpoint, client_channel())
        near = request(blob="y" * (cap - 1024))  # just under the cap: served
        assert (await client.call(near, timeout=5)).body.request_id == near.request_id
        for _ in range(3):
            req = request()
            assert (await client.call(req, timeout=5)).body.request_id == req.request_id
        await apoll_for(lambda: server.served == 4, 5.0, "all served")
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
        await apoll_for(lambda: sum(server.rejects().values()) == sum(expected.values()),
                        15, "every forged frame counted")
        assert server.rejects() == expected
        assert server.received.count(sniffed_req.request_id) == 1
        await apoll_for(lambda: server.served == served + 1, 5.0, "all served")  # + sniffed
        assert served >= 20
        assert client.channel.rejects.snapshot() == {}
    finally:
        attack.cancel()
        forger.close(0)
