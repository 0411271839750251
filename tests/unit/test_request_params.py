"""Each request parameter is declared once (common/request_params.py) and every layer
agrees with the declaration: each API's schema takes it with the declared range (that
API's where it differs), Responses and Messages carry it into the internal request as
chat does, the deployment defaults and rank 0's check refuse what the gateway refuses,
and the wire record's defaults are the declared "off" values."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from common import request_params as rp
from common import sampling_defaults
from common.messages import Sampling
from services.gateway.anthropic import schemas as anthropic_schemas
from services.gateway.anthropic import translate as anthropic_translate
from services.gateway.core.errors import ApiError
from services.gateway.openai import schemas as openai_schemas
from services.gateway.openai import translate as openai_translate
from services.gateway.responses import schemas as responses_schemas
from services.gateway.responses import translate as responses_translate
from services.rank.sampling import sampling_problem
from tests.support.params import samples

MSGS = [{"role": "user", "content": "add 7"}]


def parse(api: str, **fields):
    """`fields` through `api`'s own validation, translated into the internal request."""
    if api in (rp.CHAT, rp.COMPLETIONS):
        cls, base = ((openai_schemas.ChatRequest, {"messages": MSGS}) if api == rp.CHAT
                     else (openai_schemas.CompletionRequest, {"prompt": "add 7"}))
        req = openai_schemas.validate(cls, json.dumps({"model": "m", **base, **fields}).encode())
        return (openai_translate.from_chat(req) if api == rp.CHAT
                else openai_translate.from_completion(req))
    if api == rp.RESPONSES:
        req = responses_schemas.validate(json.dumps(
            {"model": "m", "input": "add 7", **fields}).encode())
        return responses_translate.to_internal(req, [])
    req = anthropic_schemas.validate(json.dumps(
        {"model": "m", "messages": MSGS, "max_tokens": 9, **fields}).encode(),
        anthropic_schemas.CREATE)
    return anthropic_translate.to_internal(req)


def outside(b: rp.Bounds, kind: type) -> list[float]:
    """Values just past each finite end of `b`, and ones no range takes."""
    step = 1 if kind is int else 1e-9
    out = []
    if b.lo is not None:
        out.append(b.lo if b.lo_open else kind(b.lo - step))
    if b.hi is not None:
        out.append(b.hi if b.hi_open else kind(b.hi + step))
    return out + ([math.nan, math.inf] if kind is float else [1.5])


def inside(b: rp.Bounds, kind: type) -> list[float]:
    step = 1 if kind is int else 1e-9
    out = []
    if b.lo is not None:
        out.append(kind(b.lo + step) if b.lo_open else kind(b.lo))
    if b.hi is not None:
        out.append(kind(b.hi - step) if b.hi_open else kind(b.hi))
    return out


@pytest.mark.parametrize("api", rp.APIS)
def test_every_api_takes_each_declared_parameter_in_its_declared_range(api):
    for p in rp.params_in(api):
        if p.kind is dict:
            continue  # logit_bias: below
        if p.kind is bool:  # true or false, nothing JSON would coerce
            for v in (True, False):
                assert parse(api, **{p.name: v}).params[p.name] is v, (p.name, v)
                assert rp.problem(p.name, v, api) is None
            for v in ("yes", 1, 0, "true"):
                with pytest.raises(ApiError) as e:
                    parse(api, **{p.name: v})
                assert e.value.status == 400 and e.value.param == p.name, (p.name, v)
                assert rp.problem(p.name, v, api) is not None
            continue
        b = p.bounds_in(api)
        for v in inside(b, p.kind):
            assert parse(api, **{p.name: v}).params[p.name] == v, (p.name, v)
        for v in outside(b, p.kind):
            if isinstance(v, float) and not math.isfinite(v):
                continue  # JSON has no NaN/inf: checked apart below
            with pytest.raises(ApiError) as e:
                parse(api, **{p.name: v})
            assert e.value.status == 400 and e.value.param == p.name, (p.name, v)
        assert rp.problem(p.name, b.lo if b.lo is not None and not b.lo_open else inside(b, p.kind)[0],
                          api) is None


@pytest.mark.parametrize("api", [rp.RESPONSES, rp.MESSAGES])
def test_the_same_question_through_each_api_reaches_the_same_internal_request(api):
    values = samples(api)
    chat = parse(rp.CHAT, **values)
    other = parse(api, **values)
    assert other.params == chat.params == values
    assert {"seed", "min_p", "top_k"} <= set(values)  # the extensions reach every API


def test_messages_keeps_anthropics_own_ranges():
    assert rp.BY_NAME["temperature"].bounds_in(rp.MESSAGES) == rp.Bounds(0.0, 1.0)
    with pytest.raises(ApiError) as e:
        parse(rp.MESSAGES, temperature=1.5)
    assert e.value.param == "temperature"
    assert parse(rp.CHAT, temperature=1.5).params["temperature"] == 1.5


def test_rank0_and_the_deployment_defaults_check_the_declared_ranges():
    for p in rp.WIRE:
        for v in outside(p.bounds, p.kind):
            s = dataclasses.replace(Sampling(), **{p.name: v})
            assert sampling_problem(s, 100) == rp.problem(p.name, v) is not None, (p.name, v)
            if p.deployable:
                assert sampling_defaults.problem(p.name, v) == rp.problem(p.name, v)
        for v in inside(p.bounds, p.kind):
            assert sampling_problem(dataclasses.replace(Sampling(), **{p.name: v}), 100) is None
            assert sampling_defaults.problem(p.name, v) is None or not p.deployable


def test_the_wire_and_the_defaults_follow_the_declaration():
    wire = {f.name: f.default for f in dataclasses.fields(Sampling)}
    for p in rp.WIRE:
        assert wire[p.name] == p.off, p.name
    assert sampling_defaults.FIELDS == rp.DEPLOYABLE
    defaults = sampling_defaults.SamplingDefaults()
    assert {n: getattr(defaults, n) for n in rp.DEPLOYABLE} == {
        n: rp.BY_NAME[n].default for n in rp.DEPLOYABLE}
    assert rp.BY_NAME["temperature"].default == 1.0  # OpenAI's, where the wire's off is greedy


def test_a_deployable_parameter_has_a_flag_and_an_environment_name():
    p = rp.BY_NAME["min_p"]
    assert (p.flag, p.env) == ("--min-p", "LOCKSTEP_MIN_P")


@pytest.mark.parametrize(("bounds", "text"), [
    (rp.Bounds(0.0, 2.0), "[0, 2]"), (rp.Bounds(0.0, 1.0, lo_open=True), "(0, 1]"),
    (rp.Bounds(0.0, lo_open=True), "> 0"), (rp.Bounds(-1, rp.MAX_TOP_K), "[-1, 2^24]"),
    (rp.Bounds(-(2**63), 2**64, hi_open=True), "[-2^63, 2^64)")])
def test_bounds_read_as_intervals(bounds, text):
    assert bounds.text() == text


@pytest.mark.parametrize("api", rp.APIS)
def test_logit_bias_reaches_every_api_and_is_checked_at_admission(api):
    from services.gateway.core.sampling_params import logit_bias

    req = parse(api, logit_bias={"5": 100, "1": -2.5})
    assert req.params["logit_bias"] == {"5": 100, "1": -2.5}  # the internal request carries it
    assert [(b.token, b.bias) for b in logit_bias(req.params["logit_bias"], 10)] == [(1, -2.5), (5, 100.0)]
    for bad in ({"5": 100.5}, {"x": 1}, {"12": 1}):  # range, key, vocabulary: a 400 naming it
        with pytest.raises(ApiError) as e:
            logit_bias(parse(api, logit_bias=bad).params["logit_bias"], 10)
        assert e.value.param == "logit_bias", bad
    with pytest.raises(ApiError) as e:
        parse(api, logit_bias={"1": "high"})
    assert e.value.param.startswith("logit_bias"), e.value.param
    assert rp.problem("logit_bias", {"1": 101}) and rp.problem("logit_bias", {"1": 1.0}) is None
