"""The determinism harness's speculative runs (issue 46, item 2): requests decoded by
verifying drafts in one forward pass per step, in one batch, each row with its own number
of drafts, rejected positions dropped per row (services/rank/spec_kv.py). Greedy: a draft
is accepted while it equals the argmax at its position, and the first position that
differs yields the model's own token, so every row's emitted tokens and logprob rows must
be plain decoding's bit for bit (`invariance.first_difference` against `generate`). Seeded:
position j of a row draws token index (its tokens so far + j) with the rank's own
`sampling.draw`, after its logits processors over the context up to that position (the
tokens so far and the drafts before j), as the issue specifies.

Drafts come from a test proposer that knows each request's plain tokens and proposes the
right one with the row's probability p (else a wrong one), from a fixed seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from common.messages import PlanInsert, SeededSampling
from services.rank.sampling import draw, logits_processors_for
from services.rank.spec_kv import rewind_rows
from tests.support.invariance import Run, prefix_cache

DRAFTS = 4  # drafts per step at most


@dataclass(frozen=True)
class Row:
    prompt: list[int]
    truth: list[int]  # its plain run's tokens: the test proposer's oracle, and the length
    p: float  # each draft is right with this probability
    sampling: SeededSampling | None = None  # None: greedy

    def processors(self) -> list:
        if self.sampling is None:
            return []
        return logits_processors_for(PlanInsert(request_id="row", prompt=list(self.prompt),
                                                max_tokens=len(self.truth),
                                                sampling=self.sampling), None)

    def pick(self, logits: mx.array, context: list[int], index: int, procs) -> tuple:
        """Position `index`'s token and logprob row from its logits [1, V], as plain
        decoding computes them (GenerationBatch._step: processors, normalise, sample)."""
        for proc in procs:
            logits = proc(mx.array(context), logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.sampling is None or self.sampling.temperature <= 0.0:
            return int(mx.argmax(logprobs[0]).item()), logprobs[0]
        return int(draw(self.sampling, logprobs, index).item()), logprobs[0]


def _drafts(rng: random.Random, row: Row, at: int, vocab: int) -> list[int]:
    """Up to DRAFTS tokens for positions at, at+1, ...: right with probability p each."""
    out = []
    for j in range(rng.randint(0, DRAFTS)):
        right = row.truth[at + j] if at + j < len(row.truth) else rng.randrange(vocab)
        wrong = (right + 1 + rng.randrange(vocab - 1)) % vocab
        out.append(right if rng.random() < row.p else wrong)
    return out


def prefills(model, rows: list[Row]) -> list[list]:
    """Each row's prompt but its last token, prefilled alone (the KV a plain run decodes
    from); `verified_runs` copies it, so one prefill serves many runs."""
    return [prefix_cache(model, r.prompt, len(r.prompt) - 1) for r in rows]


def verified_runs(model, rows: list[Row], per_prompt: list[list] | None = None,
                  seed: int = 0) -> list[Run]:
    """Each row's first len(truth) tokens and logprob rows, decoded by verification in
    one batch (a row that is done keeps decoding, as padding for the others)."""
    vocab = model.args.vocab_size
    rng = random.Random(seed)
    per_prompt = per_prompt or prefills(model, rows)
    cache = [BatchKVCache.merge(list(layers)) for layers in zip(*per_prompt, strict=True)]
    last = [r.prompt[-1] for r in rows]
    procs = [r.processors() for r in rows]
    runs = [Run() for _ in rows]
    while any(len(run.tokens) < len(r.truth) for run, r in zip(runs, rows, strict=True)):
        drafts = [_drafts(rng, r, len(run.tokens), vocab) for run, r in zip(runs, rows,
                                                                            strict=True)]
        width = 1 + max(len(d) for d in drafts)
        feed = [[x, *d] + [0] * (width - 1 - len(d)) for x, d in zip(last, drafts, strict=True)]
        logits = model(mx.array(feed), cache=cache)
        drop = []
        for i, d in enumerate(drafts):
            kept, done = 0, list(rows[i].prompt) + runs[i].tokens
            for j in range(len(d) + 1):
                token, row = rows[i].pick(logits[i, j][None], done + d[:j],
                                          len(runs[i].tokens), procs[i])
                kept += 1
                if len(runs[i].tokens) < len(rows[i].truth):
                    runs[i].tokens.append(token)
                    runs[i].rows.append(row)
                last[i] = token
                if j == len(d) or d[j] != token:
                    break
            drop.append(width - kept)
        rewind_rows(cache, drop)
    return runs
