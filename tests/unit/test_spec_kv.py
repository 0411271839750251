"""Dropping rejected drafts per row from mlx-lm's BatchKVCache (services/rank/spec_kv.py):
each row keeps exactly its accepted keys, contiguous and ending at the shared index, with
its position (offset) and padding moved to match. Bit equality of the logits this gives
is the determinism harness's (tests/unit/test_batch_invariance.py, "drafts verified")."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from services.rank.spec_kv import NotRewindable, rewind_rows

H, D = 2, 4


def _keys(b: int, n: int, base: int) -> mx.array:
    """Distinct values per (row, position): row r, step t holds base + 100 r + t."""
    v = mx.arange(n)[None, None, :, None] + 100 * mx.arange(b)[:, None, None, None] + base
    return mx.broadcast_to(v, (b, H, n, D)).astype(mx.float32)


def _cache(left_padding: list[int], prompt: int) -> BatchKVCache:
    c = BatchKVCache(left_padding)
    k = _keys(len(left_padding), prompt, 0)
    c.update_and_fetch(k, k + 0.5)
    return c


def _row(c: BatchKVCache, r: int) -> list[float]:
    """Row r's unpadded keys (head 0, dim 0), as its attention sees them."""
    lp = int(c.left_padding[r].item())
    return c.keys[r, 0, lp:c._idx, 0].tolist()


def test_each_row_keeps_its_accepted_keys_contiguous_up_to_the_shared_index():
    c = _cache([2, 0, 1], prompt=6)
    before = [_row(c, r) for r in range(3)]
    offsets = c.offset.tolist()
    verify = _keys(3, 4, 1000)  # the last token plus three drafts (or padding) per row
    c.update_and_fetch(verify, verify + 0.5)
    rewind_rows([c], [3, 1, 0])  # kept 1, 3 and 4 of the 4 verified positions
    kept = [1, 3, 4]
    for r in range(3):
        new = verify[r, 0, :kept[r], 0].tolist()
        assert _row(c, r) == before[r] + new
        lp = int(c.left_padding[r].item())
        assert c.values[r, 0, lp:c._idx, 0].tolist() == [x + 0.5 for x in before[r] + new]
    assert c.offset.tolist() == [o + k for o, k in zip(offsets, kept, strict=True)]
    assert c.left_padding.tolist() == [2 + 3, 0 + 1, 1 + 0]
    # the mask the next step builds hides every dropped slot of every row
    mask = c.make_mask(1)
    for r in range(3):
        visible = mask[r, 0, 0, :c._idx + 1].tolist()
        assert sum(visible) == len(_row(c, r)) + 1


def test_a_drop_every_row_shares_is_a_trim_with_no_copy():
    c = _cache([0, 3], prompt=5)
    idx, pads = c._idx, c.left_padding.tolist()
    verify = _keys(2, 3, 1000)
    c.update_and_fetch(verify, verify)
    rewind_rows([c], [2, 2])
    assert c._idx == idx + 1 and c.left_padding.tolist() == pads
    assert [_row(c, r)[-1] for r in range(2)] == verify[:, 0, 0, 0].tolist()


def test_nothing_to_drop_changes_nothing():
    c = _cache([1, 0], prompt=4)
    state = [mx.array(x) if isinstance(x, mx.array) else x for x in c.state]
    rewind_rows([c], [0, 0])
    for a, b in zip(state, c.state, strict=True):
        assert (a.tolist() if isinstance(a, mx.array) else a) == \
            (b.tolist() if isinstance(b, mx.array) else b)


def test_a_cache_that_cannot_drop_per_row_is_refused():
    with pytest.raises(NotRewindable, match="KVCache"):
        rewind_rows([KVCache()], [1])
    with pytest.raises(ValueError, match="negative"):
        rewind_rows([_cache([0], 3)], [-1])
    with pytest.raises(ValueError, match="2 drops for a batch of 1"):
        rewind_rows([_cache([0], 3)], [1, 1])
