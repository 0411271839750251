"""The serving benchmarks' prompts are what they claim (bench/workload.py): deterministic
per key, distinct from their first token across keys, about as long as asked in the
model's own tokens; and their percentiles are the usual ones (bench/chat_client.py)."""

from __future__ import annotations

import pytest

from bench.chat_client import Reply, pct, summarize
from bench.workload import (
    chat_prompt_tokens,
    count_tokens,
    load_tokenizer,
    log_uniform_lengths,
    prose,
)
from models.tinymodel.tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("benchtok")
    write_tokenizer(d)
    return load_tokenizer(d)


def test_prose_is_deterministic_distinct_and_about_as_long_as_asked(tok):
    a, b = prose(tok, 400, "run0/t1"), prose(tok, 400, "run0/t2")
    assert prose(tok, 400, "run0/t1") == a
    assert a != b
    ids_a = tok.encode(a, add_special_tokens=False)
    for other in ("run0/t2", "run1/t1", "warm/0", "x"):
        ids_b = tok.encode(prose(tok, 400, other), add_special_tokens=False)
        shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
        assert shared <= 3  # texts part at once: no prefix worth caching
    for n in (300, 1500):
        got = count_tokens(tok, prose(tok, n, f"len{n}"))
        assert n <= got <= n * 1.1 + 40


def test_chat_prompt_tokens_are_token_ids_with_the_template(tok):
    text = prose(tok, 200, "chat")
    ids = chat_prompt_tokens(tok, [{"role": "user", "content": text}])
    assert all(isinstance(t, int) for t in ids)
    assert len(ids) > count_tokens(tok, text)  # the template's tokens come on top


def test_log_uniform_lengths_are_fixed_by_key_and_in_range():
    v = log_uniform_lengths(200, 200, 2000, "k")
    assert v == log_uniform_lengths(200, 200, 2000, "k") != log_uniform_lengths(200, 200, 2000, "j")
    assert min(v) >= 200 and max(v) <= 2000
    assert sum(x < 632 for x in v) > 60  # about half below the geometric middle


def test_percentiles_and_summary():
    assert pct([], 50) is None
    assert pct([3.0, 1.0, 2.0], 50) == 2.0
    assert pct([0.0, 10.0], 90) == pytest.approx(9.0)
    r = Reply(0.0, ttft_s=0.5, chunk_s=[0.5, 0.6, 0.8], completion_tokens=3, prompt_tokens=10)
    s = summarize([r], 2.0)
    assert s["tok_s"] == 1.5 and s["ttft_p50_ms"] == 500.0
    assert s["itl_p50_ms"] == pytest.approx(150.0)
    assert s["chunks_per_token"] == 1.0 and s["missing_ttft"] == 0
