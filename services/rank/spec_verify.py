"""One verify step (issue 46, item 2): every decoding row's last token and its drafts in
one forward pass, each position's token drawn as plain decoding would draw it there,
drafts accepted while they equal the drawn token, the rest dropped from the KV per row.

Position j of a row sees the logits processors over its context up to that position (its
tokens so far and its drafts before j) and draws token index `index + j` with the rank's
own `sampling.draw` (greedy: the argmax), so what a row emits — its accepted drafts and
then the first drawn token that differs, or one more after all were accepted — is plain
decoding's, token for token and logprob for logprob (the determinism harness checks it,
tests/support/speculation.py). The KV layout: services/rank/spec_kv.py.

Positions are picked in order and the first mismatch ends the row, so a processor is
called only over accepted tokens: a grammar's matcher, which advances by the context's
last token at each call, consumes exactly the accepted drafts (each one its mask
allowed) and never a rejected or forbidden one, and needs no rollback. The engine's decode batch runs it through
services/rank/spec_step.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from common.messages import SeededSampling
from services.rank.sampling import LogitsProcessor, draw
from services.rank.spec_kv import rewind_rows

PAD = 0  # fed after a row's drafts up to the batch's width; dropped with its KV


@dataclass(frozen=True)
class Verifying:
    """One row of a verify step."""

    last: int  # the row's latest token (fed first: its KV is not in the cache yet)
    drafts: Sequence[int]
    # every token so far, `last` included (the processors' context; an mx.array: the
    # engine's token buffer as a plain step would pass it)
    context: Sequence[int] | mx.array
    index: int  # the index (in its completion) of the token position 0 draws
    sampling: SeededSampling | None = None  # None or temperature 0: greedy
    processors: Sequence[LogitsProcessor] = ()


@dataclass
class Verified:
    tokens: list[int] = field(default_factory=list)  # emitted: accepted drafts, then one drawn
    logprobs: list[mx.array] = field(default_factory=list)  # each emitted token's row [V]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def pick(row: Verifying, logits: mx.array, j: int) -> tuple[int, mx.array]:
    """Position j's token and logprob row from its logits [1, V], as mlx-lm's
    GenerationBatch._step computes a plain step's: processors, normalise, sample."""
    if row.processors:
        context = row.context if isinstance(row.context, mx.array) else mx.array(row.context)
        if j:
            context = mx.concatenate([context, mx.array(row.drafts[:j], dtype=context.dtype)])
        for proc in row.processors:
            logits = proc(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if row.sampling is None or row.sampling.temperature <= 0.0:
        return int(mx.argmax(logprobs[0]).item()), logprobs[0]
    return int(draw(row.sampling, logprobs, row.index + j).item()), logprobs[0]


def verify(model, cache: list, rows: Sequence[Verifying]) -> list[Verified]:
    """One forward pass over every row's last token and drafts; each row's emitted tokens.
    The cache ends holding exactly each row's context plus what it emitted but the last
    (fed by the next step), as after that many plain steps."""
    width = 1 + max(len(r.drafts) for r in rows)
    feed = [[r.last, *r.drafts] + [PAD] * (width - 1 - len(r.drafts)) for r in rows]
    logits = model(mx.array(feed), cache=cache)
    out, drop = [], []
    for i, r in enumerate(rows):
        got = Verified()
        for j in range(len(r.drafts) + 1):
            token, lp = pick(r, logits[i, j][None], j)
            got.tokens.append(token)
            got.logprobs.append(lp)
            if j == len(r.drafts) or r.drafts[j] != token:
                break
        out.append(got)
        drop.append(width - len(got.tokens))
    rewind_rows(cache, drop)
    return out
