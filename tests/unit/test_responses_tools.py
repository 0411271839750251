"""Responses tools without a cluster: OpenAI's `namespace` tools both ways (offered to
the model as `namespace__name` chat functions, calls back as `function_call` items with
`name` and `namespace`, such items in `input` back to the qualified call), hosted tools
refused with the client setting that drops them, and the first request Codex 0.171.0
sends (its shape, trimmed) validated field by field."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import (
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
)

from services.gateway.core.errors import ApiError
from services.gateway.core.generation import ToolCallEvent
from services.gateway.core.toolcalls import ToolCall
from services.gateway.responses import schemas as rs
from services.gateway.responses import translate as rt
from services.gateway.responses.items import listed
from services.gateway.responses.store import output_as_input
from services.gateway.responses.stream import Output, Sequencer
from services.gateway.responses.tools import namespaced
from tests.support import internal


def fn(name: str, desc: str | None = None) -> dict:
    return {"type": "function", "name": name, "strict": False,
            **({"description": desc} if desc else {}),
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                           "required": ["target"], "additionalProperties": False}}


AGENTS = {"type": "namespace", "name": "multi_agent_v1",
          "description": "Tools for spawning and managing sub-agents.",
          "tools": [fn("close_agent", "Close an agent."), fn("spawn_agent", "Spawn one.")]}
EXEC = fn("exec_command", "Runs a command in a PTY.")
TURN = '{"session_id":"s1","turn_id":"t1","sandbox":"seccomp"}'
# Codex 0.171.0's first `codex exec` request, trimmed (/tmp capture of a real run).
CODEX = {
    "model": "m", "stream": True,
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "id": "msg_1", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context/>"}]},
        {"type": "message", "id": "msg_2", "role": "user",
         "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
    "tools": [EXEC, AGENTS, {"type": "web_search", "external_web_access": False}],
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
    "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1",
    "client_metadata": {"x-codex-turn-metadata": TURN, "session_id": "s1", "turn_id": "t1"},
}


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "input": "hi", **kw}).encode()


def refusal(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        rs.validate(raw)
    assert e.value.status == 400
    return e.value


def test_codex_first_request_web_search_is_a_400_saying_how_to_drop_it():
    e = refusal(json.dumps(CODEX).encode())
    assert e.param == "tools.2.type" and e.code == "unsupported_value"
    assert "'web_search'" in e.message and "-c web_search=disabled" in e.message


def test_codex_first_request_without_web_search_translates_field_by_field():
    req = rs.validate(json.dumps({**CODEX, "tools": [EXEC, AGENTS]}).encode())
    assert req.client_metadata["turn_id"] == "t1"  # accepted, used for nothing
    chat = rt.to_internal(req, [])
    msgs = internal.messages(chat)
    assert [m["role"] for m in msgs] == ["system", "user", "user"]  # developer → system
    assert internal.tool_names(chat) == [
        "exec_command", "multi_agent_v1__close_agent", "multi_agent_v1__spawn_agent"]
    fns = internal.functions(chat)
    assert fns[1]["description"] == (
        "Tools for spawning and managing sub-agents.\n\nClose an agent.")
    assert fns[1]["parameters"] == AGENTS["tools"][0]["parameters"]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is True
    # reasoning.summary alone asks for no reasoning: nothing for a model without one to do
    assert chat.input.reasoning_effort is None and chat.input.template_kwargs == {}


def test_a_namespaced_call_comes_back_with_name_and_namespace():
    req = rs.validate(body(tools=[EXEC, AGENTS]))
    out = Output(namespaces=namespaced(req.tools))
    events = out.feed(ToolCallEvent(ToolCall("call_1", "multi_agent_v1__close_agent",
                                             '{"target": "a1"}')))
    events += out.feed(ToolCallEvent(ToolCall("call_2", "exec_command", '{"cmd": "ls"}')))
    item, plain = out.items
    assert item["name"] == "close_agent" and item["namespace"] == "multi_agent_v1"
    assert "namespace" not in plain and plain["name"] == "exec_command"
    ResponseFunctionToolCall.model_validate(item)  # the SDK's own item type reads it
    seq = Sequencer()
    wire = [json.loads(seq(e).split(b"data: ", 1)[1]) for e in events]
    added = ResponseOutputItemAddedEvent.model_validate(wire[0])
    assert (added.item.name, added.item.namespace) == ("close_agent", "multi_agent_v1")
    done = ResponseFunctionCallArgumentsDoneEvent.model_validate(wire[2])
    assert done.name == "close_agent"
    assert wire[3]["item"]["namespace"] == "multi_agent_v1"  # output_item.done
    # Continued (store / previous_response_id) and listed, it keeps its namespace.
    again = output_as_input(out.items)
    assert again[0]["namespace"] == "multi_agent_v1"
    assert listed({**again[0]})["namespace"] == "multi_agent_v1"
    calls = rt.chat_messages(again, None)[0]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["multi_agent_v1__close_agent",
                                                      "exec_command"]


def test_a_namespaced_call_in_input_is_the_qualified_call():
    items = [{"type": "message", "role": "user", "content": "close a1"},
             {"type": "function_call", "call_id": "c1", "name": "close_agent",
              "namespace": "multi_agent_v1", "arguments": '{"target": "a1"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "closed",
              "name": "close_agent", "namespace": "multi_agent_v1"}]
    chat = rt.to_internal(rs.validate(body(input=items, tools=[AGENTS])), [])
    msgs = internal.messages(chat)
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "closed"}


def test_tool_choice_forcing_a_namespaced_function():
    named = {"type": "function", "name": "close_agent"}
    chat = rt.to_internal(rs.validate(body(tools=[EXEC, AGENTS], tool_choice=named)), [])
    assert chat.tool_choice == {"type": "function",
                                "function": {"name": "multi_agent_v1__close_agent"}}
    plain = rt.to_internal(rs.validate(body(tools=[AGENTS, fn("close_agent")], tool_choice=named)),
                       [])
    assert plain.tool_choice["function"]["name"] == "close_agent"  # the plain one wins
    other = {**AGENTS, "name": "agents_v2"}
    e = refusal(body(tools=[AGENTS, other], tool_choice=named))
    assert e.param == "tool_choice.name" and "multi_agent_v1, agents_v2" in e.message
    e = refusal(body(tools=[AGENTS], tool_choice={"type": "function",
                                                  "name": "multi_agent_v1__close_agent"}))
    assert e.param == "tool_choice.name"  # the model's name for it is not the client's


def test_namespace_faults_are_400s_naming_them():
    assert refusal(body(tools=[AGENTS, fn("multi_agent_v1__close_agent")])).param \
        == "tools.0.name"  # two tools the model would see under one name
    assert refusal(body(tools=[AGENTS, AGENTS])).param == "tools.1.name"
    custom = {**AGENTS, "tools": [fn("a"), {"type": "custom", "name": "patch"}]}
    e = refusal(body(tools=[custom]))
    assert e.param == "tools.0.tools.1.type" and "'custom'" in e.message
    assert refusal(body(tools=[{**AGENTS, "tools": []}])).param == "tools.0.tools"
    assert refusal(body(tools=[{k: v for k, v in AGENTS.items() if k != "description"}])) \
        .param == "tools.0.description"
    bad_inner = {**AGENTS, "tools": [{**fn("a"), "output_schema": {}}]}
    assert refusal(body(tools=[bad_inner])).param == "tools.0.tools.0.output_schema"
    many = {**AGENTS, "tools": [fn(f"f{i}") for i in range(5)]}
    e = None
    with pytest.raises(ApiError) as e:
        rs.validate(body(tools=[many, EXEC]), max_tools=5)
    assert e.value.param == "tools" and e.value.code == "too_many_items"
    rs.validate(body(tools=[many]), max_tools=5)


def test_a_namespaced_name_past_a_functions_bound_is_a_400_naming_it():
    """namespace__name is what the model sees: bounded as a function's name (it was a 500
    when the chat request refused it unasked)."""
    long_ns = {**AGENTS, "name": "n" * 128, "tools": [fn("f" * 200)]}
    e = refusal(body(tools=[long_ns]))
    assert e.param == "tools.0.tools.0.name" and "at most 256" in e.message, e.message
    ok = {**AGENTS, "name": "n" * 100, "tools": [fn("f" * 154)]}  # 100 + 2 + 154 = 256
    assert internal.tool_names(rt.to_internal(rs.validate(body(tools=[ok])), []))[0] == \
        "n" * 100 + "__" + "f" * 154
