"""Per-request logits processors and sampler filters (services/rank/sampling.py) and
rank 0's logprobs extraction (services/rank/logprobs.py): pure functions, checked
against mlx-lm's own maths, and the same output for the same input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
    make_repetition_penalty,
)

from common.messages import PlanInsert, SeededSampling, TokenBias
from services.rank.logprobs import extract
from services.rank.sampling import (
    logits_processors_for,
    make_sampler,
    min_p_filter,
    top_k_filter,
)

V = 64
PROMPT = [3, 5, 7, 5]


def insert(**kw) -> PlanInsert:
    """An insert whose sampling record has `kw` (and temperature 1, seed 1)."""
    return PlanInsert(request_id="r", prompt=list(PROMPT), max_tokens=8,
                      sampling=SeededSampling(temperature=1.0, seed=1, **kw))


def sampler(temperature: float, top_p: float, seed: int, **kw):
    return make_sampler(SeededSampling(temperature=temperature, top_p=top_p, seed=seed, **kw))


def logits(seed: int = 0, rows: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 3, (rows, V)).astype(np.float32))


def run(procs, tokens: list[int], x: mx.array) -> np.ndarray:
    t = mx.array(tokens, dtype=mx.int32)
    x = mx.array(np.array(x))  # a copy: mlx-lm's repetition penalty writes into its input
    for p in procs:
        x = p(t, x)
    return np.array(x)


def test_all_off_builds_no_processor():
    assert logits_processors_for(insert(), None) == []
    assert logits_processors_for(insert(repetition_penalty=1.0, presence_penalty=0.0), None) == []


def test_logit_bias_matches_mlx_lm():
    bias = {9: 100.0, 2: -100.0, 40: 1.5}
    ours = logits_processors_for(insert(logit_bias=[TokenBias(t, b) for t, b in bias.items()]), None)
    theirs = make_logits_processors(logit_bias=bias)
    x = logits(1)
    np.testing.assert_allclose(run(ours, PROMPT, x), run(theirs, PROMPT, x), rtol=0, atol=1e-6)
    assert int(np.argmax(run(ours, PROMPT, x))) == 9  # +100 forces it


def test_repetition_penalty_matches_mlx_lm_over_prompt_and_completion():
    ctx = [*PROMPT, 11, 12, 11]
    for size in (2, 20):
        ours = logits_processors_for(insert(repetition_penalty=1.7, repetition_context_size=size),
                                     None)
        theirs = [make_repetition_penalty(1.7, size)]
        x = logits(2)
        np.testing.assert_allclose(run(ours, ctx, x), run(theirs, ctx, x), atol=1e-6)
    # context 2: only the last two tokens (12, 11) are penalised
    got = run(logits_processors_for(insert(repetition_penalty=2.0, repetition_context_size=2),
                                    None), ctx, logits(2))
    base = np.array(logits(2))
    changed = set(np.flatnonzero(~np.isclose(got, base))[:])
    assert changed == {11, 12}


def test_presence_and_frequency_apply_to_generated_tokens_only():
    gen = [11, 12, 11, 5]  # 5 is also in the prompt: counted once (generated once)
    ctx = [*PROMPT, *gen]
    ours = logits_processors_for(insert(presence_penalty=0.5, frequency_penalty=0.3), None)
    # mlx-lm's, over exactly the generated tokens (its window = their count)
    theirs = [make_presence_penalty(0.5, len(gen)), make_frequency_penalty(0.3, len(gen))]
    x = logits(3)
    np.testing.assert_allclose(run(ours, ctx, x), run(theirs, ctx, x), atol=1e-6)
    got, base = run(ours, ctx, x), np.array(x)[0]
    assert got[0, 11] == pytest.approx(base[11] - 0.5 - 2 * 0.3, abs=1e-5)
    assert got[0, 7] == pytest.approx(base[7])  # prompt only: not penalised
    # before any token is generated the context is the prompt: nothing changes
    np.testing.assert_array_equal(run(ours, PROMPT, x), np.array(x))


def test_processors_are_pure():
    ins = insert(logit_bias=[TokenBias(4, 3.0)], repetition_penalty=1.3, presence_penalty=0.2,
                 frequency_penalty=-0.4)
    ctx = [*PROMPT, 9, 9, 1]
    x = logits(4)
    before = np.array(x)
    t = mx.array(ctx, dtype=mx.int32)

    def apply(procs):
        y = x
        for p in procs:
            y = p(t, y)
        return np.array(y)

    a = apply(logits_processors_for(ins, None))
    procs = logits_processors_for(ins, None)
    b, c = apply(procs), apply(procs)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b, c)
    np.testing.assert_array_equal(np.array(x), before)  # the input is not changed


def test_bias_keeps_the_logits_dtype():
    x = logits(5).astype(mx.bfloat16)
    procs = logits_processors_for(insert(logit_bias=[TokenBias(1, 2.0)], presence_penalty=0.5),
                                  None)
    t = mx.array([*PROMPT, 1])
    for p in procs:
        x = p(t, x)
    assert x.dtype == mx.bfloat16


def test_top_k_and_min_p_filters_match_mlx_lm():
    x = logits(6, rows=3)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    for k in (1, 5, V - 1):
        ours = np.array(top_k_filter(lp, k))
        theirs = np.array(apply_top_k(lp, k))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
        assert (np.isfinite(ours).sum(axis=-1) == k).all()
    np.testing.assert_array_equal(np.array(top_k_filter(lp, V)), np.array(lp))  # off
    for p in (0.05, 0.5, 1.0):
        np.testing.assert_array_equal(np.array(min_p_filter(lp, p)), np.array(apply_min_p(lp, p)))


def test_sampler_top_k_1_and_min_p_1_are_greedy_and_seeded():
    x = logits(7)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    best = int(mx.argmax(lp, axis=-1).item())
    for seed in range(20):
        assert sampler(1.0, 1.0, seed, top_k=1)(lp).item() == best
        assert sampler(1.5, 1.0, seed, min_p=1.0)(lp).item() == best
    # the same seed draws the same tokens, whatever else was sampled
    draws = [sampler(1.0, 1.0, 42, top_k=8) for _ in range(2)]
    a = [draws[0](lp).item() for _ in range(16)]
    mx.random.seed(123)
    mx.random.uniform()  # a global draw in between changes nothing
    b = [draws[1](lp).item() for _ in range(16)]
    assert a == b
    top8 = set(np.argsort(-np.array(lp)[0])[:8].tolist())
    assert set(a) <= top8 and len(set(a)) > 1


def test_extract_matches_a_full_sort():
    rows = [logits(8 + i)[0] for i in range(3)]
    rows = [r - mx.logsumexp(r) for r in rows]
    tokens, ks = [4, 0, 63], [5, 0, 20]
    got = extract(rows, tokens, ks)
    for r, t, k, g in zip(rows, tokens, ks, got, strict=True):
        a = np.array(r)
        assert g.logprob == pytest.approx(float(a[t]))
        order = sorted(range(V), key=lambda i: (-a[i], i))[:k]
        assert g.top_ids == order
        np.testing.assert_allclose(g.top_logprobs, a[order], rtol=1e-6)
    assert extract([], [], []) == []
    assert extract(rows[:1], [1], [V + 5])[0].top_ids == sorted(
        range(V), key=lambda i: -np.array(rows[0])[i])  # capped at the vocabulary


def test_plan_size_bounds_an_insert_with_every_sampling_field():
    import msgpack

    from common.messages import Plan
    from common.schema import to_wire
    from services.rank.planwire import plan_size

    for n_bias in (0, 1024):
        s = SeededSampling(temperature=0.7, top_p=0.9, seed=2**62, top_k=10**6, min_p=0.05,
                           presence_penalty=1.5, frequency_penalty=-1.5, repetition_penalty=1.3,
                           repetition_context_size=2**20,
                           logit_bias=[TokenBias(150000 + i, -99.5) for i in range(n_bias)])
        ins = PlanInsert(request_id="chatcmpl-" + "a" * 24, prompt=[150000] * 10,
                         max_tokens=10**6, sampling=s, stop_token_ids=[1, 2], cache_entry=2**40,
                         cached_tokens=10**6, top_logprobs=20, resumed=2**20)
        plan = Plan(seq=2**40, step=2**40, advance=True, inserts=[ins] * 4)
        assert len(msgpack.packb(to_wire(plan))) <= plan_size(plan)
