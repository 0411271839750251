"""Shared pieces of the bus tests on real sockets (tests/integration/test_bus_*.py): the
test key, request and channel makers, and an admin-style ROUTER server on its own
thread. Their fixtures are in tests/integration/conftest.py."""

from __future__ import annotations

import threading

import zmq

from common.bus import Channel, configure, new_request_id
from common.envelope import DEFAULT_MAX_SIZE, Key
from common.messages import ADMIN_IN, ADMIN_OUT, AdminReply, AdminRequest

KEY = Key.from_secret(b"c" * 32)
WRONG_KEY = Key.from_secret(b"w" * 32)


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

