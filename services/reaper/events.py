"""The reaper's events PUB: signed `Event`s under topic frame b"events" (protocol.md).

Publishing is fire-and-forget; a subscriber that joins late misses earlier passes, and
each pass publishes its whole report, so nothing depends on one message arriving.
"""

from __future__ import annotations

import os
import socket
import time

import zmq

from common.bus import PUB_MAX_SIZE, Channel, configure_listener
from common.envelope import REGISTRY, Key
from common.messages import EVENTS, Event, EventName, EventTopic
from common.zmtp_watch import ZmtpWatch

TOPIC = b"events"


class EventPublisher:
    def __init__(self, key: Key, host: str, port: int, *, ctx: zmq.Context | None = None) -> None:
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.channel = Channel("reaper", "events",
                               sender=f"reaper:{socket.gethostname()}:{os.getpid()}",
                               send_key=key, accept=EVENTS)
        # A listener: the 5 s greeting deadline, the per-connection bounds (subscriptions).
        self.sock = configure_listener(self.ctx.socket(zmq.PUB), max_size=PUB_MAX_SIZE)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = f"tcp://{host}:{self.port}"
        # Connections libzmq closes before any frame (raw bytes, silence) are counted.
        self.watch = ZmtpWatch(self.sock, self.channel.rejects)

    def publish_rejections(self) -> None:
        """This process's rejection counters (its events socket), for the gateway's
        /metrics: the reaper has no admin socket of its own to be asked."""
        rows = [r for r in REGISTRY.snapshot() if r["service"] == "reaper"]
        self.publish(Event(topic=EventTopic.REAPER, name=EventName.REJECTIONS, deployment_id="",
                           state=None, at=time.time(), data={"rows": rows}))

    def publish(self, event: Event) -> None:
        self.sock.send_multipart([TOPIC, self.channel.pack(event)], flags=zmq.NOBLOCK)

    def close(self) -> None:
        if hasattr(self, "watch"):
            self.watch.close()
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()
