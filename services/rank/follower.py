"""Ranks 1..N-1: apply rank 0's plans, in sequence, before the same steps.

A follower blocks on its inbox (0% CPU idle) and applies plan k only if k is the next
sequence number and the plan's step is its own step counter. Its batch must then need a
step exactly when the plan says advance. Anything else — a gap rank 0 cannot replay, a
plan out of order, an id it does not hold, a uid it did not predict — fails closed:
marker `failed`, clean exit, before this rank enters a collective its peers won't.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from common.messages import Phase, Plan
from services.rank import events as ev
from services.rank.loop import RankLoop
from services.rank.phase_clock import LoopPhase

log = logging.getLogger("lockstep.rank.follower")
SHUTDOWN_GRACE_S = 2.0


class Follower(RankLoop):
    def __init__(self, *args, next_seq: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.expected = next_seq
        self.leaving_at: float | None = None  # waiting for rank 0's shutdown plan
        self.exit_as: tuple[int, Phase, str | None] = (0, Phase.EXITING, None)

    def run(self) -> None:
        for e in self.stash:
            self.handle(e)
        self.stash.clear()
        while True:
            if self.leaving_at is None:
                self.drain(block=True)
                continue
            left = self.leaving_at - time.monotonic()
            if left <= 0:
                log.info("no shutdown plan from rank 0 within %.1fs; leaving", SHUTDOWN_GRACE_S)
                self.leave(*self.exit_as)
            self.drain(block=True, timeout=left)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {**super().handlers(),
                ev.PlanEv: lambda e: self.apply(e.plan),
                ev.PlanMissingEv: lambda e: self.fail(
                    f"plan gap: {e.detail} (follower at seq {self.expected}, "
                    f"step {self.engine.step})")}

    def shutdown(self, reason: str, code: int = 0, phase: Phase = Phase.EXITING) -> None:
        """Keep applying plans until rank 0's shutdown plan, or leave after a grace; a
        watchdog's exit (`code`, `phase`) leaves the same way, with its own phase."""
        if phase == Phase.PEER_LOST:
            self.leave(code, phase, reason)  # rank 0 is gone: no shutdown plan will come
        if code:
            self.exit_as = (code, phase, reason)
        if self.leaving_at is None:
            log.info("rank %d: %s; waiting for rank 0's shutdown plan", self.rt.rank, reason)
            if phase == Phase.EXITING:
                self.rt.set_phase(Phase.DRAINING)
            self.leaving_at = time.monotonic() + SHUTDOWN_GRACE_S

    def apply(self, plan: Plan) -> None:
        t0 = self.clock.now()
        if plan.seq != self.expected:
            self.fail(f"plan seq {plan.seq} out of order (expected {self.expected})")
        if plan.step != self.engine.step:
            self.fail(f"plan {plan.seq} is for step {plan.step}, this rank is at step "
                      f"{self.engine.step}")
        try:
            removed = self.engine.apply(plan.removes, plan.inserts, plan.cache,
                                        plan.prefill_step, plan.drafts)
        except Exception as exc:  # noqa: BLE001 - Divergence, or anything else: fail closed
            self.fail(f"plan {plan.seq}: {exc!r}")
        self.expected += 1
        self.applied_cache(plan)
        for f in removed:
            self.record(f)
        if plan.cancel_epoch:
            self.consume_cancel(plan)
        self.publish_counts()
        if plan.shutdown:
            launcher = self.rt.launcher_gone()  # rank 0 may have noticed first
            if launcher is not None and not self.exit_as[0]:
                self.exit_as = (1, Phase.LAUNCHER_LOST, launcher)
            self.leave(*self.exit_as)
        if self.engine.has_work() != plan.advance:
            self.fail(f"plan {plan.seq}: advance={plan.advance} but this rank's batch "
                      f"{'has' if self.engine.has_work() else 'has no'} work")
        self.clock.add(LoopPhase.PLAN, t0)
        if plan.advance:
            self.step()
            self.publish_counts()

    def publish_counts(self) -> None:
        self.rt.active_ids = self.engine.active_ids()
