"""The reaper service's events PUB under raw TCP garbage: each connection that never
becomes ZeroMQ is counted and logged (`no_zmtp`), the service keeps running and keeps
publishing to real subscribers, and its counters go out on its events (for the
gateway's /metrics)."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys

import pytest
import zmq

from common.bus import Channel, configure
from common.keys import load_cluster_key
from common.messages import EVENTS
from services.gateway.core.cluster_view import _reject_rows
from tests.support.polling import poll_for
from tests.support.ports import free_port
from tests.support.processes import REPO, lockstep_env
from tests.support.supervisor import ensure_key
from tests.support.zmtp_garbage import SILENT


@pytest.mark.timeout(60)
def test_garbage_on_the_reaper_events_socket_is_counted_and_harmless(tmp_path):
    home = tmp_path / "home"
    ensure_key(home)
    port = free_port()
    log = tmp_path / "reaper.log"
    with open(log, "w") as err:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "services.reaper", "--home", str(home), "--interval", "0.3",
             "--events-port", str(port)], cwd=REPO, env=lockstep_env(), stderr=err)
    ctx = zmq.Context()
    sub = configure(ctx.socket(zmq.SUB))
    try:
        poll_for(lambda: "events PUB on" in log.read_text(), 30, "the reaper's events socket")
        rng = random.Random(5)  # fixed garbage: libzmq's verdict depends on the bytes
        # ... the last one libzmq takes for a ZMTP 1.0 peer and closes without any
        # handshake event: counted once the 5 s handshake window has passed.
        for payload in (rng.randbytes(200), b"GET / HTTP/1.1\r\n\r\n", rng.randbytes(64),
                        SILENT):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(payload)
        poll_for(lambda: log.read_text().count("reaper/events rejected a connection") >= 2, 20,
                 "the garbage connections to be logged")
        assert reaper.poll() is None
        # Still publishing: a real, signed pass report reaches a subscriber.
        chan = Channel("test", "events", sender="t", send_key=load_cluster_key(home / "keys" / "cluster.key"),
                       accept=EVENTS)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        # ... including its own rejection counters, which the gateway merges into
        # /metrics and status (the reaper has no admin socket to be asked).
        def counted_rows():
            if not sub.poll(100):
                return None
            msg = chan.unpack_sub(sub.recv_multipart(), b"events")
            if msg is None or (msg.body.topic, msg.body.name) != ("reaper", "rejections"):
                return None
            rows = _reject_rows(msg.body.data.get("rows"))
            return [r for r in rows if (r["socket"], r["reason"]) == ("events", "no_zmtp")
                    and r["count"] == 4]
        poll_for(counted_rows, 30, "the reaper's rejection counters on its events")
        assert "closed by libzmq without a ZMTP handshake" in log.read_text()
    finally:
        sub.close(0)
        ctx.term()
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(20) == 0
