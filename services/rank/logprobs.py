"""Rank 0's per-token logprobs for the requests that asked (`PlanInsert.top_logprobs`).

Each step's `GenerationBatch.Response.logprobs` is the row's full-vocabulary
log-softmax, after the request's logits processors and before temperature and the
sampler's filters (what mlx_lm.server reports). Only rank 0 reads it, and only for the
rows that asked: one stacked array per step, the top k by `argpartition` (linear, not a
vocabulary sort), one evaluation for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the token emitted
    top_ids: list[int]  # the k most likely, best first (ties: the lower id first)
    top_logprobs: list[float]


def extract(rows: list[mx.array], tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """For each row (a (vocab,) logprobs array), the emitted token's logprob and its
    top ks[i] alternatives."""
    if not rows:
        return []
    x = mx.stack(rows).astype(mx.float32)  # (n, vocab)
    chosen = mx.take_along_axis(x, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    k = min(max(ks), x.shape[-1])
    if k <= 0:
        mx.eval(chosen)
        return [TokenLogprobs(float(c), [], []) for c in chosen.tolist()]
    idx = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(x, idx, axis=-1)
    mx.eval(chosen, idx, vals)
    out = []
    for c, ids, lps, want in zip(chosen.tolist(), idx.tolist(), vals.tolist(), ks, strict=True):
        best = sorted(zip(lps, ids, strict=True), key=lambda p: (-p[0], p[1]))[:max(want, 0)]
        out.append(TokenLogprobs(float(c), [i for _, i in best], [lp for lp, _ in best]))
    return out


def step_logprobs(emitted: list, k_of: Callable[[str], int]) -> dict[int, TokenLogprobs]:
    """Rank 0, once per step: the index in `emitted` → that token's logprobs, for each
    emitted token (`engine.Emitted` with its `logprobs` row) whose request asked
    (`k_of(id)` >= 0). A request emits several tokens in a step whose drafts it accepted."""
    asked = []
    for i, e in enumerate(emitted):
        if e.token is None or e.logprobs is None:
            continue
        k = k_of(e.active.request_id)
        if k >= 0:
            asked.append((i, e, k))
    if not asked:
        return {}
    got = extract([e.logprobs for _, e, _ in asked], [e.token for _, e, _ in asked],
                  [k for _, _, k in asked])
    return {i: g for (i, _, _), g in zip(asked, got, strict=True)}


def chunk_fields(ts: list[TokenLogprobs]) -> dict:
    """StreamChunk keywords for a chunk's tokens, in order ({}: not asked)."""
    if not ts:
        return {}
    return {"logprobs": [t.logprob for t in ts], "top_ids": [t.top_ids for t in ts],
            "top_logprobs": [t.top_logprobs for t in ts]}
