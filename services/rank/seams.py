"""Fault switches for tests, honoured only when `RankSettings.test_seams` is true
(docs/rank.md "Test seams"): LOCKSTEP_TEST_DROP_PLAN_SEQ, LOCKSTEP_TEST_STEP_DELAY_S,
LOCKSTEP_TEST_BLOCK_STEP_AFTER, LOCKSTEP_TEST_HANG_ON_SIGTERM."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("lockstep.rank")


class TestSeams:
    """Fault switches, honoured only when `settings.test_seams` is true."""

    __test__ = False  # not a pytest class

    def __init__(self, enabled: bool, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        get = env.get if enabled else (lambda _k, d=None: d)
        drop = get("LOCKSTEP_TEST_DROP_PLAN_SEQ")
        self.drop_plan_seq: int | None = int(drop) if drop else None
        self.step_delay_s = float(get("LOCKSTEP_TEST_STEP_DELAY_S") or 0.0)
        block = get("LOCKSTEP_TEST_BLOCK_STEP_AFTER")
        self.block_step_after: int | None = int(block) if block else None
        self.hang_on_signal = (get("LOCKSTEP_TEST_HANG_ON_SIGTERM") or "0") not in ("", "0")

    def before_step(self, step: int) -> None:
        """LOCKSTEP_TEST_BLOCK_STEP_AFTER=N: the main thread never starts step N."""
        if self.block_step_after is not None and step >= self.block_step_after:
            log.warning("test seam: blocking forever before step %d", step)
            threading.Event().wait()

    def on_signal(self, why: str) -> None:
        """LOCKSTEP_TEST_HANG_ON_SIGTERM=1: the clean-up after a signal never ends."""
        if self.hang_on_signal:
            log.warning("test seam: clean-up after %s hangs", why)
            threading.Event().wait()
