"""The Sampling record GENERATE and PLAN's inserts share (common/messages/sampling.py),
decoded strictly as a nested record: every field checked, an unknown one refused, the
caps (logit_bias, grammar) applied inside it; the seed is never null (its sender decides
it; a GENERATE that omits it has 0), a plan's insert must carry it."""

from __future__ import annotations

import pytest

from common.messages import Generate, PlanInsert, Sampling, SeededSampling, TokenBias
from common.messages.base import BIAS_LIST, GRAMMAR
from common.schema import SchemaError, decode_into, to_wire

SAMPLING = Sampling(temperature=0.7, top_p=0.9, seed=1234, top_k=40, min_p=0.05,
                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                    repetition_context_size=64, logit_bias=[TokenBias(3, -1.5)], grammar="g")


def generate(**sampling) -> dict:
    """A GENERATE body on the wire whose sampling map is SAMPLING's with `sampling`."""
    body = to_wire(Generate("r", [1, 2], 4, SAMPLING))
    body["sampling"] = {**body["sampling"], **sampling}
    return body


def refused(cls: type, body: dict) -> SchemaError:
    with pytest.raises(SchemaError) as ei:
        decode_into(cls, body)
    return ei.value


def test_a_valid_record_round_trips_nested():
    body = generate()
    assert body["sampling"]["logit_bias"] == [{"token": 3, "bias": -1.5}]
    assert "temperature" not in body  # declared once: only inside the record
    assert decode_into(Generate, body) == Generate("r", [1, 2], 4, SAMPLING)
    ins = PlanInsert("r", [1, 2], 4, SAMPLING.seeded(7))
    got = decode_into(PlanInsert, to_wire(ins))
    assert got == ins and type(got.sampling) is SeededSampling


def test_defaults_mean_off_and_a_generate_may_omit_the_record():
    g = decode_into(Generate, {"request_id": "r", "prompt": [1], "max_tokens": 1})
    assert g.sampling == Sampling()
    assert (g.sampling.temperature, g.sampling.seed, g.sampling.top_k) == (0.0, 0, 0)
    e = refused(Generate, generate(seed=None))  # nobody downstream draws one
    assert (e.reason, e.detail) == ("wrong_type", "sampling.seed: expected int")
    partial = decode_into(Generate, {"request_id": "r", "prompt": [1], "max_tokens": 1,
                                     "sampling": {"temperature": 1}})
    assert partial.sampling == Sampling(temperature=1.0)


def test_missing_fields_inside_and_out():
    ins = to_wire(PlanInsert("r", [1], 1, SeededSampling(seed=3)))
    assert refused(PlanInsert, {k: v for k, v in ins.items() if k != "sampling"}).reason \
        == "missing_field"
    no_seed = {**ins, "sampling": {k: v for k, v in ins["sampling"].items() if k != "seed"}}
    e = refused(PlanInsert, no_seed)
    assert (e.reason, e.detail) == ("missing_field", "sampling.seed")
    e = refused(PlanInsert, {**ins, "sampling": {**ins["sampling"], "seed": None}})
    assert (e.reason, e.detail) == ("wrong_type", "sampling.seed: expected int")
    e = refused(Generate, generate(logit_bias=[{"token": 1}]))
    assert (e.reason, e.detail) == ("missing_field", "sampling.logit_bias[].bias")


def test_unknown_and_misplaced_fields_are_refused():
    e = refused(Generate, generate(uid=3))
    assert (e.reason, e.detail) == ("extra_field", "sampling.uid")
    # the flat fields of before are unknown at the top level now
    e = refused(Generate, {**generate(), "temperature": 0.5})
    assert (e.reason, e.detail) == ("extra_field", "temperature")
    # and what is not sampling is not accepted inside the record
    for name in ("top_logprobs", "resumed", "stop_token_ids"):
        assert refused(Generate, generate(**{name: 1})).reason == "extra_field", name


@pytest.mark.parametrize("sampling,detail", [
    ({"temperature": "hot"}, "sampling.temperature: expected float"),
    ({"top_k": 1.5}, "sampling.top_k: expected int"),
    ({"logit_bias": {"3": 1.0}}, "sampling.logit_bias: expected list"),
    ({"logit_bias": [{"token": "3", "bias": 1.0}]}, "sampling.logit_bias[].token: expected int"),
    ({"grammar": b"g"}, "sampling.grammar: expected str"),
])
def test_wrong_types_name_the_nested_field(sampling, detail):
    e = refused(Generate, generate(**sampling))
    assert (e.reason, e.detail) == ("wrong_type", detail)
    assert refused(Generate, {**generate(), "sampling": [1]}).reason == "wrong_type"


def test_caps_apply_inside_the_record():
    n, g = BIAS_LIST["max_len"], GRAMMAR["max_len"]
    at_cap = generate(logit_bias=[{"token": i, "bias": 1.0} for i in range(n)], grammar="x" * g)
    s = decode_into(Generate, at_cap).sampling
    assert len(s.logit_bias) == n and len(s.grammar) == g
    e = refused(Generate, generate(logit_bias=[{"token": i, "bias": 1.0} for i in range(n + 1)]))
    assert (e.reason, e.detail) == ("field_too_large", "sampling.logit_bias: list too long")
    ins = to_wire(PlanInsert("r", [1], 1, SeededSampling(seed=1)))
    ins["sampling"]["grammar"] = "x" * (g + 1)
    assert refused(PlanInsert, ins).reason == "field_too_large"


def test_seeded_fixes_the_seed_and_orders_the_bias():
    s = Sampling(temperature=0.5, logit_bias=[TokenBias(9, 1.0), TokenBias(2, -1.0)])
    got = s.seeded(11)
    assert type(got) is SeededSampling and got.seed == 11 and got.temperature == 0.5
    assert [b.token for b in got.logit_bias] == [2, 9]
    assert [b.token for b in s.logit_bias] == [9, 2]  # the GENERATE's own is not changed
    with pytest.raises(TypeError):
        SeededSampling(temperature=1.0)  # a plan's record has a seed
