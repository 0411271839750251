"""Model output → content, reasoning and tool calls (services/gateway/core/output_parser.py),
with mlx-lm's own tool parsers chosen from the chat template as mlx_lm.server chooses,
and reasoning markers kept by the detokenizer even when they are special tokens."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest

from models.tinymodel import build_model
from services.gateway.core.chat_format import ChatFormat
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.output_parser import MAX_ENVELOPE, OutputParser
from tests.support.thinker_model import thinker_model

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "city": {"type": "string"}}}}}
    for n in ("get_weather", "add")]
NAMES = {"get_weather", "add"}
THINK = ChatFormat(think_start="<think>", think_end="</think>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")


def fmt_of(parser: str, **kw) -> ChatFormat:
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ChatFormat(tool_start=mod.tool_call_start, tool_end=mod.tool_call_end,
                      tool_parser=mod.parse_tool_call, parser_name=parser, **kw)


def run(p: OutputParser, src: str, step: int = 3) -> list[tuple[str, object]]:
    events = []
    for i in range(0, len(src), step):  # split everywhere, inside markers too
        events += p.feed(src[i:i + step])
    return events + p.flush()


def text_of(events, kind: str) -> str:
    return "".join(v for k, v in events if k == kind)


def test_the_embedded_model_gets_mlx_lms_json_parser(tiny):
    tok = load_tokenizer(tiny)
    assert tok.fmt.parser_name == "json_tools" and tok.fmt.tool_start == "<tool_call>"
    assert not tok.fmt.has_thinking
    p = OutputParser(tok.fmt, tools=TOOLS, tool_names=NAMES)
    src = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done')
    events = run(p, src)
    assert [k for k, _ in events][0] == "content"
    calls = [v for k, v in events if k == "tool_call"]
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1}
    # whitespace before and between envelopes is formatting: dropped
    assert text_of(events, "content") == "Sure. done"
    for step in (1, 2, 5, 7, len(src)):  # however the text was split into chunks
        again = run(OutputParser(tok.fmt, tools=TOOLS, tool_names=NAMES), src, step)
        assert text_of(again, "content") == "Sure. done", step
        assert [(v.name, v.arguments) for k, v in again if k == "tool_call"] == \
            [(c.name, c.arguments) for c in calls], step


@pytest.mark.parametrize("src", [
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # arguments not an object
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "add", "arguments": {}}',  # never closed
])
def test_invalid_envelopes_stay_text(src):
    events = run(OutputParser(fmt_of("json_tools"), tools=TOOLS, tool_names=NAMES), src)
    assert all(k == "content" for k, _ in events)
    assert text_of(events, "content") == src


def test_no_tools_offered_no_tool_calls():
    src = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    events = run(OutputParser(fmt_of("json_tools"), tools=None, tool_names=None), src)
    assert text_of(events, "content") == src


@pytest.mark.parametrize(("parser", "src"), [
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 7}}]'),
    ("pythonic", "<|tool_call_start|>[add(a=7)]<|tool_call_end|>"),
    ("glm47", "<tool_call>add<arg_key>a</arg_key><arg_value>7</arg_value></tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">7</parameter>\n'
                   "</invoke>\n</minimax:tool_call>"),
])
def test_other_families_through_mlx_lms_parsers(parser, src):
    events = run(OutputParser(fmt_of(parser), tools=TOOLS, tool_names=NAMES), "ok " + src)
    calls = [v for k, v in events if k == "tool_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 7})], events
    assert text_of(events, "content") == "ok"  # the space before the envelope: formatting


def test_the_parser_follows_the_chat_template(tiny, tmp_path):
    d = tmp_path / "coder"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                            "{% if tools %}<tool_call>\n<function=NAME>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(d).fmt.parser_name == "qwen3_coder"


def test_runaway_envelope_is_text():
    p = OutputParser(fmt_of("json_tools"), tools=TOOLS, tool_names=NAMES)
    body = "x" * (MAX_ENVELOPE + 10)
    events = p.feed("<tool_call>" + body) + p.flush()
    assert text_of(events, "content") == "<tool_call>" + body


def test_reasoning_is_split_from_content():
    events = run(OutputParser(THINK), "<think>\nsteps 1 and 2\n</think>\n\nThe answer.", step=2)
    assert text_of(events, "reasoning") == "\nsteps 1 and 2\n"
    assert text_of(events, "content") == "The answer."  # the blank lines after it: formatting


def test_a_prompt_that_opens_reasoning_starts_in_it():
    assert THINK.opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not THINK.opens_in_reasoning("<think>a</think> x")
    events = run(OutputParser(THINK, in_reasoning=True), "hmm</think>Yes")
    assert (text_of(events, "reasoning"), text_of(events, "content")) == ("hmm", "Yes")


def test_a_tool_call_after_reasoning():
    fmt = fmt_of("json_tools", think_start="<think>", think_end="</think>")
    src = '<think>need add</think>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    events = run(OutputParser(fmt, tools=TOOLS, tool_names=NAMES), src)
    assert [k for k, _ in events if k != "reasoning"] == ["tool_call"]
    assert text_of(events, "reasoning") == "need add"


def test_special_think_tokens_reach_the_parser(tiny, tmp_path):
    tok = load_tokenizer(thinker_model(tiny, tmp_path / "thinker"))
    assert tok.fmt.has_thinking and tok.fmt.think_start == "<think>"
    ids = [*tok.encode("<think>"), *tok.encode("why"), *tok.encode("</think>"),
           *tok.encode("so"), *tok.encode("<|im_end|>")]
    assert tok.decode(ids) == "<think>why</think>so"  # markers kept, other specials not
    d = tok.detokenizer()
    assert "".join(d.add([i]) for i in ids) + d.flush() == "<think>why</think>so"
    msgs = [{"role": "user", "content": "hi"}]
    on = tok.render_chat(msgs, None)
    off = tok.render_chat(msgs, None, {"enable_thinking": False})
    assert tok.fmt.opens_in_reasoning(on) and not tok.fmt.opens_in_reasoning(off)
