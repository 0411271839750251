"""The Responses API without a cluster: its field table against the installed `openai`
SDK's `ResponseCreateParams` (every field honoured, harmless, or refused with a 400
naming it), validation, the translation onto a chat request, the output builder's event
order, and the bounded response store."""

from __future__ import annotations

import json

import pytest
from openai.types.responses.response_create_params import (
    ResponseCreateParamsBase,
    ResponseCreateParamsStreaming,
)

from common.request_params import RESPONSES, params_in
from services.gateway.core.errors import ApiError
from services.gateway.core.field_support import Support
from services.gateway.core.generation import LogprobsEvent, ReasoningEvent, TextEvent, ToolCallEvent
from services.gateway.core.logprobs import TokenLogprob
from services.gateway.core.toolcalls import ToolCall
from services.gateway.responses import schemas as rs
from services.gateway.responses import translate as rt
from services.gateway.responses.store import ResponseStore, output_as_input
from services.gateway.responses.stream import Output, Sequencer
from tests.support import internal
from tests.support.params import samples

TOOL = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
# A value for each field: honoured / harmless ones must validate, refused ones be a 400
# naming the field.
SAMPLES: dict[str, object] = {
    "access_programs": {"cyber": "standard"},
    "background": True,
    "background_options": {"completion_window": "2h"},
    "client_metadata": {"session_id": "s1", "x-codex-turn-metadata": '{"turn_id": "t1"}'},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_123",
    "image": {"context_compression": "auto"},
    "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
    "input": "hi",
    "instructions": "be brief",
    "max_output_tokens": 16,
    "max_tool_calls": 2,
    "metadata": {"k": "v"},
    "model": "m",
    "moderation": {"input": {"mode": "block"}},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"ttl": "5m"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "u1",
    "service_tier": "auto",
    "store": False,
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "text": {"format": {"type": "json_object"}},
    "tool_choice": {"type": "function", "name": "add"},
    "tools": [TOOL],
    "top_logprobs": 3,
    "truncation": "disabled",
    "user": "u1",
    **samples(RESPONSES),
}


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "input": "hi", **kw}).encode()


def refusal(**kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        rs.validate(body(**kw))
    assert e.value.status == 400
    return e.value


def test_every_sdk_field_has_a_row_and_every_row_is_an_sdk_field():
    sdk = set(ResponseCreateParamsBase.__annotations__) | set(
        ResponseCreateParamsStreaming.__annotations__)
    untyped = {f.name for f in rs.FIELDS if f.untyped}
    assert untyped == {"client_metadata"}  # Codex sends it; the SDK does not type it
    ours = {f.name for f in rs.FIELDS if f.extension}  # chat's extensions, declared once
    assert ours == {p.name for p in params_in(RESPONSES) if p.extension_in(RESPONSES)} >= {
        "seed", "top_k", "min_p"}
    assert sdk == set(rs.BY_NAME) - untyped - ours, (sdk - set(rs.BY_NAME), set(rs.BY_NAME) - sdk)
    assert set(SAMPLES) == sdk | untyped | ours  # and each is exercised below
    for f in rs.FIELDS:  # a row the schema lacks would be a 400 "extra" instead
        assert f.name in rs.ResponsesRequest.model_fields, f.name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_field_is_honoured_harmless_or_refused_by_name(name):
    extra = {"tools": [TOOL]} if name == "tool_choice" else {}
    if rs.BY_NAME[name].support(rs.ENDPOINT) is Support.REFUSED:
        e = refusal(**{name: SAMPLES[name]}, **extra)
        assert e.param == name and e.code == "unsupported_parameter" and name in e.message
    else:
        req = rs.validate(body(**{name: SAMPLES[name]}, **extra))
        assert getattr(req, name) is not None


def test_neutral_values_of_refused_fields_are_accepted():
    rs.validate(body(background=False, conversation=None, prompt=None))


def test_unknown_and_unsupported_values_are_400s_naming_them():
    assert refusal(max_tokens=5).param == "max_tokens"
    assert refusal(max_tokens=5).code == "unknown_parameter"
    assert refusal(truncation="auto").param == "truncation"
    assert refusal(text={"verbosity": "low"}).param == "text.verbosity"
    assert refusal(tools=[{"type": "web_search"}]).param == "tools.0.type"
    assert refusal(client_metadata={"n": 1}).param.startswith("client_metadata")
    assert refusal(include=["file_search_call.results"]).param == "include.0"
    assert refusal(tool_choice={"type": "file_search"}).param == "tool_choice.type"
    assert refusal(tool_choice="required").param == "tool_choice"  # no tools
    assert refusal(tools=[TOOL], tool_choice={"type": "function", "name": "x"}).param \
        == "tool_choice.name"
    assert refusal(temperature=3).param == "temperature"
    assert refusal(input=[]).param == "input"
    assert refusal(input=[{"type": "computer_call_output"}]).param == "input.0.type"
    img = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    assert refusal(input=img).param == "input.0.content.0.type"
    assert refusal(input=[{"type": "function_call", "name": "f"}]).param.startswith("input.0.")
    assert refusal(text={"format": {"type": "json_schema"}}).param == "text.format"
    assert refusal(reasoning={"effort": "huge"}).param == "reasoning.effort"
    assert refusal(stream_options={"include_usage": True}).param == "stream_options.include_usage"
    assert refusal(tools=[{**TOOL, "output_schema": {}}]).param == "tools.0.output_schema"


def test_translation_onto_a_chat_request():
    items = [
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add 2"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
    ]
    history = [{"type": "message", "role": "user", "content": "before"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}]}]
    req = rs.validate(body(input=items, instructions="sys", tools=[TOOL], tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=7, temperature=0.3,
                           top_p=0.5, text={"format": {"type": "json_schema", "name": "p",
                                                       "schema": {"type": "object"},
                                                       "strict": True}},
                           include=["message.output_text.logprobs"], top_logprobs=2))
    chat = rt.to_internal(req, history)
    assert internal.messages(chat) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "before"},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "dev rules"},  # developer: the template's system
        {"role": "user", "content": "add 2"},
        {"role": "assistant", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    assert internal.tool_names(chat) == ["add"] and chat.tool_choice == "required"
    assert chat.parallel_tool_calls is False and chat.max_tokens == 7
    assert (chat.params["temperature"], chat.params["top_p"]) == (0.3, 0.5)
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}
    assert chat.logprobs == 2
    named = rt.to_internal(rs.validate(body(tools=[TOOL], tool_choice={"type": "function",
                                                                   "name": "add"})), [])
    assert named.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert rt.to_internal(rs.validate(body(tools=[TOOL], max_tool_calls=1)), []).parallel_tool_calls \
        is False


def test_shared_path_errors_are_renamed_to_responses_params():
    e = rt.renamed(ApiError(400, "bad", param="response_format.json_schema.schema"))
    assert e.param == "text.format.schema" and e.message.startswith("text.format.schema: ")
    assert rt.renamed(ApiError(400, "x", param="tools.0.function.parameters")).param \
        == "tools.0.parameters"
    assert rt.renamed(ApiError(400, "x", param="messages")).param == "input"
    assert rt.renamed(ApiError(400, "x", param="model")).param == "model"


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_output_builder_event_order_text_reasoning_and_calls():
    out = Output(logprobs=True)
    ev = out.feed(ReasoningEvent("think"))
    ev += out.feed(TextEvent("  "))  # held: no message is whitespace alone
    ev += out.feed(LogprobsEvent([TokenLogprob("Hi", [72, 105], -0.5, [])]))
    ev += out.feed(TextEvent("Hi"))
    ev += out.feed(ToolCallEvent(ToolCall("call_abc", "add", '{"a": 1}')))
    ev += out.close()
    assert types(ev) == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["output_index"] for e in ev if e["type"].startswith("response.output_item")] \
        == [0, 0, 1, 1, 2, 2]
    msg, call = out.items[1], out.items[2]
    assert msg["content"][0]["text"] == "  Hi" and msg["status"] == "completed"
    assert msg["content"][0]["logprobs"][0]["token"] == "Hi"
    assert call == {"id": "fc_abc", "type": "function_call", "call_id": "call_abc",
                    "name": "add", "arguments": '{"a": 1}', "status": "completed"}
    assert ev[12]["item"]["arguments"] == ""  # added empty, then one delta of all of it
    seq = Sequencer()
    nums = [json.loads(seq(e).split(b"data: ", 1)[1])["sequence_number"] for e in ev[:3]]
    assert nums == [0, 1, 2]
    capped = Output(max_calls=1)
    for i in range(3):
        capped.feed(ToolCallEvent(ToolCall(f"call_{i}", "add", "{}")))
    assert [i["call_id"] for i in capped.items] == ["call_0"]


def test_output_items_continue_as_input_items():
    out = Output()
    out.feed(ReasoningEvent("r"))
    out.feed(TextEvent("hello"))
    out.feed(ToolCallEvent(ToolCall("call_1", "add", '{"a": 1}')))
    items = output_as_input(out.items)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    for i, item in enumerate(items):
        rs._item(item, f"input.{i}")  # valid input items
    msgs = rt.chat_messages(items, None)
    assert msgs == [{"role": "assistant", "content": "hello", "reasoning_content": "r",
                     "tool_calls": [{"id": "call_1", "type": "function",
                                     "function": {"name": "add", "arguments": '{"a": 1}'}}]}]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_store_is_bounded_by_entries_bytes_and_age_lru_first():
    clock = Clock()
    st = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=60, clock=clock)
    assert st.put("a", {"id": "a"}, []) and st.put("b", {"id": "b"}, [])
    assert st.get("a") is not None  # a is now the most recently used
    st.put("c", {"id": "c"}, [])
    assert st.get("b") is None and st.get("a") and st.get("c") and len(st) == 2
    assert not st.put("big", {"x": "y" * 20_000}, [])  # alone over the byte bound: not kept
    st2 = ResponseStore(max_entries=100, max_bytes=300, ttl_s=60, clock=clock)
    for k in "pqr":
        st2.put(k, {"id": k, "pad": "z" * 100}, [])
    assert st2.get("p") is None and st2.nbytes <= 300  # bytes: the oldest out
    clock.t = 61
    assert st.get("a") is None and len(st) == 0  # past the retention
    st.put("d", {"id": "d"}, [{"type": "message", "role": "user", "content": "x"}])
    assert st.get("d").items[0]["content"] == "x"
    assert st.delete("d") and not st.delete("d") and st.nbytes == 0


def test_the_docs_table_is_the_field_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    section = doc[doc.index("### Responses request fields"):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|", 2)]
            rows[cells[0].split("`")[1]] = (cells[1], cells[2])
    assert rows == {f.name: (f.support(rs.ENDPOINT).value, f.note) for f in rs.FIELDS}
