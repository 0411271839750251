"""The KV budget (issue 45): the bytes of KV cache a rank may hold for the requests it
runs, enforced by rank 0's admission and followed by every rank through the plan.

How mlx-lm 0.32 allocates a batch's KV (`BatchKVCache`, models/cache.py) -- every row of
a batch is as long as the batch's buffer:

- a batch's buffer is `rows x length` token slots per layer; `length` grows in steps of
  256 past the last write (`step`), a prompt chunk of n tokens by ceil(n / 256) steps;
- rows are right-aligned (left padding), so the write index is the longest row's length
  (a removal shifts the buffer left by the smallest padding; joining the prompt batch to
  the decode batch pads both to the longer buffer);
- a buffer that must grow is first cut to its last write, then grows by whole steps
  of 256 past it (a prompt chunk of n tokens: ceil(n / 256) steps, all of them written
  but the last one's rest), so after any step no buffer holds more than 255 slots past
  its longest row: one growth (GROWTH) bounds it, whatever the prompt chunk.

So before every step rank 0 checks that the batch, each row counted at its length now
(prompt + tokens so far; a prompt still prefilling counts whole) plus the one token the
step adds, fits: `rows x (longest + 1 + growth) x slot bytes` <= the budget. The queue's
head is inserted only if the batch with it fits (nothing overtakes a waiting head); when
the rows' growth no longer fits, rank 0 preempts (`victims`): the plan removes the row
whose leaving frees the most bytes (padding included) on every rank, and rank 0 re-queues
it first in line as prompt + the tokens it produced -- the resume path's continuation, so
with determinism on its client gets exactly the unpreempted run's tokens after a pause. A
re-admitted request is not preempted again before it emits MIN_PROGRESS tokens unless
nothing else is left; a request alone always fits (its max_tokens is capped at admission
to what fits alone), so no rank holds more KV than the budget at a step boundary. Slot
bytes are rank 0's own, measured from its warm-up batch: the most of any rank (TP shards
the KV heads equally; mlx-lm's even PP split gives the low ranks, rank 0 first, the extra
layers). What a step allocates and frees within itself (the copy a growth or a join
makes) is working memory on top, like the activations: the auto budget's headroom is for
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlx_lm.models.cache import BatchKVCache, KVCache

GROWTH = BatchKVCache.step  # slots a buffer grows by past its last write


class KvLayoutError(Exception):
    """A cache this accounting does not describe (rotating, quantized, SSM...)."""


def slot_bytes(caches: Sequence[object]) -> int:
    """Bytes one token slot of one row takes over every layer this rank holds, read off a
    live batch's per-layer caches (a layer of another PP stage holds nothing here)."""
    total = slots = 0
    for c in caches:
        if not isinstance(c, (BatchKVCache, KVCache)):
            raise KvLayoutError(f"{type(c).__name__} is not a plain KV cache")
        if c.keys is None:
            continue
        rows, _, length, _ = c.keys.shape
        total += c.keys.nbytes + c.values.nbytes
        slots = rows * length
    if not slots:
        raise KvLayoutError("the batch holds no KV to measure")
    return total // slots


MIN_PROGRESS = 16  # tokens a re-admitted request emits before it may be preempted again


@dataclass(frozen=True)
class Row:
    """A request in the batch as the preemption choice sees it."""

    length: int  # prompt (with any continuation) + tokens emitted since its insert
    order: int  # admission order: later admitted, larger
    protected: bool = False  # re-admitted after a preemption, MIN_PROGRESS not reached
    priority: int = 0  # lower runs first: a larger value is preempted first
    pinned: bool = False  # never preempted: being removed, or inserted by this plan


@dataclass(frozen=True)
class KvBudget:
    budget: int  # bytes per rank
    slot: int  # bytes per token slot (rank 0's: the largest shard)
    slack: int = GROWTH  # slots a buffer may hold past its longest row

    def need(self, lengths: Iterable[int]) -> int:
        """Bytes the batch's buffers may hold after its next step: rows whose content is
        at most `lengths` now (a prompt counted whole from its insert), one token more
        each, as long as the longest, plus one growth."""
        lengths = list(lengths)
        if not lengths:
            return 0
        return len(lengths) * (max(lengths) + 1 + self.slack) * self.slot

    def fits(self, lengths: Iterable[int]) -> bool:
        return self.need(lengths) <= self.budget

    def max_tokens_alone(self, prompt: int) -> int:
        """The most tokens a request of `prompt` tokens may generate alone in the budget
        (< 1: it cannot run at all): alone, it is never preempted."""
        return self.budget // self.slot - self.slack - prompt

    def refusal(self, prompt: int) -> str:
        need = self.need([prompt])
        return (f"the request needs {need} bytes of KV per rank ({prompt} prompt tokens + 1 "
                f"+ {self.slack} slots of growth, {self.slot} bytes each), more than this "
                f"deployment's KV budget of {self.budget} bytes per rank (--kv-budget-bytes)")

    def victims(self, rows: dict[str, Row]) -> list[str]:
        """The requests to preempt before the next step so that the rest fit, in the
        order chosen: each time the lowest priority (the largest value), then the one
        whose leaving frees the most bytes (padding included: the longest row shortens
        every row's buffer), then the latest admitted; protected rows only when no other
        is left. Never the last row: alone, a request fits (its max_tokens was capped so
        at admission)."""
        left = dict(rows)
        out: list[str] = []
        while len(left) > 1 and not self.fits(r.length for r in left.values()):
            pool = ([k for k, r in left.items() if not r.protected and not r.pinned]
                    or [k for k, r in left.items() if not r.pinned])
            if not pool:
                break
            victim = max(pool, key=lambda k, rows=left: self._rank(rows, k))
            out.append(victim)
            del left[victim]
        return out

    def room_for(self, rows: dict[str, Row], length: int, priority: int,
                 max_rows: int) -> list[str] | None:
        """The running requests of lower priority (a larger value) to preempt so that a
        waiting request of `length` tokens and `priority` gets a slot (at most `max_rows`
        rows) and its KV: chosen as `victims` does, protected rows never; None if even
        all of them would not make room (then none is preempted)."""
        left = dict(rows)
        out: list[str] = []
        while len(left) + 1 > max_rows or not self.fits([*(r.length for r in left.values()),
                                                         length]):
            pool = [k for k, r in left.items()
                    if r.priority > priority and not r.protected and not r.pinned]
            if not pool:
                return None
            victim = max(pool, key=lambda k, rows=left: self._rank(rows, k))
            out.append(victim)
            del left[victim]
        return out

    def _rank(self, rows: dict[str, Row], k: str) -> tuple[int, int, int]:
        """(priority, bytes freed if `k` leaves `rows`, admission order): the larger,
        the sooner preempted."""
        rest = (r.length for j, r in rows.items() if j != k)
        freed = self.need(r.length for r in rows.values()) - self.need(rest)
        return rows[k].priority, freed, rows[k].order


# No budget: rank 0 still makes room by priority, for slots alone.
UNBOUNDED = KvBudget(budget=1 << 62, slot=1, slack=0)
