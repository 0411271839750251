"""Tools for a model whose chat template has none (services/gateway/core/tool_prompt.py): the
tool list and the tool turns reach the prompt as text in json_tools's form, the calls
come back parsed, and tool_choice can force one — instead of the tools vanishing from the
prompt (a silent no-op) and a tool loop failing in the template."""

from __future__ import annotations

import jinja2
import pytest

from models.tinymodel import build_model
from services.gateway.core import tool_prompt
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.output_parser import OutputParser
from services.gateway.core.prompts import prompt_ids
from services.gateway.core.structured import tool_call_grammar, tool_format
from services.gateway.openai.schemas import ChatRequest
from services.gateway.openai.translate import from_chat
from tests.support.plain_template_model import plain_template_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
LOOP = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    return load_tokenizer(plain_template_model(tiny, tmp_path_factory.mktemp("p") / "plain"))


def test_fold_writes_the_tools_into_the_system_message_and_the_tool_turns_as_text():
    out = tool_prompt.fold(LOOP, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert ('{"type": "function", "function": {"name": "get_weather", "description": "The '
            'weather of a city"') in system
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                 "<tool_response>\nrain\n</tool_response>")
    assert all(set(m) == {"role", "content"} for m in out)
    assert LOOP[2]["content"] is None and "tool_calls" in LOOP[2]  # the input is not changed


def test_fold_without_a_system_message_adds_one_and_without_tools_adds_none():
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "Checking.", "tool_calls": [
                 {"id": "c", "type": "function",
                  "function": {"name": "f", "arguments": "not json"}}]}]
    out = tool_prompt.fold(turns, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools\n")
    assert out[2]["content"] == ('Checking.\n<tool_call>\n{"name": "f", "arguments": '
                                 '"not json"}\n</tool_call>')
    assert [m["role"] for m in tool_prompt.fold(turns, None)] == ["user", "assistant"]


def test_a_template_without_tools_gets_the_gateways_and_renders_a_whole_tool_loop(plain):
    assert plain.fmt.gateway_tools and plain.fmt.parser_name == "json_tools"
    assert tool_format(plain) == "json_tools"
    with pytest.raises((TypeError, jinja2.TemplateError)):  # the template cannot show a call
        plain.hf.apply_chat_template(LOOP, tokenize=False, add_generation_prompt=True)
    text = plain.render_chat(LOOP, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and '"arguments": {"city": "Rome"}' in text
    assert "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


def test_through_the_request_path_the_tools_cost_prompt_tokens_and_none_drops_them(plain):
    base = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    without = prompt_ids(from_chat(ChatRequest(**base)), plain, 8)
    offered = prompt_ids(from_chat(ChatRequest(**base, tools=[WEATHER])), plain, 8)
    off = prompt_ids(from_chat(ChatRequest(**base, tools=[WEATHER], tool_choice="none")), plain, 8)
    assert len(offered.ids) > len(without.ids) + 40
    assert plain.decode(offered.ids).count("get_weather") == 1
    assert off.ids == without.ids


def test_calls_come_back_parsed_and_tool_choice_can_force_one(plain):
    p = OutputParser(plain.fmt, tools=[WEATHER], tool_names={"get_weather"})
    events = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                    '</tool_call>') + p.flush()
    assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city": "Oslo"}')]
    assert [k for k, _ in events] == ["tool_call"]
    assert tool_call_grammar([WEATHER], "required", None, plain)


def test_a_template_with_tools_renders_them_itself(tiny):
    tok = load_tokenizer(tiny)
    assert not tok.fmt.gateway_tools
    assert tok.render_chat(LOOP[:2], [WEATHER]) == tok.fmt.wrapper.apply_chat_template(
        LOOP[:2], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
