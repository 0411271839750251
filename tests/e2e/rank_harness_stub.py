"""The harness's side of the sockets (tests/e2e/rank_harness.py): one thread owns the
control PUB, the report ROUTER and the requests DEALER. It publishes LEASE every 0.5 s,
answers each rank's report handshake (common.handshake), then collects RANK_READY /
TELEMETRY / CANCEL_ACK from authenticated ranks, re-sends cancels until every live rank
acked, and routes TOKENS into per-request streams."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

import zmq

from common import messages as m
from common.bus import PUB_MAX_SIZE, Channel, configure, configure_listener
from common.handshake import Gate, Responder, session_keys

if TYPE_CHECKING:
    from tests.e2e.rank_harness import Deployment


class Stub(threading.Thread):
    def __init__(self, d: Deployment) -> None:
        super().__init__(name="harness-stub", daemon=True)
        self.d = d
        self.ctx = zmq.Context()
        k = d.keys
        self.ctl = Channel("harness", "control", sender="supervisor", send_key=k.control)
        self.rep = Channel("harness", "report", sender="supervisor", send_key=k.report,
                           accept=m.REPORT)
        self.req = Channel("harness", "requests", sender="gateway", send_key=k.requests,
                           accept=m.REQUESTS_OUT)
        self.pub = configure(self.ctx.socket(zmq.PUB), max_size=PUB_MAX_SIZE)
        self.pub.bind(d.control_endpoint)
        self.router = configure_listener(self.ctx.socket(zmq.ROUTER), max_size=256 * 1024)
        self.router.bind(d.report_endpoint)
        # Like the supervisor: a rank's reports count only after the session handshake.
        self.gate = Gate(self.rep, Responder("report", d.deployment_id, d.job_id,
                                             range(d.world), lambda r: session_keys(k, r)),
                              self._send_report)
        self.dealer = configure(self.ctx.socket(zmq.DEALER))
        self.dealer.connect(d.requests_endpoint)
        addr = f"inproc://harness-{id(self)}"
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(addr)
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(addr)
        self.cmds: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.ready: dict[int, m.RankReady] = {}
        self.telemetry: dict[int, m.Telemetry] = {}
        self.acks: dict[int, dict[int, m.CancelAck]] = collections.defaultdict(dict)
        self.streams: dict[str, list[m.Tokens]] = collections.defaultdict(list)
        # rank 0's "still waiting" heartbeats (Tokens.waiting), kept out of `streams`
        self.heartbeats: collections.Counter[str] = collections.Counter()
        self.batches = 0  # TOKENS_BATCH messages (several streams' chunks in one)
        self.ended: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.stats: dict[str, m.Stats] = {}
        self.resend: dict[int, tuple[m.Cancel, float]] = {}  # epoch → (cancel, until)
        self.lease_seq = 0
        self.leases_paused = False
        self.stopped = False

    def post(self, *cmds: tuple) -> None:
        with self.cv:
            self.cmds.extend(cmds)
            self.wake_tx.send(b"")

    def publish(self, body) -> None:
        self.pub.send_multipart([self.d.topic, self.ctl.pack(body)])

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.router, self.dealer, self.wake_rx):
            poller.register(s, zmq.POLLIN)
        next_lease = next_resend = 0.0
        while not self.stopped:
            now = time.monotonic()
            if now >= next_lease and not self.leases_paused:
                next_lease = now + 0.5
                self.lease_seq += 1
                self.publish(m.Lease(self.d.deployment_id, self.d.job_id, self.lease_seq,
                                     45.0, self.d.lease_epoch))
            if now >= next_resend:
                next_resend = now + 0.25
                for epoch, (c, until) in list(self.resend.items()):
                    live = self.d.live_ranks()
                    if now > until or live <= set(self.acks[epoch]):
                        del self.resend[epoch]
                    else:
                        self.publish(c)
            ready = dict(poller.poll(100))
            if self.router in ready:
                self._drain(self.router, self._on_report)
            if self.dealer in ready:
                self._drain(self.dealer, self._on_requests)
            if self.wake_rx in ready:
                self._drain(self.wake_rx, lambda _f: None)
            with self.cv:
                cmds, self.cmds = list(self.cmds), collections.deque()
            for cmd in cmds:
                if cmd[0] == "req":
                    self.dealer.send(self.req.pack(cmd[1]))
                elif cmd[0] == "pub":
                    self.publish(cmd[1])
                elif cmd[0] == "cancel":
                    self.resend[cmd[1].epoch] = (cmd[1], time.monotonic() + cmd[2])
                    self.publish(cmd[1])
                    next_resend = time.monotonic() + 0.25
        for s in (self.pub, self.router, self.dealer, self.wake_rx, self.wake_tx):
            s.close(0)

    def _drain(self, sock, handler) -> None:
        while True:
            try:
                handler(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _send_report(self, ident: bytes, body) -> None:
        try:
            self.router.send_multipart([ident, self.rep.pack(body)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _on_report(self, frames) -> None:
        got = self.gate.admit(frames)
        if got is None:
            return
        body = got[1].body
        with self.cv:
            if isinstance(body, m.RankReady):
                self.ready[body.rank] = body
            elif isinstance(body, m.Telemetry):
                self.telemetry[body.rank] = body
            elif isinstance(body, m.CancelAck):
                self.acks[body.epoch][body.rank] = body
            self.cv.notify_all()

    def _on_requests(self, frames) -> None:
        msg = self.req.unpack_dealer(frames)
        if msg is None:
            return
        with self.cv:
            if isinstance(msg.body, (m.Tokens, m.TokensBatch)):
                chunks = msg.body.chunks if isinstance(msg.body, m.TokensBatch) else [msg.body]
                self.batches += isinstance(msg.body, m.TokensBatch)
                for c in chunks:
                    if c.waiting:
                        self.heartbeats[c.request_id] += 1
                        continue
                    self.streams[c.request_id].append(c)
                    if c.finish_reason is not None:
                        self.ended[c.request_id].set()
            elif isinstance(msg.body, m.Stats):
                self.stats[msg.body.request_id] = msg.body
            self.cv.notify_all()
