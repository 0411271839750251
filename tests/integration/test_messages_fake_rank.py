"""The Messages API (/v1/messages) through the whole gateway with the real `anthropic`
client: a real uvicorn server and signed channels, a fake rank 0 scripted to emit what a
thinking model that calls tools would (a random-weight model never does), and a
"thinking" tokenizer (`<think>` special tokens, a template that opens reasoning unless
enable_thinking is false; json_tools calls). What a live cluster cannot show: thinking
blocks, tool_use parsed from free text, stop_sequence, cache_read_input_tokens, the
event sequence byte by byte, API keys by x-api-key, errors in Anthropic's shape."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import httpx
import pytest

from tests.gwutil import GatewayThread, free_port, poll_until, sse_lines
from tests.support import fake_gateway
from tests.support.fake_gateway import FakeGateway, FakeGatewayClient, thinker_gateway

CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {}}}}}\n</tool_call>'
TOOLS = [{"name": "add", "description": "add a number",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
MSGS = [{"role": "user", "content": "add 7"}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with thinker_gateway(tmp_path_factory, coder=False) as g:
        assert g.tok.fmt.has_thinking and g.tok.fmt.parser_name == "json_tools"
        c = anthropic.Anthropic(base_url=g.url, api_key="none", max_retries=0, timeout=20)
        yield g.with_client(c)


def say(env: FakeGateway, text: str, cached: int = 0) -> None:
    fake_gateway.say(env, text, cached)


def create(env: FakeGatewayClient[anthropic.Anthropic], **kw):
    return env.c.messages.create(model=env.model_name, messages=kw.pop("messages", MSGS),
                                 max_tokens=kw.pop("max_tokens", 2000), **kw)


@pytest.mark.timeout(60)
def test_thinking_blocks_text_and_usage(env):
    say(env, "seven plus nothing</think>\n\nIt is 7.", cached=3)
    m = create(env, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "seven plus nothing" and m.content[0].signature
    assert m.content[1].text == "It is 7." and m.stop_reason == "end_turn"
    think = env.tok.hf.convert_tokens_to_ids("<think>")
    prompt = env.rank.generates[-1].prompt
    assert think in prompt  # the template opened it
    assert m.usage.cache_read_input_tokens == 3 and m.usage.input_tokens == len(prompt) - 3
    n = env.c.messages.count_tokens(model=env.model_name, messages=MSGS,
                                       thinking={"type": "enabled", "budget_tokens": 1024})
    assert n.input_tokens == len(prompt) == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with env.c.messages.stream(model=env.model_name, messages=MSGS, max_tokens=2000,
                                  thinking={"type": "adaptive"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", "seven plus nothing"), ("text", "It is 7.")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    omitted = create(env, thinking={"type": "enabled", "budget_tokens": 1024,
                                    "display": "omitted"})
    assert omitted.content[0].thinking == "" and omitted.content[1].text == "It is 7."


@pytest.mark.timeout(60)
def test_thinking_disabled_reaches_the_template(env):
    say(env, "Plain answer.")
    m = create(env, thinking={"type": "disabled"})
    think = env.tok.hf.convert_tokens_to_ids("<think>")
    assert think not in env.rank.generates[-1].prompt
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Plain answer."


@pytest.mark.timeout(60)
def test_the_event_sequence(env):
    say(env, "hmm</think>\nfirst " + CALL.format(7))
    body = {"model": env.model_name, "messages": MSGS, "max_tokens": 2000, "stream": True,
            "tools": TOOLS}
    events = []
    with httpx.stream("POST", env.url + "/v1/messages", json=body, timeout=20) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                d = json.loads(line[6:])
                assert d["type"] == name  # every event's name is its type
                events.append(d)
    got = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
           for e in events]
    got = [g for i, g in enumerate(got) if i == 0 or g != got[i - 1]]  # a delta per token
    assert got == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)], got
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] > 0
    args = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "input_json_delta"]
    assert [json.loads(a) for a in args] == [{"a": 7}]


@pytest.mark.timeout(60)
def test_tool_use_parsed_then_tool_result_loop(env):
    say(env, "ok</think>" + CALL.format(7) + "\n" + CALL.format(8))
    m = create(env, tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [u.input for u in uses] == [{"a": 7}, {"a": 8}]
    assert all(u.id.startswith("toolu_") and u.name == "add" for u in uses)
    one = create(env, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input for b in one.content if b.type == "tool_use"] == [{"a": 7}]
    say(env, "The sum is 15.")
    turn = [*MSGS, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "7"},
                {"type": "tool_result", "tool_use_id": uses[1].id,
                 "content": [{"type": "text", "text": "8"}], "is_error": False},
                {"type": "text", "text": "and the total?"}]}]
    done = create(env, messages=turn, tools=TOOLS, thinking={"type": "disabled"})
    assert done.stop_reason == "end_turn" and done.content[0].text == "The sum is 15."
    text = env.tok.decode(env.rank.generates[-1].prompt)
    assert text.count("<tool_call>") >= 3 and '"a": 8' in text and "and the total?" in text
    at = [text.index(t) for t in ("<tool_response>\n7", "<tool_response>\n8", "and the total?")]
    assert at == sorted(at)


@pytest.mark.timeout(60)
def test_stop_sequence_and_max_tokens(env):
    say(env, "alpha beta gamma delta")
    m = create(env, stop_sequences=["gamma"], thinking={"type": "disabled"})
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "gamma",
                                                                    "alpha beta ")
    m = create(env, max_tokens=2, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


@pytest.mark.timeout(60)
def test_errors_in_anthropic_shape(env):
    c = env.c
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=env.model_name, messages=MSGS, max_tokens=10,
                          extra_body={"n": 2})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == \
        "invalid_request_error" and "'n'" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-x", messages=MSGS, max_tokens=10)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(env.url + "/v1/messages", json={"model": env.model_name, "messages": MSGS},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")
    r = httpx.post(env.url + "/v1/messages", content=b"{", timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"
    big = b'{"model": "x", "messages": "' + b"y" * (env.settings.max_body_bytes + 1) + b'"}'
    r = httpx.post(env.url + "/v1/messages", content=big, timeout=30)  # the body cap's
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(env.url + "/v1/messages", timeout=10)  # routing's own
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/chat/completions", "/v1/completions"):  # OpenAI's shape, as before
        r = httpx.post(env.url + path, content=b"{", timeout=10)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    r = httpx.post(env.url + "/v1/chat/completions", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.timeout(60)
def test_x_api_key_is_accepted(env):
    s = dataclasses.replace(env.settings, port=free_port(), api_keys=("k1", "k2"))
    gw = GatewayThread(s, env.key).start()
    try:
        poll_until(lambda: gw.gw.cluster.backends, 10, "the fake deployment to be picked up")
        say(env, "hi")
        ok = anthropic.Anthropic(base_url=gw.url, api_key="k2", max_retries=0, timeout=20)
        assert ok.messages.create(model=env.model_name, messages=MSGS, max_tokens=5).content
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=gw.url, api_key="k3", max_retries=0).messages.create(
                model=env.model_name, messages=MSGS, max_tokens=5)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.get(gw.url + "/v1/models", headers={"x-api-key": "k1"}, timeout=10)
        assert r.status_code == 200  # every /v1 route takes it
        r = httpx.get(gw.url + "/v1/models", headers={"x-api-key": "k9"}, timeout=10)
        assert r.status_code == 401
        r = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer k1"}, timeout=10)
        assert r.status_code == 200
    finally:
        gw.stop()


@pytest.mark.timeout(60)
def test_a_disconnect_mid_stream_aborts(env):
    say(env, "word " * 150)
    env.rank.step_s = 0.05
    try:
        body = {"model": env.model_name, "messages": MSGS, "max_tokens": 150, "stream": True,
                "thinking": {"type": "disabled"}}
        with httpx.stream("POST", env.url + "/v1/messages", json=body, timeout=20) as r:
            rid = r.headers["x-lockstep-request-id"]
            seen = 0
            for kind, _ in sse_lines(r):
                seen += kind == "data"
                if seen >= 6:
                    break
        poll_until(lambda: any(a[0] == rid and a[1] == "client_disconnect"
                               for a in env.rank.aborts), 5, "the abort of " + rid)
    finally:
        env.rank.step_s = 0.01
