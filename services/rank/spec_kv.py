"""The KV layout speculative verification takes (issue 46): drafts verified in one forward
pass, rejected positions dropped per row.

A verify step feeds every decoding row its last token plus its drafts, right-padded to
the batch's widest row (W positions), so mlx-lm's `BatchKVCache` advances its one shared
write index by W for every row. Afterwards row i keeps 1 + accepted_i of those positions;
the rest (its rejected drafts and its padding) must leave the row without moving the
positions before them, on every rank alike:

- the shared index is trimmed by the smallest drop (a lone row, or a batch that agreed,
  costs no copy);
- each row's remaining drop r_i is rolled to the left edge, into its padding: the row is
  rotated right by r_i along the key axis (mlx-lm's own `finalize` for right padding),
  its left padding grows by r_i and its offset (its RoPE position) shrinks by r_i.

So a row's kept keys stay contiguous and end at the shared index, as a plain decode
step leaves them; the invariant attention counts its key blocks from the row's first
key (the left padding), so the positions it reduces over, and their order, are the ones
plain decoding has: a verified position's logits equal a plain step's bit for bit
(checked by the determinism harness, tests/support/speculation.py). The rolled-away
slots are masked padding; the buffer reclaims them when mlx-lm's `filter` shifts the
batch left past its smallest padding (a row leaving) — until then they count in the
rank's held KV, and so against its KV budget.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


class NotRewindable(TypeError):
    """A cache layer speculation cannot drop positions from per row (not a BatchKVCache)."""


def rewind_rows(layers: list, drop: list[int]) -> None:
    """Drop the last `drop[i]` positions of row i from every layer's batch cache, in
    place, keeping each row's other keys where plain decoding would have them."""
    if not layers or not any(drop):
        return
    if min(drop) < 0:
        raise ValueError(f"a negative drop: {drop}")
    shared = min(drop)
    rest = [d - shared for d in drop]
    for c in layers:
        if not isinstance(c, BatchKVCache):
            raise NotRewindable(f"{type(c).__name__} cannot drop positions per row")
        if len(drop) != c.offset.shape[0]:
            raise ValueError(f"{len(drop)} drops for a batch of {c.offset.shape[0]}")
        if shared > c._idx:
            raise ValueError(f"drop {shared} past the shared index {c._idx}")
        if shared:
            c.trim(shared)
        if any(rest):
            c.prepare(right_padding=rest)  # mlx-lm: rotate right, grow the left padding
            c.finalize()
    mx.eval([(c.keys, c.values, c.offset, c.left_padding) for c in layers])
