"""Fault switches for tests, honoured only when `RankSettings.rank_test_seams` is true
(docs/rank.md "Test seams"): LOCKSTEP_TEST_DROP_PLAN_SEQ, LOCKSTEP_TEST_STEP_DELAY_S,
LOCKSTEP_TEST_BLOCK_STEP_AFTER, LOCKSTEP_TEST_HANG_ON_SIGTERM, LOCKSTEP_TEST_DRAFTS_P."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from common.config import Probability, Seconds, load_settings

log = logging.getLogger("lockstep.rank")


@dataclass(frozen=True)
class SeamSettings:
    """The switches, each `LOCKSTEP_<NAME>` (parsed by common.config)."""

    test_drop_plan_seq: int | None = None
    test_step_delay_s: Seconds = 0.0
    test_block_step_after: int | None = None
    test_hang_on_sigterm: bool = False
    # speculating rank 0 proposes what an earlier request with the same prompt (and seed,
    # when sampled) emitted, each draft right with this probability
    # (services/rank/spec_propose.py ReplayDrafts)
    test_drafts_p: Probability | None = None


class TestSeams:
    """Fault switches, honoured only when `settings.rank_test_seams` is true."""

    __test__ = False  # not a pytest class

    def __init__(self, enabled: bool, env: Mapping[str, str] | None = None) -> None:
        s = load_settings(SeamSettings, env=env, blank_is_unset=True) if enabled \
            else SeamSettings()
        self.drop_plan_seq = s.test_drop_plan_seq
        self.step_delay_s = s.test_step_delay_s
        self.block_step_after = s.test_block_step_after
        self.hang_on_signal = s.test_hang_on_sigterm
        self.drafts_p = s.test_drafts_p

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
