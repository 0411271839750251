"""Structured output end to end with the real `openai` client: `lockstep up` serving the
embedded random-weight model at TP=2 ("tiny") and, deployed next to it through the admin
API, a copy at PP=2 ("tiny-pp"): the shared cluster (tests/support/live_cluster.py), idle
before and after each test. Constrained decoding makes even random weights emit
JSON valid for the schema asked for (checked with `jsonschema`), a required tool call
whose arguments validate against the tool's parameters, and both ranks of each
deployment emit the same tokens (their removal records' tokens_sha). A schema
llguidance cannot compile is a 400 naming it, before any rank sees it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support import live_cluster as lc
from tests.support.schemas import PERSON, WEATHER

MODES = {"tp": lc.TP_MODEL, "pp": lc.PP_MODEL}
pytestmark = pytest.mark.timeout(600)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["utc", "local"]}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


def ranks_agree(live: lc.LiveView, mode: str, rid: str) -> dict:
    """Both ranks' removal record of `rid`, equal in every field the ranks share: rank 0's."""
    return lc.ranks_agree(live.home, live.dep_ids[MODES[mode]], rid)[0]


def chat(live: lc.LiveView, mode: str, **kw):
    raw = live.openai.chat.completions.with_raw_response.create(
        model=MODES[mode], messages=ASK, **kw)
    return raw.headers["x-lockstep-request-id"], raw.parse()


@pytest.mark.parametrize("mode", list(MODES))
def test_json_object(live, mode):
    rid, resp = chat(live, mode, response_format={"type": "json_object"}, max_tokens=400,
                     temperature=0.7, seed=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)
    assert ranks_agree(live, mode, rid)["reason"] == "stop"


@pytest.mark.parametrize("mode", list(MODES))
def test_json_schema_greedy_and_seeded_and_streamed(live, mode):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        rid, resp = chat(live, mode, response_format=rf, max_tokens=120, **kw)
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
        ranks_agree(live, mode, rid)
    stream = live.openai.chat.completions.create(
        model=MODES[mode], messages=ASK, response_format=rf, max_tokens=120, temperature=0.9,
        seed=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("mode", list(MODES))
def test_required_and_named_tool_calls(live, mode):
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        rid, resp = chat(live, mode, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                         max_tokens=120, temperature=0.8, seed=3)
        c = resp.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
        ranks_agree(live, mode, rid)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(live):
    client = live.openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODES["tp"], messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "odd", "schema": {
                "type": "object", "properties": {"a": {"type": "strange"}}}}})
    assert e.value.param == "response_format.json_schema.schema"
    assert e.value.code == "invalid_json_schema" and "'odd'" in e.value.message
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "if": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODES["pp"], messages=ASK, tools=[bad_tool],
                                       tool_choice="required")
    assert e.value.param == "tools.0.function.parameters"
