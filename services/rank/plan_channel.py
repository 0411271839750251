"""The plan socket's two ends, run inside the I/O thread.

    Both ends first authenticate each other (services.rank.auth: AUTH_HELLO →
    CHALLENGE → PROOF → OK); rank 0 takes PLAN_HELLO / FETCH / PONG only from an
    identity that completed it, followers take nothing from rank 0 before its proof.

    rank 0     ROUTER  HELLO → WELCOME (next seq); every plan to every joined follower,
                       kept in the replay buffer; FETCH(k) → BATCH from the buffer
                       (missing=True if plan k cannot be replayed); PONG recorded
    followers  DEALER  HELLO until WELCOMEd; plans handed on in sequence order; a jump,
                       or silence while it has requests in its batch
                       (`plan_fetch_after_s`; 1 s when idle), sends FETCH; PING → PONG

Slow-joiner proof: rank 0 announces Joined only after every follower's HELLO reached it
over the very socket plans will use, so no plan is sent before a follower can get it.
"""

from __future__ import annotations

import collections
import logging
import queue
import time

import zmq

from common import messages as m
from common.bus import Channel
from common.handshake import Gate
from common.rankspec import RankSpec
from services.rank import events as ev
from services.rank.auth import InitiatorLink
from services.rank.disk_report import RESEND_S as DISK_RESEND_S
from services.rank.disk_report import DiskReporter
from services.rank.planwire import PlanOrder, ReplayBuffer
from services.rank.runtime import RankRuntime

log = logging.getLogger("lockstep.rank.plan_channel")
RESEND_S = 1.0
IDLE_FETCH_S = 1.0
INF = float("inf")


class Wire:
    """Non-blocking sends with counted failures: the I/O thread never blocks on a peer."""

    def __init__(self, drops: collections.Counter) -> None:
        self.drops = drops

    def send(self, sock: zmq.Socket, chan: Channel, body) -> None:
        try:
            sock.send(chan.pack(body), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.drops[f"{chan.socket_name}.send_{exc.errno}"] += 1

    def send_to(self, sock: zmq.Socket, chan: Channel, ident: bytes, body=None,
                data: bytes | None = None) -> int:
        """0 if sent, else the errno (EHOSTUNREACH: that peer is gone; EAGAIN: full)."""
        try:
            sock.send_multipart([ident, data or chan.pack(body)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.drops[f"{chan.socket_name}.send_{exc.errno}"] += 1
            return exc.errno
        return 0


class LeaderSession:
    def __init__(self, spec: RankSpec, rt: RankRuntime, sock: zmq.Socket, chan: Channel,
                 wire: Wire, inbox: queue.Queue, gate: Gate) -> None:
        self.spec, self.rt, self.sock, self.chan, self.wire, self.inbox = \
            spec, rt, sock, chan, wire, inbox
        self.replay = ReplayBuffer(spec.settings.replay_buffer)
        self.followers: dict[int, bytes] = {}
        self.last_pong: dict[int, m.Pong] = {}  # the peer watchdog (issue 4) reads this
        self.gate = gate  # the handshake (services.rank.auth.leader_gate)
        self._announced = spec.world_size == 1

    def publish(self, plan: m.Plan) -> None:
        if self.rt.seams.drop_plan_seq == plan.seq:
            log.warning("test seam: plan %d neither sent nor kept for replay", plan.seq)
            self.replay.record(plan, keep=False)
            return
        self.replay.record(plan)
        if self.followers:
            data = self.chan.pack(plan)  # signed once, the same bytes to every follower
            for ident in self.followers.values():
                self.wire.send_to(self.sock, self.chan, ident, data=data)

    def on_frames(self, frames: list[bytes]) -> None:
        got = self.gate.admit(frames)  # handshake; only authenticated followers pass
        if got is None:
            return
        ident, msg, peer_rank = got
        body = msg.body
        if isinstance(body, m.PlanHello):
            if not 1 <= body.rank < self.spec.world_size:
                self.wire.drops["plan.bad_rank"] += 1
                return
            self.followers[body.rank] = ident
            welcome = m.PlanWelcome(rank=body.rank, next_seq=self.replay.last_seq + 1)
            self.wire.send_to(self.sock, self.chan, ident, welcome)
            if not self._announced and len(self.followers) == self.spec.world_size - 1:
                self._announced = True
                self.inbox.put(ev.Joined(0))
        elif isinstance(body, m.PlanFetch):
            self.wire.send_to(self.sock, self.chan, ident, self.replay.fetch(body.from_seq))
        elif isinstance(body, m.Pong):
            self.last_pong[body.rank] = body
        elif isinstance(body, m.DiskIndex):
            if body.rank != peer_rank:  # one follower cannot speak for another
                self.wire.drops["plan.disk_index_rank"] += 1
                return
            self.inbox.put(ev.DiskIndexEv(body))

    def timers(self, now: float) -> float:
        return INF

    def ping(self, ping: m.Ping) -> None:
        """A peer-watchdog probe round (services.rank.watchdog_thread): one PING to every joined
        follower; their PONGs land in `last_pong`."""
        if self.followers:
            ping.disk_seqs = list(self.rt.disk_acks)  # DISK_INDEX reports taken
            data = self.chan.pack(ping)
            for ident in self.followers.values():
                self.wire.send_to(self.sock, self.chan, ident, data=data)


class FollowerSession:
    def __init__(self, spec: RankSpec, rt: RankRuntime, sock: zmq.Socket, chan: Channel,
                 wire: Wire, inbox: queue.Queue, link: InitiatorLink) -> None:
        self.spec, self.rt, self.sock, self.chan, self.wire, self.inbox = \
            spec, rt, sock, chan, wire, inbox
        self.order = PlanOrder()
        self.joined = False
        self.link = link  # mutual authentication towards rank 0 (services.rank.auth)
        self._hello_at = 0.0
        self.disk = DiskReporter()  # this rank's DISK_INDEX for rank 0
        self._last_plan_at = time.monotonic()
        self._last_fetch_at = 0.0

    def on_frames(self, frames: list[bytes]) -> None:
        msg = self.chan.unpack_dealer(frames)
        if msg is None or (msg := self.link.on_message(msg)) is None:
            return  # rejected, a handshake reply, or rank 0 not yet authenticated
        body = msg.body
        if isinstance(body, m.PlanWelcome):
            if body.rank != self.spec.rank:
                self.wire.drops["plan.wrong_rank"] += 1
            elif not self.joined:
                self.joined = True
                self.order.start(body.next_seq)
                self._last_plan_at = time.monotonic()
                self.inbox.put(ev.Joined(body.next_seq))
        elif isinstance(body, m.Plan):
            self._deliver([body])
        elif isinstance(body, m.PlanBatch):
            if body.missing:
                self.inbox.put(ev.PlanMissingEv(
                    self.order.expected or 0,
                    f"plan {self.order.expected} is not in rank 0's replay buffer"))
            else:
                self._deliver(body.plans)
        elif isinstance(body, m.Ping):
            self.rt.last_ping_at = time.monotonic()  # the leader watchdog reads it
            if len(body.disk_seqs) > self.spec.rank:
                self.disk.ack(body.disk_seqs[self.spec.rank])
            pong = m.Pong(nonce=body.nonce, rank=self.spec.rank, step=self.rt.step,
                          phase=self.rt.phase)
            self.wire.send(self.sock, self.chan, pong)

    def _deliver(self, plans: list[m.Plan]) -> None:
        self._last_plan_at = time.monotonic()
        for plan in plans:
            for p in self.order.offer(plan):
                self.inbox.put(ev.PlanEv(p))
        if self.order.gap:
            self._fetch(time.monotonic())

    def _next_fetch_at(self) -> float:
        if self.order.gap:
            return self._last_fetch_at + self.spec.settings.plan_fetch_after_s
        silence = self.spec.settings.plan_fetch_after_s if self.rt.active_ids else IDLE_FETCH_S
        return max(self._last_plan_at, self._last_fetch_at) + silence

    def _fetch(self, now: float) -> None:
        if now - self._last_fetch_at < 0.02:
            return  # one fetch per burst of out-of-order plans
        self._last_fetch_at = now
        self.wire.send(self.sock, self.chan, m.PlanFetch(from_seq=self.order.expected or 0))

    def timers(self, now: float) -> float:
        """Run what is due; return when to be called next."""
        if not self.link.accepted:  # mutual authentication first (services.rank.auth)
            return self.link.timers(now)
        if not self.joined:
            if now >= self._hello_at:
                self._hello_at = now + RESEND_S
                self.wire.send(self.sock, self.chan, m.PlanHello(rank=self.spec.rank))
            return self._hello_at
        if now >= self._next_fetch_at():
            self._fetch(now)
        report = self.disk.due(now, self.rt.disk_report, self.rt.disk_tier)
        if report is not None:
            self.wire.send(self.sock, self.chan, report)
        if self.rt.disk_report is not None:  # re-sent, and failed writes polled for
            return min(self._next_fetch_at(), now + DISK_RESEND_S)
        return self._next_fetch_at()
