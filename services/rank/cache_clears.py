"""Rank 0's admin cache clears: CACHE_CLEAR on control in, CACHE_CLEARED on report out.

Kept by rank 0's I/O thread (services/rank/io.py). The supervisor re-sends a CACHE_CLEAR
until it is answered, so one `clear_id` may arrive many times:
- the first copy goes to the main thread (`CacheClearEv`): the Leader asks its prefix
  cache for a CLEAR op (`CachePlanner.request_clear(clear_id)`), and once the plan
  carrying it is handed to the I/O thread, posts `Report(CacheCleared(..., step))` right
  behind that plan; the I/O thread records the answer here as it sends it;
- a copy of a clear still waiting for its plan is dropped;
- a copy of one already answered is answered again (the answer may have been lost).
With the prefix cache off there is nothing to clear: the request is answered at once,
at the current step, and the main thread never sees it.
"""

from __future__ import annotations

from collections import OrderedDict

from common.messages import CacheClear, CacheCleared
from services.rank.outbox import Report

ANSWERED_KEPT = 64  # answered clear ids remembered, to answer their re-sends


class ClearLedger:
    def __init__(self, deployment_id: str, *, enabled: bool) -> None:
        self.deployment_id = deployment_id
        self.enabled = enabled
        self.pending: set[int] = set()  # handed to the main thread, not answered yet
        self.answered: OrderedDict[int, CacheCleared] = OrderedDict()

    def on_request(self, body: CacheClear, step: int) -> tuple[bool, CacheCleared | None]:
        """(hand it to the main thread?, the answer to send now, if any)."""
        done = self.answered.get(body.clear_id)
        if done is not None:
            return False, done
        if body.clear_id in self.pending:
            return False, None
        if not self.enabled:
            return False, self._answer(body.clear_id, step)
        self.pending.add(body.clear_id)
        return True, None

    def on_answer(self, answer: CacheCleared) -> None:
        """The main thread's answer, on its way out: re-sends of it are answered alike."""
        self.pending.discard(answer.clear_id)
        self.answered[answer.clear_id] = answer
        while len(self.answered) > ANSWERED_KEPT:
            self.answered.popitem(last=False)

    def _answer(self, clear_id: int, step: int) -> CacheCleared:
        out = CacheCleared(deployment_id=self.deployment_id, clear_id=clear_id, rank=0,
                           step=step)
        self.on_answer(out)
        return out


def answers(cleared: list[int], deployment_id: str, step: int) -> list[Report]:
    """The Leader's answers for the clears whose CLEAR the plan for `step` carries
    (`CachePlanner.take_cleared()`), posted right behind that plan."""
    return [Report(CacheCleared(deployment_id=deployment_id, clear_id=c, rank=0, step=step))
            for c in cleared]
