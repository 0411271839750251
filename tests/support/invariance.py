"""The determinism harness's runs: one request through mlx-lm's BatchGenerator (the
engine's) in a given company, chunking, cache start or resume point, and its logprob rows.

Every run returns, per generated position, the full logprob vector the generator saw
(mx.array, float32) and the token drawn (greedy): two runs are the same iff every row is
equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from common.messages import PlanInsert, SeededSampling
from services.rank.sampling import logits_processors_for, make_sampler
from services.rank.spec_step import next_with_drafts


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    rows: list[mx.array] = field(default_factory=list)
    accepted: int = 0  # drafts accepted (tokens emitted past one per step)


@dataclass(frozen=True)
class Companion:
    prompt: list[int]
    at_step: int = 0  # inserted before this step of the probe's generation
    max_tokens: int = 64


def generate(model, prompt: list[int], n: int, *, companions: tuple[Companion, ...] = (),
             prefill_step: int = 2048, cache=None, cached: int = 0,
             sampling: SeededSampling | None = None, resumed: int = 0,
             completion_batch: int = 16, prefill_batch: int = 8, ctx=None,
             propose: Callable[[int, int], list[int]] | None = None) -> Run:
    """The probe's first n tokens (no stop token) and its logprob rows: greedy, or with
    the rank's own sampler and logits processors for `sampling` (its last `resumed`
    prompt tokens are output so far, as a continuation's are); `ctx`: the processors'
    context (services/rank/sampling.ProcessorContext), which a grammar needs.

    `propose(uid, at)`: the drafts for row `uid` (the probe is the first uid) whose next
    draft stands at generated position `at`; each step then verifies them
    (services/rank/spec_step.py), the engine's speculative step."""
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=[],
                         completion_batch_size=completion_batch,
                         prefill_batch_size=prefill_batch, prefill_step_size=prefill_step)
    sampler, processors = None, []
    if sampling is not None:
        ins = PlanInsert(request_id="probe", prompt=list(prompt), max_tokens=n,
                         sampling=sampling, resumed=resumed)
        sampler, processors = make_sampler(sampling, start=resumed), \
            logits_processors_for(ins, ctx)
    try:
        now = [c for c in companions if c.at_step == 0]
        later = sorted((c for c in companions if c.at_step > 0), key=lambda c: c.at_step)
        prompts = [prompt] + [c.prompt for c in now]
        caches = [cache] + [None] * len(now) if cache is not None else None
        done = [prompt[:cached]] + [[] for _ in now] if cache is not None else None
        if cache is not None:
            prompts[0] = prompt[cached:]
        (probe, *_) = gen.insert(prompts, max_tokens=[n] + [c.max_tokens for c in now],
                                 caches=caches, all_tokens=done,
                                 samplers=[sampler] + [None] * len(now),
                                 logits_processors=[processors] + [[] for _ in now])
        run, step = Run(), 0
        emitted: dict[int, int] = {}  # tokens each row has emitted
        while len(run.tokens) < n:
            while later and later[0].at_step <= step:
                c = later.pop(0)
                gen.insert([c.prompt], max_tokens=[c.max_tokens])
            if propose is None:
                _, responses = gen.next()
            else:  # position `at` of a row: its tokens so far and the one it feeds next
                _, responses = next_with_drafts(gen, {u: propose(u, emitted.get(u, 0) + 1)
                                                      for u in gen._generation_batch.uids})
            for r in responses:
                emitted[r.uid] = emitted.get(r.uid, 0) + 1
                if r.uid == probe:
                    run.tokens.append(int(r.token))
                    run.rows.append(r.logprobs)
            if any(r.uid == probe for r in responses):
                step += 1
        run.accepted = len(run.tokens) - step  # a plain step emits one token
        del run.tokens[n:], run.rows[n:]  # a verified step may emit past n
        return run
    finally:
        gen.close()


def prefix_cache(model, prompt: list[int], upto: int):
    """The KV cache of prompt[:upto], as the prompt cache stores an entry: a request run
    on that prefix, its cache extracted (what `BatchGenerator.extract_cache` gives)."""
    gen = BatchGenerator(model, max_tokens=1, stop_tokens=[], prefill_step_size=2048)
    try:
        (uid,) = gen.insert([prompt[:upto]], max_tokens=[1])
        while True:
            _, responses = gen.next()
            for r in responses:
                if r.uid == uid and r.finish_reason is not None:
                    cache = r.prompt_cache
                    # the entry holds prompt[:upto] plus the one generated token: trim it
                    for c in cache:
                        c.trim(c.offset - upto) if c.offset > upto else None
                    return cache
    finally:
        gen.close()


def first_difference(a: Run, b: Run) -> str | None:
    """None if the runs are equal bit for bit, else where and by how much they differ."""
    for i, (x, y) in enumerate(zip(a.rows, b.rows, strict=False)):
        if not bool(mx.array_equal(x, y)):
            d = float(mx.max(mx.abs(x - y)))
            return f"position {i}: logprobs differ by up to {d:.3g}"
    if a.tokens != b.tokens:
        return f"tokens differ: {a.tokens} vs {b.tokens}"
    return None
