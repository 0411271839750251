"""The rank's I/O thread: it alone owns every ZeroMQ socket of the rank.

    control  SUB     ← supervisor   LEASE, SERVE, SHUTDOWN, CANCEL (topic b"ctl:<dep>")
    report   DEALER  → supervisor   RANK_READY (re-sent until SERVE), TELEMETRY, CANCEL_ACK
    plan     ROUTER (rank 0) / DEALER (followers): services.rank.session
    requests ROUTER  (rank 0)       GENERATE, ABORT → main; STATS answered here; TOKENS out

Main → I/O: `post(cmd)` appends to a deque and wakes the poller (services.rank.waker).
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
from services.rank.runtime import RankRuntime
from services.rank.session import RESEND_S, FollowerSession, LeaderSession, Wire
from services.rank.waker import Waker

log = logging.getLogger("lockstep.rank.io")
BURST = 256  # messages read from one socket per poll round


class RankIO:
    def __init__(self, spec: RankSpec, keys: LaunchKeys, rt: RankRuntime) -> None:
        self.spec, self.rt, self.leader = spec, rt, spec.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.drops: collections.Counter[str] = collections.Counter()
        self.wire = Wire(self.drops)
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
            self.session = LeaderSession(spec, rt, self.plan, self.pln, self.wire, self.inbox)
        else:
            self.plan = configure(self.ctx.socket(zmq.DEALER))
            self.plan.setsockopt(zmq.IDENTITY, f"rank-{spec.rank}".encode())
            self.plan.connect(spec.plan_endpoint)
            self.session = FollowerSession(spec, rt, self.plan, self.pln, self.wire, self.inbox)
        self._waker = Waker()
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self._ready_msg: m.RankReady | None = None
        self._served = False
        self._telemetry_at = 0.0
        self._ready_at = 0.0
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
        """("plan", Plan) | ("req", ident, body) | ("report", body) | ("ready", RankReady)
        | ("served",) | ("stop",)"""
        self._out.extend(cmds)
        self._waker.wake()

    def stop(self, timeout: float = 3.0) -> None:
        """Flush what was posted, close every socket, and wait (bounded) until libzmq has
        handed the last messages (final tokens, telemetry) to the kernel."""
        if self._thread.is_alive():
            self.post(("stop",))
            self._thread.join(timeout)
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
        handlers = {self.control: self._on_control, self.plan: self.session.on_frames,
                    self.report: self._on_report}
        if self.requests is not None:
            handlers[self.requests] = self._on_requests
        for s in handlers:
            poller.register(s, zmq.POLLIN)
        poller.register(self._sig_r.fileno(), zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
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
            if self._waker.rfd in ready:
                self._waker.clear()
            if self._drain_outbox():
                return

    def _drain_outbox(self) -> bool:
        while self._out:
            cmd = self._out.popleft()
            kind = cmd[0]
            if kind == "plan":
                self.session.publish(cmd[1])
            elif kind == "req":
                self.wire.send_to(self.requests, self.req, cmd[1], cmd[2])
            elif kind == "report":
                self.wire.send(self.report, self.rep, cmd[1])
            elif kind == "ready":
                self._ready_msg = cmd[1]
                self._ready_at = 0.0  # now, then every RESEND_S until SERVE
            elif kind == "served":
                self._served = True
            elif kind == "stop":
                self.wire.send(self.report, self.rep, self.rt.telemetry())
                for s in (self.control, self.report, self.plan, self.requests):
                    if s is not None:
                        s.close(linger=1000)
                self._sig_r.close()
                self._waker.close()
                return True
        return False

    def _run_timers(self) -> int:
        now = time.monotonic()
        if now >= self._telemetry_at:
            self._telemetry_at = now + self.spec.settings.telemetry_interval_s
            self.wire.send(self.report, self.rep, self.rt.telemetry())
            self.rt.write_marker()
        deadline = min(self._telemetry_at, self.session.timers(now))
        if self._ready_msg is not None and not self._served:
            if now >= self._ready_at:
                self._ready_at = now + RESEND_S
                self.wire.send(self.report, self.rep, self._ready_msg)
            deadline = min(deadline, self._ready_at)
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    # -- receiving ---------------------------------------------------------------------

    def _on_signal(self) -> None:
        try:
            data = self._sig_r.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:
            self.rt.arm_escape_hatch(f"signal {signum}")
            self.inbox.put(ev.SignalEv(signum))

    def _ours(self, body) -> bool:
        ok = getattr(body, "deployment_id", self.spec.deployment_id) == self.spec.deployment_id \
            and getattr(body, "job_id", self.spec.job_id) == self.spec.job_id
        if not ok:
            self.drops["control.wrong_deployment"] += 1
        return ok

    def _on_report(self, frames: list[bytes]) -> None:
        self.drops["report.unexpected"] += 1  # nobody talks back on report

    def _on_control(self, frames: list[bytes]) -> None:
        msg = self.ctl.unpack_sub(frames, self.topic)
        if msg is None or not self._ours(msg.body):
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
            self.wire.send_to(self.requests, self.req, ident, stats)
