"""ZmtpWatch: connections libzmq drops before any frame reaches the application (raw
bytes, an HTTP probe, a peer that never speaks) are counted as `no_zmtp`; real ZeroMQ
peers, including ones that connect and leave, are not; open connections are tracked,
and their closing schedules the release of freed memory. Listeners take nothing over
their cap: libzmq drops such a connection unread."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq

from common.bus import configure_listener
from common.envelope import RejectCounter
from common.memtrim import TRIM_AFTER_S, Reclaimer
from common.zmtp_watch import ZmtpWatch


class Listener:
    def __init__(self, sock_type: int, handshake_ivl_ms: int = 300) -> None:
        self.releases: list[float] = []
        self.ctx = zmq.Context()
        self.sock = configure_listener(self.ctx.socket(sock_type), max_size=4096)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ivl_ms)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.counter = RejectCounter("test", "listener")
        self.watch = ZmtpWatch(self.sock, self.counter, Reclaimer(
            lambda: bool(self.releases.append(time.monotonic()))))

    def pump_until(self, ok, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, (self.counter.snapshot(), self.watch.open)
            if self.watch.monitor.poll(50):
                self.watch.drain()

    def raw(self, payload: bytes) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as c:
            c.sendall(payload)

    def close(self) -> None:
        self.watch.close()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def router():
    lis = Listener(zmq.ROUTER)
    yield lis
    lis.close()


def count(lis: Listener) -> int:
    return lis.counter.snapshot().get("no_zmtp", 0)


@pytest.mark.timeout(30)
def test_raw_bytes_and_http_probes_are_counted(router):
    router.raw(os.urandom(256))
    router.raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    router.pump_until(lambda: count(router) == 2 and router.watch.open == 0)
    assert router.counter.snapshot() == {"no_zmtp": 2}


@pytest.mark.timeout(30)
def test_a_silent_connection_is_counted_when_the_handshake_times_out(router):
    c = socket.create_connection(("127.0.0.1", router.port), timeout=2)
    try:
        router.pump_until(lambda: router.watch.open == 1)
        # HANDSHAKE_IVL (300 ms here) passes; libzmq closes it; the watch counts it.
        router.pump_until(lambda: count(router) == 1 and router.watch.open == 0)
    finally:
        c.close()


@pytest.mark.timeout(30)
def test_real_zeromq_peers_are_not_counted(router):
    ctx = zmq.Context()
    try:
        for _ in range(5):
            d = ctx.socket(zmq.DEALER)
            d.connect(f"tcp://127.0.0.1:{router.port}")
            d.send(b"hello")
            assert router.sock.poll(5000)
            router.sock.recv_multipart()
            d.close(linger=0)
        router.pump_until(lambda: router.watch.open == 0)
        assert count(router) == 0
        router.raw(os.urandom(64))  # and the watch still works after them
        router.pump_until(lambda: count(router) == 1)
    finally:
        ctx.term()


@pytest.mark.timeout(30)
def test_a_pub_socket_counts_garbage_too():
    lis = Listener(zmq.PUB)
    try:
        lis.raw(os.urandom(128))
        lis.pump_until(lambda: count(lis) == 1)
    finally:
        lis.close()


@pytest.mark.timeout(30)
def test_closed_connections_schedule_a_memory_release(router):
    ctx = zmq.Context()
    try:
        assert router.watch.tick(time.monotonic()) == float("inf")  # nothing closed yet
        peers = [ctx.socket(zmq.DEALER) for _ in range(20)]
        for d in peers:
            d.connect(f"tcp://127.0.0.1:{router.port}")
        router.pump_until(lambda: router.watch.open == 20)
        for d in peers:
            d.close(linger=0)
        router.pump_until(lambda: router.watch.open == 0)
        closed_at = time.monotonic()
        due = router.watch.tick(closed_at)
        assert router.releases == [] and closed_at < due <= closed_at + TRIM_AFTER_S[0]
        router.pump_until(lambda: router.watch.tick(time.monotonic()) and router.releases)
        assert router.releases[0] >= due
    finally:
        ctx.term()


@pytest.mark.timeout(30)
def test_a_frame_over_the_cap_drops_the_connection_unread(router):
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped means gone: no reconnect to count
        big.connect(f"tcp://127.0.0.1:{router.port}")
        router.pump_until(lambda: router.watch.open == 1)
        big.send(b"x" * 4097)  # the listener's cap is 4096
        router.pump_until(lambda: router.watch.open == 0)  # libzmq dropped it
        assert not router.sock.poll(200)  # nothing delivered
        ok = ctx.socket(zmq.DEALER)
        ok.connect(f"tcp://127.0.0.1:{router.port}")
        ok.send(b"y" * 4096)
        assert router.sock.poll(5000)
        assert router.sock.recv_multipart()[1] == b"y" * 4096
        big.close(linger=0)
        ok.close(linger=0)
    finally:
        ctx.term()
