"""The KV budget (issue 45): the bytes of KV cache a rank may hold for the requests it
runs, enforced by rank 0's admission and followed by every rank through the plan.

How mlx-lm 0.32 allocates a batch's KV (`BatchKVCache`, models/cache.py) -- every row of
a batch is as long as the batch's buffer:

- a batch's buffer is `rows x length` token slots per layer; `length` grows in steps of
  256 past the last write (`step`), a prompt chunk of n tokens by ceil(n / 256) steps;
- rows are right-aligned (left padding), so the write index is the longest row's length
  (a removal shifts the buffer left by the smallest padding; joining the prompt batch to
  the decode batch pads both to the longer buffer);
- so at a step boundary no buffer is longer than the longest row it will ever hold plus
  one growth (256 slots, or one prompt chunk rounded up to 256).

Rank 0 therefore *reserves*, for every request in the batch and the one it would admit,
`rows x (longest prompt + max_tokens + growth) x slot bytes`: the most the batch's buffers
can reach before any of them finishes, padding included, whatever the order in which its
rows grow. A request waits in rank 0's queue until that fits, so no rank holds more KV
than the budget at any step boundary without preempting anything (the issue's preemption,
which would admit on the current length instead, is not built). Slot bytes are rank 0's
own, measured from its warm-up batch: the most of any rank (TP shards the KV heads
equally; mlx-lm's even PP split gives the low ranks, rank 0 first, the extra layers).
What a step allocates and frees within itself (the copy a growth or a join makes) is
working memory on top, like the activations: the auto budget's headroom is for it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlx_lm.models.cache import BatchKVCache, KVCache

GROWTH = BatchKVCache.step  # slots a buffer grows by past its last write


class KvLayoutError(Exception):
    """A cache this accounting does not describe (rotating, quantized, SSM...)."""


def slack_slots(chunk: int) -> int:
    """Slots a buffer may hold past its longest row: one growth, or one prompt chunk of
    `chunk` tokens rounded up to the growth step."""
    return max(GROWTH, -(-chunk // GROWTH) * GROWTH)


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


class Admit(str, enum.Enum):
    """What rank 0 does with the next waiting request (a closed set)."""

    FITS = "fits"  # insert it now
    WAITS = "waits"  # not with the batch as it is: keep it first in the queue
    NEVER = "never"  # not even alone: refuse it


@dataclass(frozen=True)
class KvBudget:
    budget: int  # bytes per rank
    slot: int  # bytes per token slot (rank 0's: the largest shard)
    slack: int  # slots past the longest row (slack_slots of the largest prompt chunk)

    def need(self, rows: Iterable[tuple[int, int]]) -> int:
        """Bytes reserved for a batch of (prompt tokens, max_tokens) rows."""
        rows = list(rows)
        if not rows:
            return 0
        return len(rows) * (max(p + m for p, m in rows) + self.slack) * self.slot

    def admit(self, running: list[tuple[int, int]], row: tuple[int, int]) -> Admit:
        if self.need([row]) > self.budget:
            return Admit.NEVER
        return Admit.FITS if self.need([*running, row]) <= self.budget else Admit.WAITS

    def max_tokens_alone(self, prompt: int) -> int:
        """The most tokens a request of `prompt` tokens may generate alone in the budget
        (< 1: it cannot run at all)."""
        return self.budget // self.slot - self.slack - prompt

    def refusal(self, prompt: int) -> str:
        need = self.need([(prompt, 1)])
        return (f"the request needs {need} bytes of KV per rank ({prompt} prompt tokens + 1 "
                f"+ {self.slack} slots of growth, {self.slot} bytes each), more than this "
                f"deployment's KV budget of {self.budget} bytes per rank (--kv-budget-bytes)")
