"""Attention whose every output bit depends on the row's own query, keys and values.

mlx-lm's attention on the CPU is `mx.fast.scaled_dot_product_attention`, which falls
back to `softmax(q @ k.T) @ v` over the keys the batch holds. With the OpenBLAS the ranks
preload, what a row gets then depends on its neighbours (docs/rank.md "Determinism"):

- `P @ V` reduces over every key of the batch's buffer in one `sgemm`, and OpenBLAS splits
  a reduction longer than its K block (256 here) into partial sums whose boundaries fall
  by the buffer's length, not the row's: left padding, the prefill chunk and the cache
  layout all move them.
- small products take another kernel (the "small matrix" path, chosen by M*N*K), so a
  decode step (one query) and a prefill (many) add in different orders.
- softmax's sum over a row's keys runs in SIMD lanes that padding shifts.

Here the reduction over keys is fixed by the row's absolute positions. Keys are taken in
canonical blocks of BLOCK positions counted from the row's first key; each block's
`P @ V` is one FMA chain (a single OpenBLAS K block, whatever the call's M: zeros
anywhere in a chain add nothing, so masked keys cannot move it) and its share of the
softmax denominator one reduction over the block's BLOCK lanes; the blocks' partial sums
are added in position order by a strided `sum` (MLX adds along a non-innermost axis one
slice at a time). A row's blocks are strided views of the KV cache's own buffer, so
rows with different padding need no copy of their keys.

A decode step over few keys (WINDOWS_UP_TO) takes all rows in one product instead: each
row's block lies inside a window of 2*BLOCK buffer positions starting at a multiple of
BLOCK, at offset `first_key % BLOCK`, the rest of the window masked to zero (the same
chain: K = 2*BLOCK is still one OpenBLAS K block).

Scores `q @ k.T` reduce over the head dimension only; the call is kept off OpenBLAS's
small-matrix kernel (which adds in another order than the regular one) by giving it at
least SCORE_MIN_CELLS outputs per head (zero query rows added when a step has fewer).

The result is not mlx-lm's bit for bit (another summation order, like any attention
kernel), but it is the same for a position whether it is computed alone, beside any
other rows, in any prefill chunk, from a cached prefix or one token at a time.
"""

from __future__ import annotations

import mlx.core as mx

# The canonical key block: its `P @ V` (K = BLOCK) stays inside one OpenBLAS K block
# (measured: one FMA chain for K <= 256, split at a length-dependent place above).
BLOCK = 128
# OpenBLAS (0.3.21, SkylakeX/Cooperlake kernels) takes its small-matrix kernel for
# q @ k.T when keys * queries <= 1200: pad the queries past that so every call, decode or
# prefill, uses the regular kernel (which gives each output the same bits at any M, N).
SCORE_MIN_CELLS = 1201
# `P @ V`'s columns: a multiple of 16, or OpenBLAS's edge kernel adds in another order
# for some M than for others (measured: 65 and 68 columns vary with M, 64 and 80 not).
OUT_COLUMNS = 16
DEN_COLUMNS = 16  # the softmax denominator: `P @ ones`, the same chains as `P @ V`
# A decode step over at most this many keys takes every row in one product of windows
# (twice the multiply-adds, no Python loop over rows); longer, row by row (measured,
# B=8: windows 0.20 vs 0.32 ms a layer at 100 keys, 2.5 vs 1.2 ms at 1500).
WINDOWS_UP_TO = 512


class UnsupportedMask(ValueError):
    """A mask the invariant attention cannot reduce in position order (additive values,
    per-head masks): the warm-up's forward pass meets it, so the rank fails its load."""


def allowed_keys(mask, B: int, L: int, S: int) -> mx.array:
    """Which keys each query attends to: a bool [B, L, S] (broadcast over heads)."""
    if mask is None:
        return mx.ones((1, L, S), dtype=mx.bool_)
    if isinstance(mask, str):
        if mask != "causal":
            raise UnsupportedMask(f"mask {mask!r}")
        q = mx.arange(S - L, S)[:, None]
        return (q >= mx.arange(S)[None])[None]
    if mask.dtype != mx.bool_:
        raise UnsupportedMask(f"an additive {mask.dtype} mask")
    m = mask
    while m.ndim > 3:
        if m.shape[1] != 1:
            raise UnsupportedMask(f"a per-head mask of shape {mask.shape}")
        m = m.squeeze(1)
    if m.ndim == 2:
        m = m[None]
    return m


class _FirstKeys:
    """Each row's first key (the buffer index of its position 0), read once per mask
    object: a model builds one mask per forward pass and hands it to every layer."""

    def __init__(self) -> None:
        self._mask = None
        self._first: list[int] = []

    def of(self, mask, allowed: mx.array, B: int) -> list[int]:
        if mask is None or isinstance(mask, str):
            return [0] * B
        if mask is not self._mask:
            self._mask = mask
            first = mx.argmax(allowed[:, -1, :], axis=-1).tolist()
            self._first = first * B if len(first) == 1 else first
        return self._first


_first_keys = _FirstKeys()


def value_buffer(values: mx.array, cache) -> mx.array:
    """The row-major buffer `values` is the head of: the KV cache's own buffer when it is
    one (its first S positions are `values`), else a copy. Blocks are strided views of
    it, so no block is copied."""
    buf = getattr(cache, "values", None)
    S = values.shape[2]
    held = getattr(cache, "_idx", None)
    if held is None:
        held = getattr(cache, "offset", None)
    if (isinstance(buf, mx.array) and isinstance(held, int) and held == S
            and buf.ndim == 4 and buf.shape[:2] == values.shape[:2]
            and buf.shape[3] == values.shape[3] and buf.shape[2] >= S):
        return mx.contiguous(buf)  # already row-major: no copy
    return mx.contiguous(values)


def _ones(n: int, dtype) -> mx.array:
    return mx.ones((n, DEN_COLUMNS), dtype=dtype)


def _row(p: mx.array, values: mx.array, buf: mx.array, b: int, first: int) -> mx.array:
    """Row b, whose position 0 is buffer index `first`: p [B, Hkv, M, S] (row-major),
    values [B, Hkv, S, Dv] (the head of `buf`) -> [P @ V | P @ 1] summed over the row's
    canonical blocks in position order, [Hkv, M, Dv + 1]. Keys before `first` are
    padding. Within a block each is one FMA chain."""
    B, Hkv, M, S = p.shape
    Dv, alloc = values.shape[3], buf.shape[2]
    n = (S - first) // BLOCK
    end = first + n * BLOCK
    nums, dens = [], []
    if n:
        pm = mx.contiguous(mx.as_strided(p, (Hkv, n, M, BLOCK), (M * S, BLOCK, S, 1),
                                         b * Hkv * M * S + first))
        vm = mx.as_strided(buf, (Hkv, n, BLOCK, Dv), (alloc * Dv, BLOCK * Dv, Dv, 1),
                           (b * Hkv * alloc + first) * Dv)
        nums.append(pm @ vm)
        dens.append(pm @ _ones(BLOCK, p.dtype))
    if end < S:  # the last block, short: a shorter chain is the same chain
        pt = p[b, :, None, :, end:]
        nums.append(pt @ values[b, :, None, end:])
        dens.append(pt @ _ones(S - end, p.dtype))
    if not nums:  # no key at all (a padding row)
        return mx.zeros((Hkv, M, Dv + 1), p.dtype)
    num = mx.sum(mx.concatenate(nums, axis=1), axis=1)  # blocks in position order
    den = mx.sum(mx.concatenate(dens, axis=1), axis=1)[..., :1]
    return mx.concatenate([num, den], axis=-1)


def _windows(p: mx.array, buf: mx.array, S: int, first: list[int]) -> mx.array:
    """Every row at once (a decode step: few query rows, so P is small): window t is the
    buffer's [t*BLOCK, (t+2)*BLOCK); the canonical block of row b that starts in its
    first half sits at offset first_b % BLOCK, the rest of the window is masked to zero
    (a zero adds nothing to a chain). Windows are strided views of the cache buffer where
    it is long enough, of a zero-padded copy of its tail where not. -> [B, Hkv, M, Dv+1]"""
    B, Hkv, M, _ = p.shape
    Dv, alloc = buf.shape[3], buf.shape[2]
    T = -(-S // BLOCK)
    pb = mx.pad(p, [(0, 0), (0, 0), (0, 0), (0, (T + 1) * BLOCK - S)])
    pb = pb.reshape(B, Hkv, M, T + 1, BLOCK)
    pw = mx.concatenate([pb[..., :T, :], pb[..., 1:, :]], axis=-1)  # [B, Hkv, M, T, 2B]
    offset = mx.array([f % BLOCK for f in first])[:, None]
    u = mx.arange(2 * BLOCK)[None]
    in_block = ((u >= offset) & (u < offset + BLOCK)).reshape(B, 1, 1, 1, 2 * BLOCK)
    pw = mx.where(in_block, pw, mx.zeros_like(pw)).transpose(0, 1, 3, 2, 4)  # [B,Hkv,T,M,2B]
    fit = max(0, min(T, alloc // BLOCK - 1))  # windows inside the buffer
    parts_v, parts_d = [], []
    if fit:
        vw = mx.as_strided(buf, (B, Hkv, fit, 2 * BLOCK, Dv),
                           (Hkv * alloc * Dv, alloc * Dv, BLOCK * Dv, Dv, 1))
        parts_v.append(pw[:, :, :fit] @ vw)
    if fit < T:
        tail = buf[:, :, fit * BLOCK:min(alloc, (T + 1) * BLOCK)]
        tail = mx.pad(tail, [(0, 0), (0, 0), (0, (T + 1 - fit) * BLOCK - tail.shape[2]),
                             (0, 0)])
        vw = mx.as_strided(tail, (B, Hkv, T - fit, 2 * BLOCK, Dv),
                           ((T + 1 - fit) * BLOCK * Hkv * Dv, (T + 1 - fit) * BLOCK * Dv,
                            BLOCK * Dv, Dv, 1))
        parts_v.append(pw[:, :, fit:] @ vw)
    parts_d.append(pw @ _ones(2 * BLOCK, p.dtype))
    num = mx.sum(mx.concatenate(parts_v, axis=2), axis=2)  # blocks in position order
    den = mx.sum(parts_d[0], axis=2)[..., :1]
    return mx.concatenate([num, den], axis=-1)


def invariant_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                   mask=None, cache=None) -> mx.array:
    """queries [B, Hq, L, D], keys and values [B, Hkv, S, D] -> [B, Hq, L, D]."""
    B, Hq, L, D = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    Dv = values.shape[3]
    rep = Hq // Hkv
    M = rep * L
    dtype = queries.dtype
    allowed = allowed_keys(mask, B, L, S)  # [B|1, L, S]
    first = _first_keys.of(mask, allowed, B)
    buf = value_buffer(values, cache)
    if Dv % OUT_COLUMNS:  # a column count OpenBLAS reduces alike at every M
        extra = OUT_COLUMNS - Dv % OUT_COLUMNS
        buf = mx.pad(buf, [(0, 0), (0, 0), (0, 0), (0, extra)])
        values = buf[:, :, :S]

    q = (queries * mx.array(scale, dtype)).reshape(B, Hkv, M, D)  # rows r*L + l
    if M * S < SCORE_MIN_CELLS:  # zero query rows: cheaper than copying the keys
        q = mx.pad(q, [(0, 0), (0, 0), (0, -(-SCORE_MIN_CELLS // S) - M), (0, 0)])
    scores = (q @ keys.swapaxes(-1, -2))[..., :M, :].reshape(B, Hkv, rep, L, S)
    ok = allowed[:, None, None]
    scores = mx.where(ok, scores, -mx.inf)
    top = mx.max(scores, axis=-1, keepdims=True)
    top = mx.where(mx.isinf(top), mx.zeros_like(top), top)  # no key at all: zeros
    p = mx.contiguous(mx.exp(scores - top).reshape(B, Hkv, M, S))  # masked: exp(-inf) = 0

    if L == 1 and B > 1 and S <= WINDOWS_UP_TO:  # a short decode step: one batched product
        acc = _windows(p, buf, S, first)
    else:
        acc = mx.stack([_row(p, values, buf, b, first[b]) for b in range(B)])
    den = acc[..., Dv:]
    out = acc[..., :Dv] / mx.where(den == 0, mx.ones_like(den), den)
    return out.reshape(B, Hq, L, Dv).astype(dtype)
