"""The rank's I/O thread: it alone owns every ZeroMQ socket of the rank.

    control  SUB     ← supervisor   LEASE, SERVE, SHUTDOWN, CANCEL (topic b"ctl:<dep>")
    report   DEALER  → supervisor   RANK_READY (re-sent until SERVE), TELEMETRY, CANCEL_ACK
    plan     ROUTER  (rank 0)       HELLO→WELCOME, PLAN fan-out, FETCH→BATCH, PONG
             DEALER  (followers)    HELLO (until welcomed), PLAN/BATCH in order, PING→PONG
    requests ROUTER  (rank 0)       GENERATE, ABORT → main; STATS answered here; TOKENS out

Main → I/O: `post(cmd)` appends to a deque and wakes the poller through an inproc PAIR.
I/O → main: `inbox` (a queue.Queue of services.rank.events). MLX releases the GIL during
compute, so this thread answers FETCH, PING and STATS while the main thread is inside a
step. Signals reach it through `signal.set_wakeup_fd` and become a SignalEv.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time

import zmq

from common import messages as m
from common.bus import Channel, configure
from common.keys import LaunchKeys
from common.rankspec import RankSpec
from services.rank import events as ev
from services.rank.planwire import PlanOrder, ReplayBuffer
from services.rank.runtime import RankRuntime

log = logging.getLogger("lockstep.rank.io")
RESEND_S = 1.0
IDLE_FETCH_S = 1.0
BURST = 256  # messages read from one socket per poll round


class RankIO:
    def __init__(self, spec: RankSpec, keys: LaunchKeys, rt: RankRuntime) -> None:
        self.spec, self.rt, self.leader = spec, rt, spec.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.drops: collections.Counter[str] = collections.Counter()
        self._out: collections.deque = collections.deque()
        self.ctx = zmq.Context()
        sender = f"{spec.deployment_id}/rank-{spec.rank}"

        def chan(name: str, key, accept) -> Channel:
            return Channel("rank", name, sender=sender, send_key=key, accept=accept)

        self.ctl = chan("control", keys.control, m.CONTROL)
        self.rep = chan("report", keys.report, ())
        self.pln = chan("plan", keys.plan, m.PLAN_TO_LEADER if self.leader else m.PLAN_TO_FOLLOWER)
        self.req = chan("requests", keys.requests, m.REQUESTS_IN) if self.leader else None
        self.topic = b"ctl:" + spec.deployment_id.encode()
        self.control = configure(self.ctx.socket(zmq.SUB))
        self.control.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.control.connect(spec.control_endpoint)
        self.report = configure(self.ctx.socket(zmq.DEALER))
        self.report.connect(spec.report_endpoint)
        self.requests = None
        if self.leader:
            self.plan = configure(self.ctx.socket(zmq.ROUTER))
            self.plan.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.plan.bind(spec.plan_endpoint)
            self.requests = configure(self.ctx.socket(zmq.ROUTER))
            self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.requests.bind(spec.requests_endpoint)
        else:
            self.plan = configure(self.ctx.socket(zmq.DEALER))
            self.plan.setsockopt(zmq.IDENTITY, f"rank-{spec.rank}".encode())
            self.plan.connect(spec.plan_endpoint)
        addr = f"inproc://rank-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)  # main thread only
        self._wake_tx.connect(addr)
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        # leader state
        self.replay = ReplayBuffer(spec.settings.replay_buffer)
        self.followers: dict[int, bytes] = {}
        self.last_pong: dict[int, m.Pong] = {}
        self._announced = False
        # follower state
        self.order = PlanOrder()
        self._joined = False
        self._last_plan_at = time.monotonic()
        self._last_fetch_at = 0.0
        # both
        self._ready_msg: m.RankReady | None = None
        self._served = False
        self._timers = {"telemetry": 0.0, "hello": 0.0, "ready": 0.0}
        self._thread = threading.Thread(target=self._main, name=f"rank{spec.rank}-io", daemon=True)
        self.failed: str | None = None
        rt.post_event = self.inbox.put
        rt.reject_sources.append(self.reject_counts)

    # -- main-thread API -----------------------------------------------------------------

    @property
    def signal_fd(self) -> int:
        return self._sig_w.fileno()

    def start(self) -> None:
        self._thread.start()

    def post(self, *cmds: tuple) -> None:
        self._out.extend(cmds)
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the poller is already woken many times over

    def stop(self, timeout: float = 3.0) -> None:
        """Flush what was posted, close every socket, and wait (bounded) until libzmq has
        handed the last messages (final tokens, telemetry) to the kernel."""
        if self._thread.is_alive():
            self.post(("stop",))
            self._thread.join(timeout)
        self._wake_tx.close(0)
        term = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        term.start()
        term.join(timeout)

    def reject_counts(self) -> dict[str, int]:
        out = dict(self.drops)
        for ch in (self.ctl, self.rep, self.pln, self.req):
            if ch is not None:
                for reason, n in ch.rejects.snapshot().items():
                    out[f"{ch.socket_name}.{reason}"] = out.get(f"{ch.socket_name}.{reason}", 0) + n
        return out

    # -- the thread -------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - turn a crash into a fail-closed exit
            log.exception("I/O thread failed")
            self.failed = f"I/O thread failed: {exc!r}"
            self.inbox.put(ev.IoFailed(self.failed))

    def _loop(self) -> None:
        poller = zmq.Poller()
        socks = [self.control, self.report, self.plan, self._wake_rx]
        if self.requests is not None:
            socks.append(self.requests)
        for s in socks:
            poller.register(s, zmq.POLLIN)
        poller.register(self._sig_r.fileno(), zmq.POLLIN)
        handlers = {self.control: self._on_control, self.plan: self._on_plan,
                    self.report: self._on_report}
        if self.requests is not None:
            handlers[self.requests] = self._on_requests
        while True:
            timeout_ms = self._run_timers()
            ready = dict(poller.poll(timeout_ms))
            if self._sig_r.fileno() in ready:
                self._on_signal()
            for sock, handler in handlers.items():
                if sock in ready:
                    for _ in range(BURST):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        handler(frames)
            if self._wake_rx in ready:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._drain_outbox():
                return

    def _drain_outbox(self) -> bool:
        while self._out:
            cmd = self._out.popleft()
            kind = cmd[0]
            if kind == "plan":
                self._fan_out(cmd[1])
            elif kind == "req":
                self._send_router(self.requests, self.req, cmd[1], cmd[2])
            elif kind == "report":
                self._send(self.report, self.rep, cmd[1])
            elif kind == "ready":
                self._ready_msg = cmd[1]
                self._send(self.report, self.rep, cmd[1])
                self._timers["ready"] = time.monotonic() + RESEND_S
            elif kind == "served":
                self._served = True
            elif kind == "stop":
                self._send(self.report, self.rep, self.rt.telemetry())
                for s in (self.control, self.report, self.plan, self.requests, self._wake_rx):
                    if s is not None:
                        s.close(linger=1000)
                self._sig_r.close()
                return True
        return False

    def _run_timers(self) -> int:
        now = time.monotonic()
        t = self._timers
        if now >= t["telemetry"]:
            t["telemetry"] = now + self.spec.settings.telemetry_interval_s
            self._send(self.report, self.rep, self.rt.telemetry())
            self.rt.write_marker()
        if self._ready_msg is not None and not self._served and now >= t["ready"]:
            t["ready"] = now + RESEND_S
            self._send(self.report, self.rep, self._ready_msg)
        if not self.leader:
            if not self._joined and now >= t["hello"]:
                t["hello"] = now + RESEND_S
                self._send(self.plan, self.pln, m.PlanHello(rank=self.spec.rank))
            if self._joined:
                self._maybe_fetch(now)
        deadline = min(t["telemetry"], t["ready"] if self._ready_msg and not self._served
                       else float("inf"), t["hello"] if not self.leader and not self._joined
                       else float("inf"))
        if not self.leader and self._joined:
            deadline = min(deadline, self._next_fetch_at())
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    # -- sending ---------------------------------------------------------------------------

    def _send(self, sock, chan: Channel, body) -> None:
        try:
            sock.send(chan.pack(body), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.drops[f"{chan.socket_name}.send_{exc.errno}"] += 1

    def _send_router(self, sock, chan: Channel, ident: bytes, body, data: bytes | None = None) -> None:
        try:
            sock.send_multipart([ident, data or chan.pack(body)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that peer is gone
            self.drops[f"{chan.socket_name}.send_{exc.errno}"] += 1

    def _fan_out(self, plan: m.Plan) -> None:
        if self.rt.seams.drop_plan_seq == plan.seq:
            log.warning("test seam: plan %d neither sent nor kept for replay", plan.seq)
            self.replay.record(plan, keep=False)
            return
        self.replay.record(plan)
        if self.followers:
            data = self.pln.pack(plan)
            for ident in self.followers.values():
                self._send_router(self.plan, self.pln, ident, None, data)

    # -- receiving ---------------------------------------------------------------------

    def _on_signal(self) -> None:
        try:
            data = self._sig_r.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:
            self.rt.arm_escape_hatch(f"signal {signum}")
            self.inbox.put(ev.SignalEv(signum))

    def _ours(self, chan: Channel, body) -> bool:
        ok = getattr(body, "deployment_id", self.spec.deployment_id) == self.spec.deployment_id \
            and getattr(body, "job_id", self.spec.job_id) == self.spec.job_id
        if not ok:
            self.drops[f"{chan.socket_name}.wrong_deployment"] += 1
        return ok

    def _on_report(self, frames: list[bytes]) -> None:
        self.drops["report.unexpected"] += 1  # nobody talks back on report

    def _on_control(self, frames: list[bytes]) -> None:
        msg = self.ctl.unpack_sub(frames, self.topic)
        if msg is None or not self._ours(self.ctl, msg.body):
            return
        body = msg.body
        if isinstance(body, m.Lease):
            first = self.rt.last_lease_at is None
            self.rt.last_lease_at = time.monotonic()
            if first:
                self.inbox.put(ev.LeaseSeen(body))
        elif isinstance(body, m.Serve):
            self._served = True
            self.inbox.put(ev.ServeEv(body))
        elif isinstance(body, m.Shutdown):
            self.rt.arm_escape_hatch("shutdown")
            self.inbox.put(ev.ShutdownEv(body))
        elif isinstance(body, m.Cancel):
            self.inbox.put(ev.CancelEv(body))

    def _on_requests(self, frames: list[bytes]) -> None:
        got = self.req.unpack_router(frames)
        if got is None:
            return
        ident, msg = got
        body = msg.body
        if isinstance(body, m.Generate):
            self.inbox.put(ev.GenerateEv(ident, body, time.time()))
        elif isinstance(body, m.Abort):
            self.inbox.put(ev.AbortEv(body))
        elif isinstance(body, m.StatsRequest):
            rt = self.rt
            stats = m.Stats(request_id=body.request_id, phase=rt.phase.value, step=rt.step,
                            active=rt.active, active_ids=list(rt.active_ids),
                            cancel_epoch=rt.cancel_epoch)
            self._send_router(self.requests, self.req, ident, stats)

    def _on_plan(self, frames: list[bytes]) -> None:
        if self.leader:
            got = self.pln.unpack_router(frames)
            if got is not None:
                self._leader_plan_msg(*got)
        else:
            msg = self.pln.unpack_dealer(frames)
            if msg is not None:
                self._follower_plan_msg(msg.body)

    def _leader_plan_msg(self, ident: bytes, msg) -> None:
        body = msg.body
        if isinstance(body, m.PlanHello):
            if not 1 <= body.rank < self.spec.world_size:
                self.drops["plan.bad_rank"] += 1
                return
            self.followers[body.rank] = ident
            welcome = m.PlanWelcome(rank=body.rank, next_seq=self.replay.last_seq + 1)
            self._send_router(self.plan, self.pln, ident, welcome)
            if not self._announced and len(self.followers) == self.spec.world_size - 1:
                self._announced = True
                self.inbox.put(ev.Joined(0))
        elif isinstance(body, m.PlanFetch):
            self._send_router(self.plan, self.pln, ident, self.replay.fetch(body.from_seq))
        elif isinstance(body, m.Pong):
            self.last_pong[body.rank] = body  # peer watchdog (issue 4) reads this

    def _follower_plan_msg(self, body) -> None:
        if isinstance(body, m.PlanWelcome):
            if body.rank != self.spec.rank:
                self.drops["plan.wrong_rank"] += 1
            elif not self._joined:
                self._joined = True
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
            pong = m.Pong(nonce=body.nonce, rank=self.spec.rank, step=self.rt.step,
                          phase=self.rt.phase.value)
            self._send(self.plan, self.pln, pong)

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

    def _maybe_fetch(self, now: float) -> None:
        if now >= self._next_fetch_at():
            self._fetch(now)

    def _fetch(self, now: float) -> None:
        if now - self._last_fetch_at < 0.02:
            return  # one fetch per burst of out-of-order plans
        self._last_fetch_at = now
        self._send(self.plan, self.pln, m.PlanFetch(from_seq=self.order.expected or 0))
