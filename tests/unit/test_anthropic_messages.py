"""The Messages API's request table against the installed `anthropic` SDK, and the
translation of a Messages request into the chat request the one request path serves
(no cluster, no tokenizer)."""

from __future__ import annotations

import json
import typing

import anthropic.types.message_count_tokens_params as count_params
import anthropic.types.message_create_params as create_params
import pytest

from common.request_params import MESSAGES, params_in
from services.gateway.anthropic import render
from services.gateway.anthropic import schemas as s
from services.gateway.anthropic import translate as t
from services.gateway.core.errors import ApiError
from services.gateway.core.field_support import Support
from services.gateway.core.generation import Final, Finish, ReasoningEvent, TextEvent, ToolCallEvent
from services.gateway.core.toolcalls import ToolCall
from tests.support import internal
from tests.support.messages_bodies import BASE, CLAUDE_CODE_FIRST, SAMPLES
from tests.support.params import samples


def sdk_fields(params) -> set[str]:
    members = typing.get_args(params) or (params,)
    return {k for m in members for k in m.__annotations__}


def test_every_sdk_field_has_a_row_and_every_row_is_the_sdks():
    create = sdk_fields(create_params.MessageCreateParams)
    count = sdk_fields(count_params.MessageCountTokensParams)
    assert create >= {"model", "messages", "max_tokens", "thinking", "output_config"}
    rows = s.BY_ENDPOINT
    assert create - set(rows[s.CREATE]) == set(), "typed by the SDK, no row here"
    assert count - set(rows[s.COUNT]) == set(), "typed by the SDK, no row here"
    untyped = {f.name for f in s.FIELDS if f.untyped}
    # 2.x no longer types the sampling fields (nor has our extensions); context_management
    # is a beta field
    assert untyped == set(samples(MESSAGES)) | {"context_management"}
    assert {f.name for f in s.FIELDS if f.extension} == {
        p.name for p in params_in(MESSAGES) if p.extension_in(MESSAGES)} >= {"seed", "min_p"}
    assert set(rows[s.CREATE]) == create | untyped
    assert set(rows[s.COUNT]) == count | {f.name for f in s.FIELDS
                                          if f.untyped and f.support(s.COUNT) is not None}
    for f in s.FIELDS:  # a row the schema lacks would be silently dropped
        if f.support(s.CREATE) is not None:
            assert f.name in s.MessagesRequest.model_fields, f.name
        if f.support(s.COUNT) is not None:
            assert f.name in s.CountTokensRequest.model_fields, f.name


@pytest.mark.parametrize("endpoint", [s.CREATE, s.COUNT])
def test_each_row_behaves_as_its_table_says(endpoint):
    for name, row in s.BY_ENDPOINT[endpoint].items():
        body = {k: v for k, v in BASE.items() if endpoint == s.CREATE or k != "max_tokens"}
        body[name] = SAMPLES[name]
        support = row.support(endpoint)
        if support is Support.REFUSED:
            with pytest.raises(ApiError) as e:
                s.validate(json.dumps(body).encode(), endpoint)
            assert e.value.status == 400 and e.value.param == name
        else:
            t.to_internal(s.validate(json.dumps(body).encode(), endpoint))


def refused(body: dict, endpoint: str = s.CREATE) -> ApiError:
    with pytest.raises(ApiError) as e:
        s.validate(json.dumps(body).encode(), endpoint)
    assert e.value.status == 400
    return e.value


def test_refusals_name_what_they_refuse():
    assert refused({**BASE, "n": 2}).param == "n"  # not a field of Messages
    assert refused({**BASE, "frequency_penalty": 3}).param == "frequency_penalty"
    assert refused({**BASE, "max_tokens": 16}, s.COUNT).param == "max_tokens"
    assert refused({k: v for k, v in BASE.items() if k != "max_tokens"}).param == "max_tokens"
    assert refused({**BASE, "max_tokens": 0}).param == "max_tokens"
    assert refused({**BASE, "temperature": 1.5}).param == "temperature"
    e = refused({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert e.param == "tools.0.type"
    e = refused({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]})
    assert e.param == "messages.0.content.0.type"
    e = refused({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]})
    assert e.param == "messages.0.content.0.content.0.type"
    e = refused({**BASE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "colour": "red"}]}]})
    assert e.param == "messages.0.content.0.colour"
    assert refused({**BASE, "tool_choice": {"type": "tool"}, "tools": SAMPLES["tools"]}).param \
        == "tool_choice.name"
    assert refused({**BASE, "tool_choice": {"type": "any"}}).param == "tool_choice"
    assert refused({**BASE, "thinking": {"type": "enabled"}}).param == "thinking.budget_tokens"
    assert refused({**BASE, "thinking": {"type": "enabled", "budget_tokens": 2048}}).param \
        == "thinking.budget_tokens"  # not less than max_tokens
    assert refused({**BASE, "stop_sequences": ["a"] * 17}).param == "stop_sequences"
    prefill = [*BASE["messages"], {"role": "assistant", "content": "The answer is"}]
    assert refused({**BASE, "messages": prefill}).param == "messages.1"


def test_translation_onto_a_chat_request():
    body = {**BASE, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;\n"
                                "You are terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "add 7"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "use add", "signature": "sig"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 7}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "7"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "boom"}]},
                    {"type": "text", "text": "next"}]}],
            "tools": [{"name": "add", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "temperature": 0, "top_k": 3,
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}
    chat = t.to_internal(s.validate(json.dumps(body).encode(), s.CREATE))
    assert internal.messages(chat) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "add 7"},
        {"role": "assistant", "content": "calling", "reasoning_content": "use add",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a": 7}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "7"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "next"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert internal.functions(chat)[0]["parameters"] == {"type": "object"}
    assert chat.stops == ("END",) and chat.params["temperature"] == 0
    assert chat.params["top_k"] == 3
    assert chat.input.template_kwargs == {"enable_thinking": True} and chat.max_tokens == 2000
    named = t.to_internal(s.validate(json.dumps({**body, "tool_choice": {
        "type": "tool", "name": "add"}}).encode(), s.CREATE))
    assert named.tool_choice == {"type": "function", "function": {"name": "add"}}
    none = t.to_internal(s.validate(json.dumps({**body, "tool_choice": {"type": "none"}}).encode(),
                                s.CREATE))
    assert none.tool_choice == "none"
    fmt = {**BASE, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object"}}}}
    rf = t.to_internal(s.validate(json.dumps(fmt).encode(), s.CREATE)).response_format
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == {"type": "object"}
    adaptive = {**BASE, "thinking": {"type": "adaptive"}}
    assert t.to_internal(s.validate(json.dumps(adaptive).encode(), s.CREATE)) \
        .input.template_kwargs == {}  # the template's own default


def test_blocks_hold_leading_whitespace_and_close_in_order():
    b = render.Blocks("sig")
    evs = b.feed(ReasoningEvent("think")) + b.feed(TextEvent("\n\n")) + b.feed(TextEvent("Hi"))
    evs += b.feed(ToolCallEvent(ToolCall("call_ab", "f", '{"x": 1}'))) + b.feed(TextEvent("\n"))
    evs += b.close()
    assert b.blocks == [{"type": "thinking", "thinking": "think", "signature": "sig"},
                        {"type": "text", "text": "\n\nHi"},
                        {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {"x": 1}}]
    assert [e[0] for e in evs].count("content_block_start") == 3
    assert [e[0] for e in evs].count("content_block_stop") == 3


def test_errors_stop_reasons_and_usage():
    e = ApiError(400, "bad schema", param="response_format.json_schema.schema")
    body = render.error_body(e, "req_1")
    assert body == {"type": "error", "request_id": "req_1", "error": {
        "type": "invalid_request_error", "message": "output_config.format.schema: bad schema"}}
    assert render.param_name("tools.2.function.parameters") == "tools.2.input_schema"
    assert [render.error_type(c) for c in (401, 404, 413, 429, 502, 503, 504)] == [
        "authentication_error", "not_found_error", "request_too_large", "rate_limit_error",
        "api_error", "overloaded_error", "timeout_error"]
    f = Final(Finish.STOP, prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    assert render.usage(f, 10) == {"input_tokens": 6, "output_tokens": 3,
                                   "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}


def test_the_docs_table_is_the_field_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    section = doc[doc.index("### Messages request fields"):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].split("`")[1]] = (cells[1], cells[2])

    def col(v):
        return v.value if v is not None else "—"

    assert rows == {f.name: (col(f.support(s.CREATE)), col(f.support(s.COUNT))) for f in s.FIELDS}


def test_errors_under_v1_messages_take_anthropics_shape_and_no_others():
    import services.gateway.anthropic.routes  # noqa: F401 - registers its shape
    from services.gateway.core.errors import shaped

    e = ApiError(500, "internal error: KeyError", code="internal")
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches"):
        body = json.loads(shaped(path, e).body)
        assert body["type"] == "error" and body["error"]["type"] == "api_error", path
    for path in ("/v1/chat/completions", "/v1/messagesx", "/v1/responses"):
        assert json.loads(shaped(path, e).body)["error"]["code"] == "internal", path


def _turns(edits=None):
    """A conversation with thinking in two assistant turns (as Claude Code sends it)."""
    body = {**BASE, "messages": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "T1", "signature": "s"},
                                          {"type": "text", "text": "A1"}]},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "T2", "signature": "s"},
                                          {"type": "text", "text": "A2"}]},
        {"role": "user", "content": "three"}]}
    if edits is not None:
        body["context_management"] = {"edits": edits}
    msgs = t.chat_messages(s.validate(json.dumps(body).encode(), s.CREATE))
    return [m.get("reasoning_content") for m in msgs if m["role"] == "assistant"]


def test_context_management_clear_thinking_keeps_what_it_says():
    edit = "clear_thinking_20251015"
    assert _turns() == ["T1", "T2"]  # no edit: every turn's thinking stays
    assert _turns([{"type": edit, "keep": "all"}]) == ["T1", "T2"]
    assert _turns([{"type": edit}]) == [None, "T2"]  # Anthropic's default: the last turn
    assert _turns([{"type": edit, "keep": {"type": "thinking_turns", "value": 2}}]) == ["T1", "T2"]
    assert _turns([{"type": edit, "keep": {"type": "thinking_turns", "value": 1}}]) == [None, "T2"]
    for edits, param in (([{"type": "clear_tool_uses_20250919"}], "context_management.edits.0.type"),
                         ([{"type": edit, "keep": {"type": "thinking_turns", "value": 0}}],
                          "context_management.edits.0.keep"),
                         ([{"type": edit, "clear_at_least": 5}], "context_management.edits.0")):
        with pytest.raises(ApiError) as e:
            _turns(edits)
        assert e.value.message.startswith(param), e.value.message


def test_claude_codes_first_request_is_accepted_and_translated():
    req = s.validate(json.dumps(CLAUDE_CODE_FIRST).encode(), s.CREATE)
    chat = t.to_internal(req)
    roles = [m["role"] if isinstance(m, dict) else m.role for m in t.chat_messages(req)]
    assert roles == ["system", "user", "system"]
    assert "billing-header" not in t.chat_messages(req)[0]["content"]
    assert chat.input.template_kwargs == {} and internal.tool_names(chat)[0] == "Bash"


@pytest.mark.parametrize("endpoint", [s.CREATE, s.COUNT])
def test_a_conversation_without_any_content_is_a_400(endpoint):
    """Every turn empty and no system prompt: nothing to answer (it was a 500)."""
    body = {"model": "m", "messages": [{"role": "user", "content": []}],
            **({"max_tokens": 16} if endpoint == s.CREATE else {})}
    with pytest.raises(ApiError) as e:
        t.to_internal(s.validate(json.dumps(body).encode(), endpoint))
    assert (e.value.status, e.value.param) == (400, "messages")
    with_system = {**body, "system": "Be brief."}
    assert internal.messages(t.to_internal(s.validate(json.dumps(with_system).encode(),
                                                      endpoint))) == [
        {"role": "system", "content": "Be brief."}]
