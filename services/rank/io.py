"""The rank's I/O thread: it alone owns every ZeroMQ socket of the rank.

    control  SUB     ← supervisor   LEASE, SERVE, SHUTDOWN, CANCEL, CACHE_CLEAR (rank 0)
                                    (topic b"ctl:<dep>"; services.rank.control_intake)
    report   DEALER  → supervisor   RANK_READY (re-sent until SERVE, and again after a
                                    re-authentication with a restarted supervisor),
                                    TELEMETRY, CANCEL_ACK, CACHE_CLEARED (rank 0:
                                    services.rank.cache_clears)
    plan     ROUTER (rank 0) / DEALER (followers): services.rank.plan_channel
    requests ROUTER  (rank 0)       GENERATE, ABORT → main; STATS answered here; TOKENS out;
                                    CACHE_SUBSCRIBE → cache index events pushed
                                    (services.rank.cache_feed)

Main → I/O: `post(cmd)` (services.rank.outbox: a closed set of typed commands) appends
to a deque and wakes the poller (services.rank.waker).
I/O → main: `inbox` (a queue.Queue of services.rank.events). MLX releases the GIL during
compute, so this thread answers FETCH, PING and STATS while the main thread is inside a
step. Signals reach it through `signal.set_wakeup_fd` and become a SignalEv.

Watchdogs (services.rank.watchdog_thread): rank 0's probes go out here (`Probe` → every joined
follower); every stream rank 0 serves is owned by a StreamLedger (services.rank.streams)
in this thread, so `AbortAll` ends them all at once and `stop` ends whatever is still
open, even while the main thread is stuck in a step.

The runtime is given this object explicitly (`RankRuntime.attach_io`, by boot): it
posts through it, stops it on a hard exit, and reads its reject counts.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from common import messages as m
from common.bus import Channel, configure, configure_listener
from common.envelope import DEFAULT_MAX_SIZE
from common.frame_budget import Budget
from common.keys import LaunchKeys
from common.rankspec import RankSpec
from common.zmtp_watch import ZmtpWatch
from services.rank import events as ev
from services.rank import outbox as out
from services.rank.auth import InitiatorLink, ReportSession, leader_gate, new_identity
from services.rank.cache_clears import ClearLedger
from services.rank.cache_feed import CacheFeed
from services.rank.control_intake import ControlIntake
from services.rank.intake import Intake
from services.rank.phase_clock import LoopPhase
from services.rank.plan_channel import RESEND_S, FollowerSession, LeaderSession, Wire
from services.rank.runtime import RankRuntime
from services.rank.streams import StreamLedger
from services.rank.waker import Waker

log = logging.getLogger("lockstep.rank.io")
BATCH_CHUNKS = 256  # chunks per TOKENS_BATCH at most (well under the frame cap)
PLAN_IN_MAX = 64 * 1024  # rank 0's plan ROUTER only ever receives small messages


class RankIO:
    def __init__(self, spec: RankSpec, keys: LaunchKeys, rt: RankRuntime) -> None:
        self.spec, self.rt, self.leader = spec, rt, spec.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.drops: collections.Counter[str] = collections.Counter()
        self.wire = Wire(self.drops)
        self._out: collections.deque = collections.deque()
        self._chunks: dict[bytes, list[m.Tokens]] = {}  # this drain's chunks by requester
        self._cache_ops: list[out.CacheOpsTaken] = []  # this drain's, sent behind the chunks
        self._commands = self._command_handlers()
        self.clock = rt.phases.tally()  # this (I/O) thread's time per phase
        self.ctx = zmq.Context()
        sender = f"{spec.deployment_id}/rank-{spec.rank}"

        def chan(name: str, key, accept, max_size: int = DEFAULT_MAX_SIZE) -> Channel:
            return Channel("rank", name, sender=sender, send_key=key, accept=accept,
                           max_size=max_size)

        self.ctl = chan("control", keys.control, m.CONTROL)
        self.rep = chan("report", keys.report, m.REPORT_TO_RANK)
        self.pln = chan("plan", keys.plan, m.PLAN_TO_LEADER, PLAN_IN_MAX) if self.leader \
            else chan("plan", keys.plan, m.PLAN_TO_FOLLOWER)
        self.req = chan("requests", keys.requests, m.REQUESTS_IN) if self.leader else None
        self.topic = b"ctl:" + spec.deployment_id.encode()
        self.control = configure(self.ctx.socket(zmq.SUB))
        self.control.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.control.connect(spec.control_endpoint)
        # Report: authenticate the supervisor (and be authenticated) before any report is
        # sent or any control message believed (services.rank.auth, docs/security.md).
        self.report = configure(self.ctx.socket(zmq.DEALER))
        self.reporting = ReportSession(spec, keys, self.rep, self.report, self.wire,
                                       on_fail=lambda why: self.inbox.put(ev.IoFailed(why)))
        # Control is believed only from the supervisor that gave that proof; what comes
        # earlier is held, not counted; another supervisor's (a restarted one) is held
        # until it proved itself too (services.rank.control_intake).
        # Only drops: the report session holds reports until the supervisor is heard from.
        self.report_monitor = self.report.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.control_in = ControlIntake(self.ctl, self.topic, spec.deployment_id, spec.job_id,
                                        self.drops, session=self.reporting,
                                        deliver=self._on_control)
        self.requests = None
        self.watches: list[ZmtpWatch] = []
        if self.leader:  # the two listening sockets: admission budgets (services.rank.intake)
            self.pln.budget, self.req.budget = Budget(), Budget()
            self.plan = configure_listener(self.ctx.socket(zmq.ROUTER), max_size=PLAN_IN_MAX)
            self.plan.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.plan.bind(spec.plan_endpoint)
            self.requests = configure_listener(self.ctx.socket(zmq.ROUTER),
                                               max_size=DEFAULT_MAX_SIZE)
            self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.requests.bind(spec.requests_endpoint)
            self.cache_feed = CacheFeed(self.req.pack, lambda ident, data: self.wire.send_to(
                self.requests, self.req, ident, data=data))
            # Connections libzmq closes before any frame (raw bytes, silence) are counted.
            self.watches = [ZmtpWatch(self.plan, self.pln.rejects),
                            ZmtpWatch(self.requests, self.req.rejects)]
            gate = leader_gate(
                spec, keys, self.pln,
                lambda ident, body: self.wire.send_to(self.plan, self.pln, ident, body))
            self.session = LeaderSession(spec, rt, self.plan, self.pln, self.wire, self.inbox,
                                         gate)
        else:
            self.plan = configure(self.ctx.socket(zmq.DEALER))
            plan_id = new_identity(spec.rank)  # unguessable: no one can squat it
            self.plan.setsockopt(zmq.IDENTITY, plan_id)
            self.plan.connect(spec.plan_endpoint)
            link = InitiatorLink("plan", spec, keys, self.pln, plan_id,
                                 lambda body: self.wire.send(self.plan, self.pln, body))
            self.session = FollowerSession(spec, rt, self.plan, self.pln, self.wire, self.inbox,
                                           link)
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
        # rank 0: the one owner of open streams (chunks, the abort stage, the last words)
        self.streams = StreamLedger(spec.settings.open_requests_bound()) if self.leader else None
        # rank 0: admin cache clears (each applied once, every re-send answered)
        self.clears = ClearLedger(spec.deployment_id,
                                  enabled=spec.settings.prompt_cache_entries > 0) \
            if self.leader else None

    # -- main-thread API -----------------------------------------------------------------

    @property
    def signal_fd(self) -> int:
        return self._sig_w.fileno()

    def start(self) -> None:
        self._thread.start()

    def post(self, *cmds: out.Command) -> None:
        """Any thread: hand commands to this thread, in order."""
        self._out.extend(cmds)
        self._waker.wake()

    def stop(self, timeout: float = 3.0, why: str = "stopped") -> None:
        """Flush what was posted, end every stream still open (`error`: rank 0 `why`),
        close every socket, and wait (bounded) until libzmq has handed the last messages
        (final tokens, telemetry) to the kernel. Any thread may call it."""
        if threading.current_thread() is self._thread:  # a hard exit from in here
            self._drain_outbox()
            self._close(why)
        elif self._thread.is_alive():
            self.post(out.Stop(why))
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
        self.intake = intake = Intake(poller)
        intake.add(self.control, self.control_in.on_frames)
        intake.add(self.plan, self.session.on_frames, self.pln.budget)
        intake.add(self.report, self._on_report)
        intake.add(self.report_monitor, self._on_report_monitor)
        if self.requests is not None:
            intake.add(self.requests, self._on_requests, self.req.budget)
        for watch in self.watches:
            intake.add(watch.monitor, watch.on_frames)
        poller.register(self._sig_r.fileno(), zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        while True:
            timeout_ms = self._run_timers()
            resume = intake.next_resume()
            if resume != float("inf"):
                timeout_ms = min(timeout_ms, max(0, int((resume - time.monotonic()) * 1000) + 1))
            ready = dict(poller.poll(timeout_ms))
            if self._sig_r.fileno() in ready:
                self._on_signal()
            if self._waker.rfd in ready:
                self._waker.clear()
            # Outbox first and between input bursts: a plan never queues behind input.
            if self._drain_outbox() or intake.read(ready, self._drain_outbox) \
                    or self._drain_outbox():
                return

    def _drain_outbox(self) -> bool:
        try:
            return self._drain_commands()
        finally:
            self._send_chunks()
            self._send_cache_events()  # behind the chunks: a final chunk, then its entry

    def _drain_commands(self) -> bool:
        """Carry out the main thread's commands in order; True once one was Stop."""
        while self._out:
            cmd = self._out.popleft()
            handler = self._commands.get(type(cmd))
            if handler is None:  # pragma: no cover - a closed set
                raise TypeError(f"not an outbox command: {cmd!r}")
            if handler(cmd):
                return True
        return False

    def _command_handlers(self) -> dict[type, Callable[[Any], bool | None]]:
        # Only _do_stop returns True: every other handler returns None.
        """Outbox command kind → what this thread does with it (True: stop draining)."""
        return {out.PublishPlan: self._do_plan, out.StreamChunk: self._do_chunk,
                out.CacheOpsTaken: self._do_cache_ops, out.Report: self._do_report,
                out.AnnounceReady: self._do_announce, out.Served: self._do_served,
                out.Probe: self._do_probe,
                out.AbortAll: self._do_abort_all, out.Stop: self._do_stop}

    def _do_plan(self, cmd: out.PublishPlan) -> None:
        t0 = self.clock.now()
        self.session.publish(cmd.plan)
        self.clock.add(LoopPhase.SIGN_SEND_PLAN, t0)

    def _do_chunk(self, cmd: out.StreamChunk) -> None:
        got = self.streams.on_chunk(cmd) if self.streams is not None else None
        if got is not None:  # sent together per requester once the outbox is drained
            self._chunks.setdefault(got[0], []).append(got[1])

    def _do_cache_ops(self, cmd: out.CacheOpsTaken) -> None:
        self._cache_ops.append(cmd)  # (the list is swapped per drain: never bind its append)

    def _do_report(self, cmd: out.Report) -> None:
        if isinstance(cmd.body, m.CacheCleared) and self.clears is not None:
            self.clears.on_answer(cmd.body)  # its re-sends get this same answer
        self.reporting.send(cmd.body)

    def _do_announce(self, cmd: out.AnnounceReady) -> None:
        self._ready_msg = cmd.msg
        self._ready_at = 0.0  # now, then every RESEND_S until SERVE

    def _do_served(self, _cmd: out.Served) -> None:
        self._served = True

    def _do_probe(self, cmd: out.Probe) -> None:
        self.session.ping(cmd.ping)

    def _do_abort_all(self, cmd: out.AbortAll) -> None:
        self._send_chunks()  # a stream's last tokens before its end
        self._end_streams(m.FinishReason.ABORT, cmd.detail, m.ErrorCode.WATCHDOG_ABORT)
        self.inbox.put(ev.AbortAllEv(cmd.reason))

    def _do_stop(self, cmd: out.Stop) -> bool:
        self._send_chunks()
        self._close(cmd.why)
        return True

    def _end_streams(self, finish_reason: m.FinishReason, error: str | None,
                     code: m.ErrorCode) -> None:
        if self.streams is not None:
            for ident, body in self.streams.end_all(finish_reason, error, code):
                self.wire.send_to(self.requests, self.req, ident, body)

    def _close(self, why: str) -> None:
        if self.requests is not None and not self.requests.closed:
            self._end_streams(m.FinishReason.ERROR, f"rank 0 {why}", m.ErrorCode.RANK_STOPPED)
        if not self.report.closed:
            self.reporting.send(self.rt.telemetry())
        for watch in self.watches:
            watch.close()
        self.report.disable_monitor()
        self.report_monitor.close(linger=0)
        for s in (self.control, self.report, self.plan, self.requests):
            if s is not None:
                s.close(linger=1000)
        # _sig_r stays open until the process ends: a signal arriving after this (a
        # second SIGTERM during the exit) must not write into a closed pipe.
        self._waker.close()

    def _run_timers(self) -> int:
        now = time.monotonic()
        auth_at = self.reporting.timers(now, self.reject_counts)
        if self.reporting.accepted_now():  # telemetry at once, then periodic
            self._telemetry_at = now
            if self.reporting.reauths and self._ready_msg is not None:
                # A restarted supervisor: RANK_READY is this rank's identity proof to it
                # (pid, start time, boot id, endpoints): now, then re-sent until its SERVE
                # (`_on_report` cleared `_served` when it proved itself).
                self._ready_at = now + RESEND_S
                self.reporting.send(self._ready_msg)
        if now >= self._telemetry_at:
            self._telemetry_at = now + self.spec.settings.rank_telemetry_interval_s
            self.rt.write_marker()  # first: a reader that saw the report finds the file
            self.reporting.send(self.rt.telemetry())
        deadline = min(self._telemetry_at, self.session.timers(now), auth_at,
                       *(w.tick(now) for w in self.watches))  # memory after a flood
        if self._ready_msg is not None and not self._served:
            if now >= self._ready_at:
                self._ready_at = now + RESEND_S
                self.reporting.send(self._ready_msg)
            deadline = min(deadline, self._ready_at)
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    # -- receiving ---------------------------------------------------------------------

    def _on_signal(self) -> None:
        try:
            data = self._sig_r.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:
            if self.rt.on_signal(signum):  # the first; a second one leaves at once
                self.inbox.put(ev.SignalEv(signum))

    def _on_report_monitor(self, frames: list[bytes]) -> None:
        if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
            self.reporting.disconnected()

    def _on_report(self, frames: list[bytes]) -> None:
        proofs = self.reporting.proofs
        self.reporting.on_frames(frames)
        if proofs and self.reporting.proofs != proofs and self._ready_msg is not None:
            self._served = False  # a restarted supervisor proved itself: wait for its SERVE
        self.control_in.release()  # the supervisor's proof may have just verified

    def _on_control(self, body) -> None:
        """A control message of this launch, after the supervisor proved itself."""
        if isinstance(body, m.Lease):
            first = self.rt.last_lease_at is None
            # Now, even for a held lease: the proof that released it is fresher news.
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
        elif isinstance(body, m.CacheClear) and self.clears is not None:  # followers: not theirs
            forward, answer = self.clears.on_request(body, self.rt.step)
            if forward:
                self.inbox.put(ev.CacheClearEv(body))
            if answer is not None:
                self.reporting.send(answer)

    def _send_chunks(self) -> None:
        """One signed message per requester for every chunk the drain produced: a
        TOKENS alone, several as one TOKENS_BATCH (a step of a full batch: one message,
        not one per request)."""
        if not self._chunks:
            return
        t0 = self.clock.now()
        chunks, self._chunks = self._chunks, {}
        for ident, bodies in chunks.items():
            for i in range(0, len(bodies), BATCH_CHUNKS):
                part = bodies[i:i + BATCH_CHUNKS]
                self._send_req(ident, part[0] if len(part) == 1 else m.TokensBatch(part), part)
        self.clock.add(LoopPhase.SIGN_SEND_TOKENS, t0)

    def _send_cache_events(self) -> None:
        taken, self._cache_ops = self._cache_ops, []
        if self.requests is None or self.requests.closed:
            return
        for cmd in taken:
            self.cache_feed.on_ops(cmd.ops, cmd.tokens)

    def _send_req(self, ident: bytes, body, chunks: list[m.Tokens]) -> None:
        errno = self.wire.send_to(self.requests, self.req, ident, body)
        # The requester (a gateway) is gone: nobody reads these streams any more, so the
        # requests leave the batch at the next step instead of decoding to their caps.
        if errno == zmq.EHOSTUNREACH:
            for c in chunks:
                if not c.finish_reason:
                    self.inbox.put(ev.AbortEv(m.Abort(c.request_id, "requester gone"),
                                              requester_gone=True))

    def _on_requests(self, frames: list[bytes]) -> None:
        got = self.req.unpack_router(frames)
        if got is None:
            return
        ident, msg = got
        body = msg.body
        if isinstance(body, m.Generate):
            refused = self.streams.on_generate(ident, body)
            if refused is not None:
                self.wire.send_to(self.requests, self.req, ident, refused)
                return
            self.inbox.put(ev.GenerateEv(body, time.monotonic()))
        elif isinstance(body, m.Abort):
            self.inbox.put(ev.AbortEv(body))
        elif isinstance(body, m.StatsRequest):
            rt = self.rt
            stats = m.Stats(request_id=body.request_id, phase=rt.phase, step=rt.step,
                            active=rt.active, active_ids=list(rt.active_ids),
                            cancel_epoch=rt.cancel_epoch, peers_ok=rt.peers_ok)
            self.wire.send_to(self.requests, self.req, ident, stats)
        elif isinstance(body, m.CacheSubscribe):
            self.cache_feed.on_subscribe(ident, body)
