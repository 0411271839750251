"""The gateway's sampling and logprobs fields: OpenAI request → Generate's Sampling record
and top_logprobs, each bad value a 400 naming its field (before any GENERATE); rank 0's
own check of the same fields; logprobs in OpenAI's two shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.messages import Generate, Sampling, SeededSampling, TokenBias, Tokens
from common.sampling_defaults import Origin, SamplingDefaults
from services.gateway.core import logprobs as lp
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.sampling_params import sampling_for
from services.gateway.openai.schemas import ChatRequest, CompletionRequest, validate
from services.gateway.openai.translate import from_chat, from_completion
from services.rank.sampling import sampling_problem, top_logprobs_problem
from tests.e2e.rank_harness import model_dir

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(model_dir())


def fields(req, tok, *, chat: bool, defaults: SamplingDefaults | None = None) -> dict:
    """What the gateway puts in the request's Generate: its Sampling record's fields (but
    the seed and grammar admission passes in) and top_logprobs."""
    internal = from_chat(req) if chat else from_completion(req)
    s = sampling_for(internal.params, tok, defaults or SamplingDefaults(), seed=0)
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
           if f.name not in ("seed", "grammar")}
    return {**out, "top_logprobs": internal.logprobs}


def chat(tok, **kw) -> dict:
    req = validate(ChatRequest, json.dumps({"model": "m", "messages": MSGS, **kw}).encode())
    return fields(req, tok, chat=True)


def completion(tok, **kw) -> dict:
    req = validate(CompletionRequest, json.dumps({"model": "m", "prompt": "x", **kw}).encode())
    return fields(req, tok, chat=False)


def refused(fn, tok, **kw) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(tok, **kw)
    assert ei.value.status == 400
    return ei.value


def test_defaults_are_off_and_equal_the_wire_defaults(tok):
    got = chat(tok)
    g = Generate(request_id="r", prompt=[1], max_tokens=1)
    wire = {**{k: getattr(g.sampling, k) for k in got if k != "top_logprobs"},
            "top_logprobs": g.top_logprobs}
    # the server's temperature default is OpenAI's 1, not the wire's 0 (greedy)
    assert got["temperature"] == 1.0
    assert {k: v for k, v in got.items() if k != "temperature"} == {
        k: v for k, v in wire.items() if k != "temperature"}
    assert completion(tok) == got


def test_fields_map_into_generate(tok):
    got = chat(tok, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-1,
               repetition_penalty=1.3, repetition_context_size=64,
               logit_bias={"7": 100, "3": -100.0}, logprobs=True, top_logprobs=4)
    assert got == {"temperature": 1.0, "top_p": 1.0,
                   "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                   "repetition_penalty": 1.3, "repetition_context_size": 64,
                   "logit_bias": [TokenBias(3, -100.0), TokenBias(7, 100.0)], "top_logprobs": 4,
                   "xtc_probability": 0.0, "xtc_threshold": 0.1,
                   "speculative": True}  # the declared defaults
    assert chat(tok, logprobs=True)["top_logprobs"] == 0
    assert chat(tok, logprobs=False)["top_logprobs"] == -1
    assert chat(tok, top_k=-1)["top_k"] == 0  # vLLM's "off"
    assert completion(tok, logprobs=0)["top_logprobs"] == 0
    assert completion(tok, logprobs=20)["top_logprobs"] == 20
    # what the gateway sends, rank 0 accepts and plans as is
    s = Sampling(**{k: v for k, v in got.items() if k != "top_logprobs"})
    assert sampling_problem(s, len(tok.hf)) is None and top_logprobs_problem(4) is None
    assert s.seeded(7) == SeededSampling(seed=7, **{k: v for k, v in got.items()
                                                     if k != "top_logprobs"})


def test_omitted_fields_take_the_deployments_defaults_and_named_ones_win(tok):
    d = SamplingDefaults(temperature=0.0, top_p=0.9, top_k=40, min_p=0.05,
                         repetition_penalty=1.1, origin={"temperature": Origin.OPERATOR})
    req = validate(ChatRequest, json.dumps({"model": "m", "messages": MSGS}).encode())
    got = fields(req, tok, chat=True, defaults=d)
    assert {k: got[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} \
        == {"temperature": 0.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    named = validate(ChatRequest, json.dumps({
        "model": "m", "messages": MSGS, "temperature": 0.7, "top_p": 1, "top_k": -1,
        "min_p": 0, "repetition_penalty": 1}).encode())
    got = fields(named, tok, chat=True, defaults=d)
    assert {k: got[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} \
        == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.mark.parametrize("fn,kw,param", [
    (chat, {"top_k": -2}, "top_k"),
    (chat, {"top_k": 1.5}, "top_k"),
    (chat, {"top_k": 10**20}, "top_k"),  # beyond any vocabulary (and the wire's int64)
    (completion, {"top_k": (1 << 24) + 1}, "top_k"),
    (chat, {"min_p": 1.5}, "min_p"),
    (chat, {"presence_penalty": 2.5}, "presence_penalty"),
    (completion, {"frequency_penalty": -3}, "frequency_penalty"),
    (chat, {"repetition_penalty": 0}, "repetition_penalty"),
    (chat, {"repetition_context_size": 0}, "repetition_context_size"),
    (chat, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (chat, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (chat, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (completion, {"logit_bias": {"5": 101}}, "logit_bias"),
    (chat, {"logit_bias": {"5": "x"}}, "logit_bias.5"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (chat, {"logprobs": 1}, "logprobs"),  # chat's is a bool
    (completion, {"logprobs": 21}, "logprobs"),
    (completion, {"logprobs": True}, "logprobs"),
    (completion, {"logprobs": 1, "echo": True}, "logprobs"),
])
def test_bad_values_are_400s_naming_the_field(tok, fn, kw, param):
    assert refused(fn, tok, **kw).param == param


def test_rank0_refuses_what_the_gateway_would(tok):
    v = len(tok.hf)

    def problem(**kw):
        return sampling_problem(Sampling(**kw), v)

    assert problem() is None
    for kw in ({"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
               {"top_p": 1.5}, {"top_k": -2}, {"temperature": 2.5}, {"min_p": float("nan")}, {"presence_penalty": 3.0},
               {"frequency_penalty": float("inf")}, {"repetition_penalty": 0.0},
               {"repetition_context_size": 0}, {"seed": -1}, {"seed": 2**63},
               {"logit_bias": [TokenBias(v, 1.0)]}, {"logit_bias": [TokenBias(1, 100.5)]},
               {"logit_bias": [TokenBias(1, 1.0), TokenBias(1, 2.0)]}):
        assert problem(**kw), kw
    assert top_logprobs_problem(-1) is None and top_logprobs_problem(20) is None
    assert top_logprobs_problem(21) and top_logprobs_problem(-2)


def body(tok, ids: list[int], k: int) -> Tokens:
    return Tokens(request_id="r", tokens=ids, index=0, logprobs=[-0.5] * len(ids),
                  top_ids=[[i, 3][:k] for i in ids], top_logprobs=[[-0.5, -float("inf")][:k]
                                                                   for _ in ids])


def test_chat_and_completion_shapes(tok):
    ids = tok.encode("the cat sat")
    entries = lp.from_body(tok, body(tok, ids, 2))
    c = lp.chat(entries)
    assert c["refusal"] is None and len(c["content"]) == len(ids)
    for e, t in zip(c["content"], ids, strict=True):
        assert e["token"] == tok.decode([t]) and bytes(e["bytes"]).decode() == e["token"]
        assert e["logprob"] == -0.5 and [a["logprob"] for a in e["top_logprobs"]] == [-0.5, -9999.0]
        assert e["top_logprobs"][0]["token"] == e["token"]
    shaper = lp.CompletionShaper()
    first, second = shaper(entries[:1]), shaper(entries[1:])  # a stream: offsets carry on
    assert first["text_offset"] == [0]
    toks = first["tokens"] + second["tokens"]
    assert "".join(toks) == "the cat sat"
    offs = first["text_offset"] + second["text_offset"]
    assert offs == [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
    assert all(len(d) == 2 for d in first["top_logprobs"] + second["top_logprobs"])
    # k=0: the sampled token alone (completions always hold it), chat: no alternatives
    zero = lp.from_body(tok, body(tok, ids, 0))
    assert lp.CompletionShaper()(zero)["top_logprobs"][0] == {tok.decode([ids[0]]): -0.5}
    assert lp.chat(zero)["content"][0]["top_logprobs"] == []
    json.dumps(c, allow_nan=False)  # valid JSON: no -inf
    # a special token: its added-token text
    assert lp.token_text(tok, tok.eos_ids[0])[0].startswith("<|")
