"""Held ZMTP connections, the cheap way: `python -m tests.faults.zmtp_hold < PLAN.json`.

Plain TCP sockets that speak just enough ZMTP 3.0 (NULL mechanism) by hand: one
descriptor per connection and full control over what is sent, so one process holds
thousands of them without reading anything back. The plan (JSON on stdin):

    {"targets": [{"endpoint": "tcp://127.0.0.1:PORT", "connections": N,
                  "mode": "greeting" | "held" | "frames", "frame": BYTES, "frames": K}],
     "seconds": S}

- greeting: the first 11 bytes of a greeting and nothing more (never completed);
- held: a complete handshake (greeting + READY as a DEALER), then silence;
- frames: a complete handshake, then up to K frames of BYTES each, written until the
  kernel pushes back (never blocking: the target decides how much it takes).

It prints {"ready": {endpoint: connections open}} once every connection is set up,
keeps the frames connections full for S seconds while holding them all, prints
{"done": {endpoint: bytes sent}} and exits, which closes every connection at once.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import struct
import sys
import time

GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


READY_BODY = b"\x05READY" + _prop(b"Socket-Type", b"DEALER")
READY = b"\x04" + bytes([len(READY_BODY)]) + READY_BODY


def frame(body: bytes) -> bytes:
    """One last (single-part) message frame."""
    if len(body) < 256:
        return b"\x00" + bytes([len(body)]) + body
    return b"\x02" + struct.pack(">Q", len(body)) + body


def _connect(endpoint: str) -> socket.socket:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    return s


def _push(s: socket.socket, data: bytes | memoryview) -> int:
    """Write what the kernel takes now, without blocking; bytes written."""
    try:
        return s.send(data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:  # the target dropped us
        return -1


def open_target(t: dict) -> list[socket.socket]:
    socks = []
    for _ in range(int(t["connections"])):
        s = _connect(t["endpoint"])
        if t["mode"] == "greeting":
            s.sendall(GREETING[:11])  # the signature and major version only: never complete
        else:
            s.sendall(GREETING + READY)
        s.setblocking(False)
        socks.append(s)
    return socks


class Writer:
    """Up to `frames` frames of `size` bytes on one connection, as fast as it takes them."""

    def __init__(self, s: socket.socket, size: int, frames: int) -> None:
        self.s, self.full, self.left = s, frame(b"\x00" * size), frames
        self.buf = memoryview(self.full)
        self.sent = 0

    def step(self) -> bool:
        """Write once; False when finished or dropped."""
        n = _push(self.s, self.buf)
        if n < 0:
            self.left = 0
            return False
        self.sent += n
        self.buf = self.buf[n:]
        if not self.buf:
            self.left -= 1
            self.buf = memoryview(self.full)
        return self.left > 0


def main() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    plan = json.load(sys.stdin)
    held: dict[str, list[socket.socket]] = {}
    writers: dict[str, list[Writer]] = {}
    for t in plan["targets"]:  # an endpoint may be named by several targets
        socks = open_target(t)
        held.setdefault(t["endpoint"], []).extend(socks)
        if t["mode"] == "frames":
            writers.setdefault(t["endpoint"], []).extend(
                Writer(s, int(t["frame"]), int(t.get("frames", 1))) for s in socks)
    print(json.dumps({"ready": {ep: len(s) for ep, s in held.items()}}), flush=True)
    sel = selectors.DefaultSelector()
    for ws in writers.values():
        for w in ws:
            sel.register(w.s, selectors.EVENT_WRITE, w)
    end = time.monotonic() + float(plan["seconds"])
    while (left := end - time.monotonic()) > 0:
        if not sel.get_map():
            time.sleep(min(0.2, left))
            continue
        for key, _ in sel.select(min(0.2, left)):
            if not key.data.step():
                sel.unregister(key.fileobj)
    sent = {ep: sum(w.sent for w in ws) for ep, ws in writers.items()}
    print(json.dumps({"done": sent}), flush=True)
    for socks in held.values():
        for s in socks:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
