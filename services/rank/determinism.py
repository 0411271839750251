"""Deterministic mode: a loaded mlx-lm model made batch-invariant in this process.

mlx-lm stays unmodified on disk; at load time the rank substitutes two things:

- attention: the architecture module's `scaled_dot_product_attention` name (which its
  attention layers call) is pointed at a dispatcher that runs
  services/rank/invariant_attention.py while the switch is on;
- weight products: every plain or tensor-parallel `Linear` whose products OpenBLAS may
  take to its small-matrix kernel (out_features * rows <= 1200) is wrapped so it always
  sees enough rows for the regular kernel (extra zero rows, dropped after). The regular
  kernel gives each row the same bits at any row count; the small one does not.

What is not substituted was measured invariant (tests/unit/test_batch_invariance.py
names each operation): RMSNorm, RoPE at array or scalar offsets, the MLP, the logits'
normalisation and the samplers reduce within a row over a length fixed by the model.

A rank serves one model, so the switch is per process (`install`); the in-process harness
turns it off again (`uninstall`) to show what today's path does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, make_prompt_cache

from common.messages import Determinism
from services.rank.invariant_attention import invariant_sdpa

# The architectures the presets and the default model use, checked by the harness on
# this machine's BLAS. Others take the same code path and report "unverified".
VERIFIED_ARCHITECTURES = ("llama", "ministral3", "qwen2")
SMALL_KERNEL_CELLS = 1200  # OpenBLAS 0.3.21 (SkylakeX): small kernel iff M*N <= 1200
LINEARS = (nn.Linear, AllToShardedLinear, ShardedToAllLinear)

_invariant_modules: set[str] = set()


class NotInvariant(Exception):
    """This model cannot run deterministically (its cache is not a plain KV cache, its
    attention is not mlx-lm's shared one, or its weights are quantized)."""


@dataclass(frozen=True)
class Invariance:
    """What `install` did: the rank's log line and its RANK_READY's `determinism`."""

    architecture: str
    mode: Determinism  # ON (an architecture the harness checks) or UNVERIFIED
    linears_floored: int  # Linear layers given a row floor

    def line(self) -> str:
        return (f"deterministic: {self.mode.value} ({self.architecture}; attention by "
                f"position blocks, {self.linears_floored} Linear layers given a row floor)")


class RowFloor(nn.Module):
    """A Linear that always multiplies at least `rows` rows (zero rows added, dropped)."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows

    def __call__(self, x: mx.array) -> mx.array:
        lead, width = x.shape[:-1], x.shape[-1]
        n = 1
        for d in lead:
            n *= d
        if n >= self.rows:
            return self.inner(x)
        flat = mx.pad(x.reshape(n, width), [(0, self.rows - n), (0, 0)])
        out = self.inner(flat)[:n]
        return out.reshape(*lead, out.shape[-1])


def _dispatch(queries, keys, values, cache, scale, mask, sinks=None):
    if sinks is None and not hasattr(cache, "bits"):
        return invariant_sdpa(queries, keys, values, scale, mask, cache)
    raise NotInvariant("attention sinks or a quantized KV cache in deterministic mode")


def _floor_linears(module: nn.Module) -> int:
    count = 0
    for name, child in module.children().items():
        items = child if isinstance(child, list) else [child]
        for i, c in enumerate(items):
            if isinstance(c, nn.QuantizedLinear):
                raise NotInvariant("quantized weights (MLX's quantized products are not "
                                   "checked for batch invariance)")
            if isinstance(c, LINEARS) and not isinstance(c, RowFloor):
                out = c.weight.shape[0]
                if out <= SMALL_KERNEL_CELLS:
                    wrapped = RowFloor(c, SMALL_KERNEL_CELLS // out + 1)
                    if isinstance(child, list):
                        child[i] = wrapped
                    else:
                        setattr(module, name, wrapped)
                    count += 1
            elif isinstance(c, nn.Module):
                count += _floor_linears(c)
    return count


def install(model: nn.Module) -> Invariance:
    """Make `model` batch-invariant in this process, or raise NotInvariant."""
    caches = make_prompt_cache(model)
    odd = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if odd:
        raise NotInvariant(f"its cache is not a plain KV cache ({', '.join(odd)})")
    mod = sys.modules[type(model).__module__]
    if getattr(mod, "scaled_dot_product_attention", None) not in (
            mlx_base.scaled_dot_product_attention, _dispatch):
        raise NotInvariant(f"{mod.__name__} does not use mlx-lm's shared attention")
    floored = _floor_linears(model)
    mod.scaled_dot_product_attention = _dispatch
    _invariant_modules.add(mod.__name__)
    arch = mod.__name__.rsplit(".", 1)[-1]
    mode = Determinism.ON if arch in VERIFIED_ARCHITECTURES else Determinism.UNVERIFIED
    return Invariance(arch, mode, floored)


def uninstall(model: nn.Module) -> None:
    """The harness's way back to today's path (a fresh model has no row floors)."""
    mod = sys.modules[type(model).__module__]
    if mod.__name__ in _invariant_modules:
        mod.scaled_dot_product_attention = mlx_base.scaled_dot_product_attention
        _invariant_modules.discard(mod.__name__)
