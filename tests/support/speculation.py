"""The determinism harness's speculative runs (issue 46, item 2): requests decoded by the
rank's verify step (services/rank/spec_verify.py) in one batch, each row with its own
number of drafts, rejected positions dropped per row (services/rank/spec_kv.py). Every
row's emitted tokens and logprob rows must be plain decoding's bit for bit
(`invariance.first_difference` against `generate`), greedy and seeded with penalties.

Drafts come from a test proposer that knows each request's plain tokens and proposes the
right one with the row's probability p (else a wrong one), from a fixed seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mlx_lm.models.cache import BatchKVCache

from common.messages import PlanInsert, SeededSampling
from services.rank.sampling import logits_processors_for
from services.rank.spec_verify import Verifying, verify
from tests.support.invariance import Run, prefix_cache

DRAFTS = 4  # drafts per step at most


@dataclass(frozen=True)
class Row:
    prompt: list[int]
    truth: list[int]  # its plain run's tokens: the test proposer's oracle, and the length
    p: float  # each draft is right with this probability
    sampling: SeededSampling | None = None  # None: greedy
    ctx: object = None  # the processors' context (a grammar needs the rank's matchers)

    def processors(self) -> list:
        """Fresh each run: a grammar's processor advances its matcher as it is called."""
        if self.sampling is None:
            return []
        return logits_processors_for(PlanInsert(request_id="row", prompt=list(self.prompt),
                                                max_tokens=len(self.truth),
                                                sampling=self.sampling), self.ctx)


def drafts_for(rng: random.Random, row: Row, at: int, vocab: int) -> list[int]:
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
                  seed: int = 0) -> tuple[list[Run], list[int]]:
    """Each row's first len(truth) tokens and logprob rows, decoded by verification in
    one batch (a row that is done keeps decoding, as padding for the others), and how
    many of its drafts were accepted while it was not done."""
    vocab = model.args.vocab_size
    rng = random.Random(seed)
    per_prompt = per_prompt or prefills(model, rows)
    cache = [BatchKVCache.merge(list(layers)) for layers in zip(*per_prompt, strict=True)]
    procs = [r.processors() for r in rows]
    seqs = [list(r.prompt) for r in rows]  # every token so far, per row
    runs = [Run() for _ in rows]
    accepted = [0] * len(rows)
    while any(len(run.tokens) < len(r.truth) for run, r in zip(runs, rows, strict=True)):
        step = [Verifying(last=seq[-1], drafts=drafts_for(rng, r, len(seq) - len(r.prompt), vocab),
                          context=list(seq), index=len(seq) - len(r.prompt),
                          sampling=r.sampling, processors=p)
                for seq, r, p in zip(seqs, rows, procs, strict=True)]
        for i, got in enumerate(verify(model, cache, step)):
            seq, run, r = seqs[i], runs[i], rows[i]
            seq.extend(got.tokens)
            room = len(r.truth) - len(run.tokens)
            accepted[i] += got.accepted if room > 0 else 0
            run.tokens.extend(got.tokens[:room])
            run.rows.extend(got.logprobs[:room])
    return runs, accepted
