"""What rank 0's loop and a follower's loop share: the inbox, cancel epochs and acks,
the removal record, one step (`run_step`, which the watchdogs can see), and every way
out — including a watchdog's request to leave (`ExitEv`: the same path as a shutdown,
with the watchdog's phase and exit code)."""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable
from typing import Any, NoReturn

from common.messages import CancelAck, Phase, Plan, RemoveReason
from common.rankspec import RankSettings
from services.rank import events as ev
from services.rank.engine import Divergence, Emitted, Engine, Finished
from services.rank.errors import StepCause, step_cause
from services.rank.io import RankIO
from services.rank.outbox import Report
from services.rank.phase_clock import LoopPhase
from services.rank.prefix_store import CacheIndexLog, cache_index_path
from services.rank.process_exit import EXIT_FAILED
from services.rank.removals import RemovalLog
from services.rank.runtime import RankRuntime
from services.rank.watchdogs import Inside, Where

log = logging.getLogger("lockstep.rank.loop")


class RankLoop:
    def __init__(self, rt: RankRuntime, io: RankIO, engine: Engine, removals: RemovalLog,
                 stash: list[object]) -> None:
        self.rt = rt
        self.io = io
        self.engine = engine
        self.removals = removals
        self.stash = stash
        self.settings: RankSettings = rt.spec.settings
        self.clock = rt.phases.tally()  # this (main) thread's time per phase
        self.acks: dict[int, CancelAck] = {}
        self.watermark_step = 0
        self.cache_log: CacheIndexLog | None = None
        if engine.store is not None:
            self.cache_log = CacheIndexLog(cache_index_path(rt.paths, rt.spec.deployment_id,
                                                            rt.rank))
            self.rt.cache = engine.store.stats()
        self.dispatch: dict[type, Callable[[Any], None]] = self.handlers()

    # -- inbox ---------------------------------------------------------------------------

    def drain(self, *, block: bool, timeout: float | None = None) -> None:
        if block:
            try:
                self.handle(self.io.inbox.get(timeout=timeout))
            except queue.Empty:
                return
        while True:
            try:
                e = self.io.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(e)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """Inbox message kind → its handler: these every rank has; rank 0 and a follower
        add their own. A kind in none (ServeEv, LeaseSeen, Joined repeats) carries
        nothing new once serving."""
        return {
            ev.CancelEv: lambda e: self.on_cancel_msg(e.body),
            ev.ShutdownEv: lambda e: self.shutdown(
                f"shutdown: {e.body.reason}" if e.body.reason else "shutdown"),
            ev.SignalEv: self.on_signal,
            ev.ExitEv: lambda e: self.shutdown(e.reason, code=e.code, phase=e.phase),
            ev.IoFailed: lambda e: self.fail(e.error),
        }

    def handle(self, e: object) -> None:
        handler = self.dispatch.get(type(e))
        if handler is not None:
            handler(e)

    def on_signal(self, e: ev.SignalEv) -> None:
        self.rt.seams.on_signal(f"signal {e.signum}")
        self.shutdown(f"signal {e.signum}")

    # -- cancel epochs -------------------------------------------------------------------

    def on_cancel_msg(self, c) -> None:
        if c.epoch in self.acks:  # re-sent: the ack may have been lost
            self.io.post(Report(self.acks[c.epoch]))
        elif c.epoch <= self.rt.cancel_floor:
            log.info("cancel epoch %d is at or below the start-up watermark; ignored", c.epoch)
            self.io.drops["control.cancel_watermark"] += 1
        elif c.epoch <= self.rt.cancel_epoch:
            # Superseded: a later epoch was consumed first. Never applied now (it could
            # cancel requests that arrived since); acked so the sender stops re-sending.
            log.warning("cancel epoch %d arrived after epoch %d; not applied", c.epoch,
                        self.rt.cancel_epoch)
            ack = CancelAck(deployment_id=self.rt.spec.deployment_id, epoch=c.epoch,
                            rank=self.rt.rank, step_applied=self.watermark_step, cancelled=[])
            self.acks[c.epoch] = ack
            self.io.post(Report(ack))
        else:
            self.on_cancel(c)

    def on_cancel(self, c) -> None:
        """Leader folds it into a plan; followers wait for the plan that carries it."""

    def consume_cancel(self, plan: Plan) -> None:
        cancelled = [r.request_id for r in plan.removes if r.reason == RemoveReason.CANCEL]
        ack = CancelAck(deployment_id=self.rt.spec.deployment_id, epoch=plan.cancel_epoch,
                        rank=self.rt.rank, step_applied=plan.step, cancelled=cancelled)
        self.acks[plan.cancel_epoch] = ack
        if plan.cancel_epoch > self.rt.cancel_epoch:
            self.rt.cancel_epoch = plan.cancel_epoch
            self.watermark_step = plan.step
        log.info("cancel epoch %d applied at step %d: %s", plan.cancel_epoch, plan.step, cancelled)
        self.io.post(Report(ack))

    # -- prompt cache ------------------------------------------------------------------------

    def applied_cache(self, plan: Plan) -> None:
        """After `plan` was applied: its index change recorded, the stats published."""
        if plan.cache and self.cache_log is not None:
            self.cache_log.append(plan.seq, plan.step, self.engine.store)
        if self.engine.store is not None:
            self.publish_cache()

    def publish_cache(self) -> None:
        self.rt.cache = self.engine.store.stats()

    # -- record ----------------------------------------------------------------------------

    def record(self, f: Finished) -> None:
        a = f.active
        self.removals.append(a.request_id, a.uid, f.step, f.reason, a.tokens)

    # -- leaving ---------------------------------------------------------------------------

    def shutdown(self, reason: str, code: int = 0,
                 phase: Phase = Phase.EXITING) -> None:  # pragma: no cover - overridden
        self.leave(code, phase, reason if code else None)

    # -- stepping ----------------------------------------------------------------------

    def run_step(self):
        """`engine.next()`, with `rt.inside` set while inside it (a peer that stops makes
        the collective spin forever: the watchdogs then leave from their own thread)."""
        self.rt.inside = Where(Inside.STEP, self.engine.step)
        t0 = self.clock.now()
        try:
            self.rt.seams.before_step(self.engine.step)
            return self.engine.next()
        finally:
            self.rt.inside = None
            self.clock.add(LoopPhase.STEP, t0)

    def step(self) -> list[Emitted]:
        """One step on every rank: a divergence fails closed, a failed collective leaves
        by its cause; the removals it caused are recorded before any stream ends."""
        try:
            emitted, finished = self.run_step()
        except Divergence as exc:
            self.fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - a collective failed: a peer is gone
            self.collective_failed(exc)
        self.rt.progressed(self.engine.step)
        held = self.engine.held_kv()  # what the caches allocate: this rank's own measure
        kv = self.rt.kv
        self.rt.kv = dataclasses.replace(kv, held=held, held_peak=max(kv.held_peak, held))
        for f in finished:
            self.record(f)
        return emitted

    def fail(self, error: str) -> NoReturn:
        log.error("rank %d fails closed: %s", self.rt.rank, error)
        self.rt.exit(EXIT_FAILED, Phase.FAILED, error)

    def collective_failed(self, exc: BaseException) -> NoReturn:
        phase = Phase.PEER_LOST if step_cause(exc) is StepCause.PEER_LOST else Phase.FAILED
        error = f"step {self.engine.step} failed: {exc}"
        log.error("rank %d: %s", self.rt.rank, error)
        launcher = self.rt.launcher_gone()  # the root cause when every rank is leaving
        if launcher is not None:
            phase, error = Phase.LAUNCHER_LOST, f"{launcher}; {error}"
        self.rt.exit(EXIT_FAILED, phase, error)

    def leave(self, code: int, phase: Phase, error: str | None) -> NoReturn:
        """A clean exit: let the step in flight finish (every rank queued it), then go."""
        self.rt.inside = Where(Inside.LAST_STEP)  # a stopped peer: blocks, the hatch ends it
        try:
            self.engine.drain()
        except Exception as exc:  # noqa: BLE001 - a peer already gone; still exit
            log.warning("draining the last step: %s", exc)
        self.rt.inside = None
        self.removals.close()
        if self.cache_log is not None:
            self.cache_log.close()
        self.rt.exit(code, phase, error)
