"""Plan sequencing on the wire: rank 0's replay buffer and a follower's reorder window.

Rank 0 numbers plans from 0 without gaps. A follower delivers plan k to its main thread
only after k-1; anything ahead is held, and the follower asks `PLAN_FETCH(k)`. Rank 0
answers from its replay buffer (`PLAN_BATCH`), or with `missing=True` when plan k was
sent but is no longer (or was never) in the buffer: that gap cannot be recovered and the
follower fails closed.
"""

from __future__ import annotations

from collections import deque

from common.messages import Plan, PlanBatch

MAX_BATCH_PLANS = 64
MAX_BATCH_BYTES = 2 * 1024 * 1024  # well under the 4 MiB socket cap
MAX_HELD = 4096


def plan_size(plan: Plan) -> int:
    """A generous estimate of a plan's msgpack size (token ids ≤ 5 bytes each; a
    grammar is UTF-8 text, at most 4 bytes per character; a logit_bias entry ≤ 32 bytes;
    an insert's other fields, its sampling record's included, names too, ≤ 400 bytes)."""
    return 256 + sum(400 + 5 * (len(i.prompt) + len(i.stop_token_ids))
                     + 4 * len(i.sampling.grammar) + 32 * len(i.sampling.logit_bias)
                     for i in plan.inserts) + 96 * len(plan.removes)


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        self.plans: deque[Plan] = deque(maxlen=max(1, capacity))
        self.last_seq = -1  # the highest seq handed out (sent or dropped)

    def record(self, plan: Plan, *, keep: bool = True) -> None:
        if plan.seq != self.last_seq + 1:
            raise ValueError(f"plan seq {plan.seq} after {self.last_seq}")
        self.last_seq = plan.seq
        if keep:
            self.plans.append(plan)

    def fetch(self, from_seq: int) -> PlanBatch:
        if from_seq > self.last_seq:
            return PlanBatch(plans=[], missing=False)  # nothing newer yet
        if from_seq < 0:
            return PlanBatch(plans=[], missing=True)
        start = None
        for i in range(len(self.plans) - 1, -1, -1):  # recent plans are asked for
            seq = self.plans[i].seq
            if seq == from_seq:
                start = i
                break
            if seq < from_seq:
                break
        if start is None:
            return PlanBatch(plans=[], missing=True)
        out: list[Plan] = []
        size = 0
        for i in range(start, len(self.plans)):
            p = self.plans[i]
            if p.seq != from_seq + len(out) or len(out) >= MAX_BATCH_PLANS:
                break  # a hole stops the batch; the next fetch reports it missing
            size += plan_size(p)
            if out and size > MAX_BATCH_BYTES:
                break
            out.append(p)
        return PlanBatch(plans=out, missing=False)


class PlanOrder:
    """Follower side: hands plans on strictly in sequence order."""

    def __init__(self) -> None:
        self.expected: int | None = None
        self.held: dict[int, Plan] = {}

    def start(self, next_seq: int) -> None:
        if self.expected is None:
            self.expected = next_seq

    @property
    def gap(self) -> bool:
        return bool(self.held)

    def offer(self, plan: Plan) -> list[Plan]:
        if self.expected is None or plan.seq < self.expected:
            return []  # before we joined, or a duplicate from a fetch
        if plan.seq > self.expected:
            if len(self.held) < MAX_HELD:
                self.held[plan.seq] = plan
            return []
        out = [plan]
        self.expected += 1
        while self.expected in self.held:
            out.append(self.held.pop(self.expected))
            self.expected += 1
        return out
