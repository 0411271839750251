"""The Responses API through the whole gateway with the real `openai` client: a real
uvicorn server and signed channels, a fake rank 0 scripted to emit exactly what a
thinking Qwen3-Coder-style model would (reasoning, text, tool calls — a random-weight
model never does), and the "thinking" tokenizer. The event stream, the SDK's
accumulator, reasoning, the tool loop over the store, GET / DELETE and the 404s."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from common.messages import ErrorCode
from tests.gwutil import poll_until
from tests.support.fake_gateway import FakeGateway, say, thinker_gateway

CALL = "<tool_call>\n<function=add>\n<parameter=a>\n{}\n</parameter>\n</function>\n</tool_call>"
TOOLS = [{"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with thinker_gateway(tmp_path_factory, coder=True) as g:
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0, timeout=20)
        yield g.with_client(c)


def prompt_text(env: FakeGateway) -> str:
    return env.tok.hf.decode(env.rank.generates[-1].prompt)


@pytest.mark.timeout(60)
def test_reasoning_text_and_the_typed_event_stream(env):
    c, m = env.c, env.model_name
    say(env, "seven plus nothing</think>\n\nIt is 7.")
    r = c.responses.create(model=m, input="add 7", instructions="Be terse.",
                           reasoning={"effort": "high"}, max_output_tokens=200)
    assert r.status == "completed" and r.output_text == "It is 7."
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "seven plus nothing"
    assert r.usage.input_tokens == len(env.rank.generates[-1].prompt)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert "<think>" in prompt_text(env) and "Be terse." in prompt_text(env)
    with c.responses.stream(model=m, input="add 7", reasoning={"effort": "high"}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert final.output_text == "It is 7." and final.id == events[0].response.id
    say(env, "Plain.")
    off = c.responses.create(model=m, input="add 7", reasoning={"effort": "none"})
    assert "<think>" not in prompt_text(env) and off.output_text == "Plain."


@pytest.mark.timeout(60)
def test_tool_loop_over_the_store_get_and_delete(env):
    c, m = env.c, env.model_name
    say(env, "use the tool</think>\n" + CALL.format(7))
    first = c.responses.create(model=m, input="add 7", tools=TOOLS)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"a": 7}
    assert c.responses.retrieve(first.id).output[-1].call_id == calls[0].call_id
    say(env, "done</think>\nIt is 14.")
    second = c.responses.create(model=m, previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "14"}])
    assert second.output_text == "It is 14." and second.previous_response_id == first.id
    p = prompt_text(env)
    assert p.index("add 7") < p.rindex("<tool_call>") < p.index("<tool_response>\n14")
    say(env, "again</think>\n" + CALL.format(8))
    with c.responses.stream(model=m, input="again", tools=TOOLS) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds.index("response.function_call_arguments.delta") < kinds.index(
        "response.function_call_arguments.done") < kinds.index("response.completed")
    assert json.loads(final.output[-1].arguments) == {"a": 8}
    c.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.retrieve(second.id, stream=True)  # no replay of a stored stream
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=m, previous_response_id=first.id, input="more")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.timeout(60)
def test_store_false_keeps_nothing_and_length_is_incomplete(env):
    c, m = env.c, env.model_name
    say(env, "one</think> two three four five six")
    r = c.responses.create(model=m, input="count", store=False, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.store is False and r.usage.output_tokens == 2
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with httpx.stream("POST", env.url + "/v1/responses", timeout=20, json={
            "model": m, "input": "count", "stream": True, "max_output_tokens": 2}) as resp:
        names = [ln.split(": ", 1)[1] for ln in resp.iter_lines() if ln.startswith("event: ")]
    assert names[-1] == "response.incomplete"
    for kw, param in (({"stream": True}, "stream"), ({"store": False}, "store")):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=m, input="x", background=True, **kw)
        assert e.value.body["param"] == param


@pytest.mark.timeout(60)
def test_background_runs_past_its_request_and_cancel_aborts_it(env):
    c, m, rank = env.c, env.model_name, env.rank
    say(env, "a</think> " + "word " * 400)
    rank.step_s = 0.05
    try:
        r = c.responses.create(model=m, input="go", background=True, max_output_tokens=1000)
        assert r.status == "in_progress" and r.background is True
        poll_until(lambda: c.responses.retrieve(r.id).output_text, 20, "some output via GET")
        assert c.responses.retrieve(r.id).status == "in_progress"
        done = c.responses.cancel(r.id)
        assert done.status == "cancelled" and done.output_text.startswith("w")
        assert (r.id, "cancel") in [(rid, why) for rid, why, _ in rank.aborts]
        assert rank.finished[r.id] == "abort"
        assert c.responses.retrieve(r.id).status == "cancelled"
        assert c.responses.cancel(r.id).status == "cancelled"  # ended: answered as it is
    finally:
        rank.step_s = 0.01
    say(env, "b</think>short")
    r = c.responses.create(model=m, input="go", background=True)
    poll_until(lambda: c.responses.retrieve(r.id).status == "completed", 20, "it to complete")
    assert c.responses.retrieve(r.id).output_text == "short"
    plain = c.responses.create(model=m, input="go")
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(plain.id)  # not a background response


@pytest.mark.timeout(60)
def test_a_rank_error_is_an_http_error_or_response_failed(env):
    c, m, rank = env.c, env.model_name, env.rank
    rank.refuse = lambda g: (ErrorCode.INVALID_REQUEST, "sampling params out of range")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=m, input="go")
        assert e.value.body["code"] == "invalid_request"
        events = list(c.responses.create(model=m, input="go", stream=True))
        assert [ev.type for ev in events] == ["response.created", "response.in_progress",
                                              "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "out of range" in failed.error.message
    finally:
        rank.refuse = None


AGENTS = {"type": "namespace", "name": "multi_agent_v1",
          "description": "Tools for spawning and managing sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "description": "Close one.",
                     "parameters": {"type": "object", "properties": {
                         "target": {"type": "string"}}}}]}
QUALIFIED = "multi_agent_v1__close_agent"
CLOSE = ("<tool_call>\n<function=" + QUALIFIED + ">\n<parameter=target>\na1\n</parameter>\n"
         "</function>\n</tool_call>")


@pytest.mark.timeout(60)
def test_a_namespace_tool_both_ways(env):
    """Codex's `multi_agent_v1` namespace: the model sees `namespace__name` with the
    namespace's description; its call comes back as `name` + `namespace` (created and
    streamed, as the SDK's accumulator rebuilds it), and the call continued over the
    store reaches the model as the qualified call again."""
    c, m = env.c, env.model_name
    say(env, "close it</think>\n" + CLOSE)
    first = c.responses.create(model=m, input="close a1", tools=[*TOOLS, AGENTS])
    p = prompt_text(env)
    desc = json.dumps("Tools for spawning and managing sub-agents.\n\nClose one.")  # tojson
    assert '"name": "' + QUALIFIED + '", "description": ' + desc in p
    call = first.output[-1]
    assert (call.type, call.name, call.namespace) == ("function_call", "close_agent",
                                                      "multi_agent_v1")
    assert json.loads(call.arguments) == {"target": "a1"}
    assert c.responses.retrieve(first.id).output[-1].namespace == "multi_agent_v1"
    say(env, "done</think>\nClosed.")
    second = c.responses.create(model=m, previous_response_id=first.id, tools=[AGENTS], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "closed"}])
    assert second.output_text == "Closed."
    p = prompt_text(env)
    assert p.index("close a1") < p.rindex('"' + QUALIFIED + '"') < p.index("closed")
    say(env, "again</think>\n" + CLOSE)
    with c.responses.stream(model=m, input="close a1", tools=[AGENTS]) as s:
        events = list(s)
        final = s.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.name for e in done] == ["close_agent"]
    assert (final.output[-1].name, final.output[-1].namespace) == ("close_agent",
                                                                   "multi_agent_v1")
