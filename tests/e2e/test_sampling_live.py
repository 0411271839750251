"""Sampling fields and logprobs through the real `openai` client, against live TP=2 and
PP=2 deployments of the embedded model: the shared cluster (tests/support/live_cluster.py:
`lockstep up`, real MLX ranks over the ring backend, its gateway in front), idle before
and after each test.

Each field is shown to change the output the way it should against the same request
without it; every request's tokens are then compared across the ranks (each rank's
removal record carries the digest of the tokens it fed: services/rank/removals.py)."""

from __future__ import annotations

import functools
import math

import httpx
import openai
import pytest

from services.gateway.core.detok import load_tokenizer
from services.rank.removals import read_removals, removals_path
from tests.e2e.rank_harness import model_dir
from tests.gwutil import poll_until, sse_lines
from tests.support import live_cluster as lc

PROMPT = "the cat sat on the"
N = 12


MODES = {"tp": lc.TP_MODEL, "pp": lc.PP_MODEL}
RIDS: dict[str, list[str]] = {model: [] for model in MODES.values()}  # every request, per model


@functools.cache
def tokenizer():
    return load_tokenizer(model_dir())  # the same preset and seed as the cluster's


@pytest.fixture(params=list(MODES))
def live(request, live_cluster) -> lc.LiveView:
    """The shared cluster's typed view about the TP=2 deployment, then the PP=2 one."""
    return lc.live_view(live_cluster, MODES[request.param])


def completion(live: lc.LiveView, **kw):
    """A completion (greedy unless told), its request id kept for the agreement check."""
    args = {"model": live.model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, **kw}
    raw = live.openai.completions.with_raw_response.create(**args)
    RIDS[live.model].append(raw.headers["x-lockstep-request-id"])
    return raw.parse().choices[0]


def chat(live: lc.LiveView, **kw):
    args = {"model": live.model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": N, "temperature": 0, **kw}
    raw = live.openai.chat.completions.with_raw_response.create(**args)
    RIDS[live.model].append(raw.headers["x-lockstep-request-id"])
    return raw.parse().choices[0]


def tokens_of(live: lc.LiveView, **kw) -> list[str]:
    """A completion's tokens (their strings, from `logprobs: 0`)."""
    return completion(live, logprobs=0, **kw).logprobs.tokens


def events(r: httpx.Response) -> list[dict]:
    return [v for kind, v in sse_lines(r) if kind == "data" and v != "[DONE]"]


@pytest.mark.timeout(300)
def test_logit_bias_forces_and_bans_tokens(live):
    dog = tokenizer().encode(" dog")[0]
    forced = completion(live, logit_bias={str(dog): 100})
    assert forced.text == " dog" * N
    base = tokens_of(live)
    first = tokenizer().encode(base[0])[0]
    banned = tokens_of(live, logit_bias={str(first): -100})
    assert banned[0] != base[0]


@pytest.mark.timeout(120)
def test_top_k_1_and_min_p_1_sample_the_greedy_token(live):
    greedy = completion(live).text
    sampled = completion(live, temperature=1.0, seed=7).text
    assert sampled != greedy  # temperature 1 alone does sample
    assert completion(live, temperature=1.0, seed=7, extra_body={"top_k": 1}).text == greedy
    assert completion(live, temperature=1.5, seed=8, extra_body={"min_p": 1.0}).text == greedy
    # top_k 5: a seeded draw from the top 5 alone, the same for the same seed
    a = completion(live, temperature=1.0, seed=9, extra_body={"top_k": 5}).text
    assert a == completion(live, temperature=1.0, seed=9, extra_body={"top_k": 5}).text


@pytest.mark.timeout(120)
def test_penalties_change_a_repetitive_greedy_output(live):
    # 20 tokens lifted far above the rest: greedy picks among them and repeats itself
    # (the random-weight model's own repeats are rarer than the margins are wide).
    few = {str(t): 100 for t in range(300, 320)}
    base = tokens_of(live, max_tokens=24, logit_bias=few)
    assert len(set(base)) < len(base)
    for kw in ({"extra_body": {"repetition_penalty": 1.8}},
               {"extra_body": {"repetition_penalty": 1.8, "repetition_context_size": 64}},
               {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        got = tokens_of(live, max_tokens=24, logit_bias=few, **kw)
        assert got != base, kw
        assert len(set(got)) >= len(set(base)), kw  # fewer repeats, not more


@pytest.mark.timeout(120)
def test_chat_logprobs_streamed_and_not(live):
    k = 3
    ch = chat(live, logprobs=True, top_logprobs=k)
    content = ch.logprobs.content
    assert len(content) == N
    raw = b""
    for e in content:
        # a byte-level token may hold part of a character: its bytes are exact
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert e.logprob <= 0 and len(e.top_logprobs) == k
        lps = [a.logprob for a in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        raw += bytes(e.bytes)
    assert raw.decode("utf-8", errors="replace") == ch.message.content
    assert chat(live).logprobs is None  # not asked: null

    r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
        "model": live.model, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": N, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": k})
    RIDS[live.model].append(r.headers["x-lockstep-request-id"])
    streamed = [e for c in events(r) for ch_ in c["choices"] if ch_["logprobs"]
                for e in ch_["logprobs"]["content"]]
    assert streamed == [e.model_dump() for e in content]


@pytest.mark.timeout(120)
def test_completion_logprobs_streamed_and_not(live):
    ch = completion(live, logprobs=2)
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    assert len("".join(lp.tokens)) >= len(ch.text)  # a split character: U+FFFD per part
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[tok] == chosen == max(top.values())
    zero = completion(live, logprobs=0).logprobs
    assert all(len(t) == 1 for t in zero.top_logprobs)  # the sampled token alone
    # sampled (temperature > 0): the chosen token's logprob, whatever its rank
    hot = completion(live, logprobs=1, temperature=1.0, seed=3).logprobs
    assert all(math.isfinite(x) and x <= 0 for x in hot.token_logprobs)

    r = httpx.post(live.url + "/v1/completions", timeout=120, json={
        "model": live.model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
        "stream": True, "logprobs": 2})
    RIDS[live.model].append(r.headers["x-lockstep-request-id"])
    parts = [ch_["logprobs"] for c in events(r) for ch_ in c["choices"] if ch_["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == lp.tokens
    assert sum((p["text_offset"] for p in parts), []) == lp.text_offset


@pytest.mark.timeout(120)
def test_every_field_at_once_and_bad_values(live):
    c = live.openai
    kw = {"temperature": 0.9, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": 0.3,
          "logit_bias": {str(tokenizer().encode(" dog")[0]): 3},
          "extra_body": {"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.2,
                         "repetition_context_size": 8}}
    a, b = completion(live, **kw), completion(live, **kw)
    assert a.text == b.text  # seeded: reproducible with every processor on
    chat(live, logprobs=True, top_logprobs=2, **kw)
    for bad, param in (({"extra_body": {"top_k": -3}}, "top_k"),
                       ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999": 1}}, "logit_bias"),
                       ({"logprobs": 21}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model=live.model, prompt=PROMPT, max_tokens=2, **bad)
        assert ei.value.body["param"] == param


@pytest.mark.timeout(120)
def test_xtc_excludes_top_choices_reproducibly_and_is_refused_out_of_range(live):
    """XTC (common/request_params.py, services/rank/sampling.py make_xtc): at probability
    1 and threshold 0 every step drops all but the least likely token, so the text
    changes against the same seed without it; its coins come from the seed, so it
    reproduces (and the last test sees every rank feed the same tokens)."""
    kw = {"temperature": 1.0, "seed": 5}
    xtc = {**kw, "extra_body": {"xtc_probability": 1.0, "xtc_threshold": 0.0}}
    plain, a, b = completion(live, **kw), completion(live, **xtc), completion(live, **xtc)
    assert a.text == b.text and a.text != plain.text
    half = {**kw, "extra_body": {"xtc_probability": 0.5, "xtc_threshold": 0.01}}
    assert completion(live, **half).text == completion(live, **half).text
    url, msgs = live.url, [{"role": "user", "content": PROMPT}]
    for path, body, shape in (
            ("/v1/chat/completions", {"messages": msgs}, "openai"),
            ("/v1/responses", {"input": PROMPT}, "openai"),
            ("/v1/messages", {"messages": msgs, "max_tokens": 4}, "anthropic")):
        r = httpx.post(url + path, json={"model": live.model, "xtc_threshold": 0.7, **body},
                       timeout=30)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        if shape == "anthropic":
            assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
            assert "xtc_threshold" in err["message"]
        else:
            assert err["param"] == "xtc_threshold", (path, err)


@pytest.mark.timeout(120)
def test_tokens_identical_on_every_rank(live):
    """Last: every request of this module, sampled or not, with any processor, fed the
    same tokens on both ranks."""
    def records():
        out = {}
        for r in (0, 1):
            path = removals_path_of(live, r)
            out[r] = {rec["request_id"]: rec for rec in read_removals(path)}
        return out if all(rid in out[r] for r in (0, 1) for rid in RIDS[live.model]) else None

    recs = poll_until(records, 30, "both ranks' removal records of every request")
    assert len(RIDS[live.model]) >= 20
    for rid in RIDS[live.model]:
        a, b = recs[0][rid], recs[1][rid]
        assert (a["tokens_sha"], a["n_tokens"], a["step"]) == \
            (b["tokens_sha"], b["n_tokens"], b["step"]), rid


def removals_path_of(live: lc.LiveView, rank: int):
    from common.home import Paths

    return removals_path(Paths(live.home), live.dep_id, rank)
