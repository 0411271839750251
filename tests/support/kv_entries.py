"""What the disk tier's tests share (tests/unit/test_disk_tier.py, test_disk_entry.py):
KV caches filled as a model fills them, entries, and a factory of tiers closed after."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from services.rank.disk_tier import DiskTier, entry_key, placement_name

FP = "0123456789abcdef"
KEY = b"k" * 32
PLACE = placement_name(0, 2, 1, 0)


def kv_cache(n: int, layers: int = 3, dtype=mx.bfloat16, seed: int = 0) -> list:
    """Per-layer KVCaches filled the way a model fills them (buffers padded past offset)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 8)).astype(dtype),
                           mx.random.normal((1, 2, n, 8)).astype(dtype))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w) and g.offset == w.offset
        for a, b in ((g.keys, w.keys), (g.values, w.values)):
            a, b = a[..., : w.offset, :], b[..., : w.offset, :]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert mx.array_equal(a, b).item()


def entry(n: int, seed: int = 0, **kw):
    tokens = list(range(seed * 1000, seed * 1000 + n))
    return entry_key(tokens), tokens, kv_cache(n, seed=seed, **kw)


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


@pytest.fixture
def tiers(tmp_path):
    """Imported by the test modules that use it (a fixture, named there)."""
    made = []

    def make(placement: str = PLACE, rank: int = 0, key: bytes = KEY, root=None) -> DiskTier:
        t = DiskTier(root or tmp_path / "kv", FP, placement, rank, key)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def reopen(tiers, t: DiskTier) -> DiskTier:
    assert t.flush(10)
    t.close()
    return tiers()
