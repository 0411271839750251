"""The reaper service's events PUB under raw TCP garbage: each connection that never
becomes ZeroMQ is counted and logged (`no_zmtp`), and the service keeps running and
keeps publishing to real subscribers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import zmq

from common.bus import Channel, configure
from common.keys import load_cluster_key
from common.messages import EVENTS
from tests.support.polling import poll_for
from tests.support.ports import free_port
from tests.support.processes import REPO, lockstep_env
from tests.support.supervisor import ensure_key


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
        for payload in (os.urandom(200), b"GET / HTTP/1.1\r\n\r\n", os.urandom(64)):
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
        poll_for(lambda: sub.poll(100) and chan.unpack_sub(sub.recv_multipart(), b"events"), 20,
                 "a signed event from the reaper after the garbage")
    finally:
        sub.close(0)
        ctx.term()
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(20) == 0
