"""XTC ("exclude top choices", mlx-lm's `apply_xtc`) as a declared request parameter: the
same exclusion as mlx-lm's on fixed logits, but its coin drawn from the request's (seed,
token index) instead of MLX's global random state, so every rank draws the same coin and
a continuation draws the one the unfaulted run drew at that token. The API side (every
API takes `xtc_probability` / `xtc_threshold` in range and refuses them out of it, the
deployment default, the flags) follows from the declaration: tests/unit/test_request_params.py
walks every declared parameter; here the two are checked to be there."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_xtc

from common import request_params as rp
from common.messages import PlanInsert, SeededSampling
from common.sampling_defaults import SamplingDefaults, SamplingOverrides
from services.rank.sampling import logits_processors_for, make_xtc, xtc_filter

V = 48
EOS = [2, 11]
CTX = SimpleNamespace(eos_ids=EOS, grammars=None)


def logits(seed: int, rows: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 2.5, (rows, V)).astype(np.float32))


@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.1, 0.5])
@pytest.mark.parametrize("special", [[], EOS])
def test_the_exclusion_is_mlx_lms_when_the_coin_says_so(threshold, special):
    """mlx-lm's coin cannot be given, but at probability 1 it always excludes and at 0
    it never does: there both must agree bit for bit."""
    for seed in range(6):
        x = logits(seed, rows=2)
        ids = mx.array(special, dtype=mx.int32) if special else None
        for probability in (1.0, 0.0):
            ours = xtc_filter(x, threshold, ids, mx.array(0.5), probability)
            theirs = apply_xtc(x, probability, threshold, special)
            np.testing.assert_array_equal(np.array(ours), np.array(theirs))


def test_the_coin_is_keyed_by_seed_and_token_index():
    x = logits(7)
    prompt = [5] * 4

    def excluded(seed: int, index: int) -> bool:
        proc = make_xtc(0.5, 0.02, EOS, seed, len(prompt))
        tokens = mx.array(prompt + [9] * index, dtype=mx.int32)
        return bool(mx.isinf(proc(tokens, x)).any().item())

    assert bool(mx.isinf(xtc_filter(x, 0.02, None, mx.array(0.0), 1.0)).any().item())
    runs = [[excluded(42, i) for i in range(300)] for _ in range(2)]  # two ranks
    assert runs[0] == runs[1]  # the same coins, built apart
    assert 0.4 < sum(runs[0]) / 300 < 0.6  # about half the tokens, at probability 0.5
    mx.random.seed(123)
    mx.random.uniform()  # MLX's global state moves: the coins do not
    assert [excluded(42, i) for i in range(300)] == runs[0]
    assert [excluded(43, i) for i in range(300)] != runs[0]


def _insert(resumed: int, **kw) -> PlanInsert:
    prompt = [4, 6, 8] + [9] * resumed  # the client's prompt, then its output so far
    return PlanInsert(request_id="r", prompt=prompt, max_tokens=8, resumed=resumed,
                      sampling=SeededSampling(**{"temperature": 1.0, "seed": 9,
                                                 "xtc_probability": 0.5,
                                                 "xtc_threshold": 0.02, **kw}))


def test_a_continuation_draws_the_coin_the_first_run_drew():
    x = logits(3)
    first = logits_processors_for(_insert(0), CTX)
    again = logits_processors_for(_insert(5), CTX)  # resumed after 5 output tokens
    for n in range(5, 40):  # the context when the token of index n is chosen
        tokens = mx.array([4, 6, 8] + [9] * n, dtype=mx.int32)
        np.testing.assert_array_equal(np.array(first[-1](tokens, x)),
                                      np.array(again[-1](tokens, x)))


def test_greedy_or_probability_0_builds_no_xtc():
    assert logits_processors_for(_insert(0, temperature=0.0), CTX) == []
    ins = _insert(0)
    ins.sampling.xtc_probability = 0.0
    assert logits_processors_for(ins, CTX) == []


def test_eos_is_never_excluded():
    x = mx.zeros((1, V)).at[:, EOS].add(mx.array([5.0, 5.0]))  # the two top choices
    x = x.at[:, 30].add(4.0)
    out = np.array(xtc_filter(x, 0.01, mx.array(EOS, dtype=mx.int32), mx.array(0.0), 1.0))
    assert np.isfinite(out[0, EOS]).all()


def test_declared_once_it_is_a_field_of_every_api_and_a_deployment_default():
    for name in ("xtc_probability", "xtc_threshold"):
        p = rp.BY_NAME[name]
        assert p.deployable and all(p in rp.params_in(api) for api in rp.APIS)
        assert name in SamplingOverrides.__dataclass_fields__
    assert SamplingDefaults().xtc_threshold == 0.1 and SamplingDefaults().xtc_probability == 0.0
    assert rp.problem("xtc_threshold", 0.6) == "xtc_threshold must be a finite number in [0, 0.5]"
