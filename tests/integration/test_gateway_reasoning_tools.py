"""Reasoning and tool calls through the whole gateway with the real `openai` client: a
real uvicorn server and signed channels, a fake rank 0 scripted to emit exactly what a
thinking Qwen3-Coder-style model would (a random-weight model never does), a "thinking"
tokenizer (`<think>` special tokens, a template that opens reasoning, qwen3_coder tool
format inferred by mlx-lm)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.fake_gateway import FakeGatewayClient, say, thinker_gateway

CALL = "<tool_call>\n<function=add>\n<parameter=a>\n{}\n</parameter>\n</function>\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
MSGS = [{"role": "user", "content": "add 7"}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with thinker_gateway(tmp_path_factory, coder=True) as g:
        assert g.tok.fmt.parser_name == "qwen3_coder" and g.tok.fmt.has_thinking
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0, timeout=20)
        yield g.with_client(c)


def chat(env: FakeGatewayClient[openai.OpenAI], **kw):
    return env.c.chat.completions.create(model=env.model_name, messages=MSGS, max_tokens=200,
                                         **kw)


@pytest.mark.timeout(60)
def test_reasoning_is_reasoning_content(env):
    say(env, "seven plus nothing</think>\n\nIt is 7.")
    r = chat(env)
    msg = r.choices[0].message
    assert msg.content == "It is 7." and msg.model_extra["reasoning_content"] == "seven plus nothing"
    think = env.tok.hf.convert_tokens_to_ids("<think>")
    assert think in env.rank.generates[-1].prompt  # the template opened it
    chunks = list(chat(env, stream=True))
    deltas = [(k, v) for ch in chunks for d in [ch.choices[0].delta] if ch.choices
              for k, v in (("reasoning", (d.model_extra or {}).get("reasoning_content")),
                           ("content", d.content)) if v]
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning first
    assert "".join(v for k, v in deltas if k == "reasoning") == "seven plus nothing"
    assert "".join(v for k, v in deltas if k == "content") == "It is 7."


@pytest.mark.timeout(60)
def test_enable_thinking_false_reaches_the_template(env):
    say(env, "Plain answer.")
    r = chat(env, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    think = env.tok.hf.convert_tokens_to_ids("<think>")
    assert think not in env.rank.generates[-1].prompt
    assert r.choices[0].message.content == "Plain answer."
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


@pytest.mark.timeout(60)
def test_qwen3_coder_tool_calls_after_reasoning(env):
    say(env, "use the tool</think>\n" + CALL.format(7) + "\n" + CALL.format(8))
    r = chat(env, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] \
        == [("add", {"a": 7}), ("add", {"a": 8})]
    assert ch.message.model_extra["reasoning_content"] == "use the tool"
    chunks = list(chat(env, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, json.loads(tc.function.arguments)["a"]) for tc in calls] == [(0, 7), (1, 8)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    one = chat(env, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [{"a": 7}]
