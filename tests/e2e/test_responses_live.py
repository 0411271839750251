"""The Responses API end to end with the real `openai` client: `lockstep up` serving the
embedded random-weight model at TP=2 ("tiny") and, deployed next to it through the admin
API, a copy at PP=2 ("tiny-pp"): the shared cluster (tests/support/live_cluster.py), idle
before and after each test. `client.responses.create` and `.stream` (whose
accumulator must rebuild the final response), structured output (`text.format`) valid
for its schema on both topologies with both ranks agreeing, a two-step tool loop over
the store (a random model calls no tool on its own: tool_choice forces it), a
`previous_response_id` chain served from the prefix cache, and a client that leaves
mid-stream removed on every rank at the same step."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pydantic
import pytest

from tests.gwutil import poll_until
from tests.support import live_cluster as lc

MODES = {"tp": lc.TP_MODEL, "pp": lc.PP_MODEL}
pytestmark = pytest.mark.timeout(600)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}


def removal_records(live: lc.LiveView, mode: str, rid: str) -> list[dict]:
    """Both ranks' removal record of `rid`, equal in every field the ranks share."""
    return lc.ranks_agree(live.home, live.dep_ids[MODES[mode]], rid)


@pytest.mark.parametrize("mode", list(MODES))
def test_structured_output_is_schema_valid_and_ranks_agree(live, mode):
    c = live.openai
    for kw in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9}):
        r = c.responses.create(model=MODES[mode], input="Describe a person as JSON.",
                               text=FORMAT, max_output_tokens=120, **kw)
        assert r.status == "completed", r.output
        jsonschema.validate(json.loads(r.output_text), PERSON)
        assert removal_records(live, mode, r.id)[0]["reason"] == "stop"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)


def test_sdk_parse_with_a_pydantic_text_format(live):
    """`client.responses.parse(text_format=...)`, as the Agents SDK's output types use it."""
    r = live.openai.responses.parse(model=MODES["tp"], input="Describe a person.",
                                    text_format=Person, max_output_tokens=120, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Person), r.output


def test_stream_accumulator_rebuilds_the_final_response(live):
    c = live.openai
    with c.responses.stream(model=MODES["tp"], input="Describe a person as JSON.", text=FORMAT,
                            max_output_tokens=120, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), PERSON)
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    stored = c.responses.retrieve(final.id)  # the streamed response was stored
    assert stored.output_text == final.output_text
    plain = c.responses.create(model=MODES["tp"], input="Say hi.", max_output_tokens=4,
                               stream=True, temperature=0)
    ends = [e for e in plain if e.type.startswith("response.") and e.type.count(".") == 1]
    assert [e.type for e in ends] == ["response.created", "response.in_progress",
                                      "response.incomplete"]
    assert ends[-1].response.incomplete_details.reason == "max_output_tokens"


def test_two_step_tool_loop_and_a_cached_chain(live):
    c = live.openai
    first = c.responses.create(model=MODES["tp"], input="What is the weather in Paris?",
                               instructions="Use the tools.", tools=TOOLS, temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=120)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = c.responses.create(
        model=MODES["tp"], previous_response_id=first.id, instructions="Use the tools.",
        tools=TOOLS, text=FORMAT, max_output_tokens=120, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"temperature": 21})}])
    assert second.status == "completed" and second.previous_response_id == first.id
    jsonschema.validate(json.loads(second.output_text), PERSON)
    assert second.usage.input_tokens > first.usage.input_tokens
    # The second turn's prompt starts with the first's, which rank 0's prefix cache holds.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Its input items: the chain (first's input, its call under the same id), then its own.
    items = c.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", *(o.type for o in first.output),
                                       "function_call_output"]
    assert [i.id for i in items[1:-1]] == [o.id for o in first.output]
    assert items[-1].call_id == calls[0].call_id
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODES["tp"], previous_response_id=first.id, input="again")


def test_refusals_name_the_parameter(live):
    c = live.openai
    for kw, param in (({"background": True, "stream": True}, "stream"),
                      ({"conversation": "conv_1"}, "conversation"),
                      ({"reasoning": {"effort": "high"}}, "reasoning"),  # no thinking mode
                      ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                      ({"text": {"format": {"type": "json_schema", "name": "odd", "schema": {
                          "type": "object", "properties": {"a": {"type": "strange"}}}}}},
                       "text.format.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=MODES["tp"], input="hi", **kw)
        assert e.value.body["param"] == param, e.value.body


@pytest.mark.timeout(180)
def test_disconnect_mid_stream_is_removed_on_every_rank(live):
    c = live.openai
    seen: dict = {}

    def victim() -> None:
        try:
            leave()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = repr(exc)

    def leave() -> None:
        stream = c.responses.create(model=MODES["tp"], input="Tell a long story.",
                                    max_output_tokens=1500, temperature=0, stream=True,
                                    store=True)
        deltas = 0
        for ev in stream:
            if ev.type == "response.created":
                seen["rid"] = ev.response.id
            deltas += ev.type == "response.output_text.delta"
            if deltas >= 8:
                seen["step_at_close"] = live.cluster.rank0_stats(MODES["tp"]).step
                stream.close()  # the client leaves mid-stream
                return

    t = threading.Thread(target=victim)
    t.start()
    t.join(120)
    assert not t.is_alive() and "step_at_close" in seen, seen
    recs = removal_records(live, "tp", seen["rid"])
    print("removal records", recs, "seen", seen)
    assert {r["step"] for r in recs} == {recs[0]["step"]}  # the same step on every rank
    assert all(r["reason"] in ("abort", "client_disconnect") for r in recs), recs
    # rank 0 steps every few ms here: a close reaches it within a few dozen steps on a busy
    # 2-core host (8 was exceeded in CI, 18 seen under load); what this proves is one
    # removal step on every rank, long before the request's cap
    assert recs[0]["step"] - seen["step_at_close"] <= 32, (recs, seen)  # as chat's test
    assert recs[0]["n_tokens"] < 1500
    with pytest.raises(openai.NotFoundError):  # a response the client left is not stored
        c.responses.retrieve(seen["rid"])


@pytest.mark.timeout(180)
def test_background_cancel_is_removed_on_every_rank(live):
    c = live.openai
    r = c.responses.create(model=MODES["pp"], input="Tell a long story.", background=True,
                           max_output_tokens=1500, temperature=0)
    assert r.status == "in_progress" and r.background is True
    poll_until(lambda: len(c.responses.retrieve(r.id).output_text) > 0, 60,
               "output of the background response")
    done = c.responses.cancel(r.id)
    assert done.status == "cancelled" and 0 < done.usage.output_tokens < 1500, done
    recs = removal_records(live, "pp", r.id)  # both ranks, the same step and tokens
    assert {x["reason"] for x in recs} == {"abort"}, recs
    assert recs[0]["n_tokens"] == done.usage.output_tokens
    assert c.responses.retrieve(r.id).status == "cancelled"
