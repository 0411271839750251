"""The gateway's OpenAI layer, request safety and admin API over real sockets: a real
uvicorn server, real signed ZeroMQ channels, a fake rank 0 and a fake supervisor
(tests/fakes/gateway_fakes.py) so that outputs can be scripted."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from common.keys import ensure_cluster_key
from common.messages import ErrorCode
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until, sse_lines
from tests.support.fake_gateway import FakeGateway, fake_gateway

TOKEN = "admin-secret-token"
READ_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with fake_gateway(tmp_path_factory, admin_token=TOKEN, keepalive_s=0.2, orphan_grace_s=0.5,
                      request_read_timeout=READ_TIMEOUT, refresh_s=0.5,
                      max_body_bytes=64 * 1024,
                      # a failure's code ends the request at once here: this fake deployment
                      # is never redeployed, and resume has its own tests
                      # (tests/e2e/test_resume_live.py)
                      resume_timeout=0) as g:
        from services.gateway.core.detok import load_tokenizer

        load_tokenizer(g.model)  # loaded (and kept) before the tests run: g.tok
        yield g


@pytest.fixture(autouse=True)
def reset(env):
    r = env.rank
    r.script, r.step_s, r.prefill_s = None, 0.01, 0.0
    r.ignore_abort = r.drop_final = r.silent = False
    r.heartbeat_s = 0.0
    yield
    poll_until(lambda: env.gw.gw.cluster.active == 0, 10, "gateway active count back to 0")


def say(env: FakeGateway, text: str):
    """Make the fake rank generate exactly `text`."""
    ids = env.tok.encode(text)
    env.rank.script = lambda g: list(ids)


def client(env: FakeGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=env.url + "/v1", api_key="none", max_retries=0, timeout=20)


@pytest.mark.timeout(60)
def test_openai_client_roundtrip(env):
    c = client(env)
    assert [m.id for m in c.models.list().data] == [env.model_name]
    say(env, "hello there, world")
    r = c.chat.completions.create(model=env.model_name, messages=[{"role": "user", "content": "hi"}],
                                  temperature=0, max_tokens=50)
    assert r.choices[0].message.content == "hello there, world"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(env.tok.encode("hello there, world"))
    assert r.usage.prompt_tokens > 0
    chunks = list(c.chat.completions.create(
        model=env.model_name, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "hello there, world"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "stop"
    cr = c.completions.create(model=env.model_name, prompt="once upon", max_tokens=3)
    assert cr.choices[0].finish_reason == "length" and cr.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x")


@pytest.mark.timeout(60)
def test_stop_strings_cut_exactly_across_tokens(env):
    c = client(env)
    say(env, "alpha beta STOP gamma delta")
    for stop in ("STOP", ["zzz", " ST"], "a beta"):
        r = c.completions.create(model=env.model_name, prompt="x", stop=stop, max_tokens=50)
        full = "alpha beta STOP gamma delta"
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(full.find(s) for s in stops if s in full)
        assert r.choices[0].text == full[:cut]
        assert r.choices[0].finish_reason == "stop"
        chunks = list(c.completions.create(model=env.model_name, prompt="x", stop=stop, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full[:cut]
    # the rank-side request was aborted as soon as the stop string appeared
    poll_until(lambda: any(reason == "stop_string" for _, reason, _ in env.rank.aborts), 5,
               "an abort for the stop string")


@pytest.mark.timeout(60)
def test_utf8_never_split(env):
    text = "naïve café — 東京 🚀 ok"
    say(env, text)
    with httpx.stream("POST", env.url + "/v1/completions", timeout=20,
                      json={"model": env.model_name, "prompt": "x", "stream": True}) as resp:
        pieces = [d["choices"][0]["text"] for k, d in sse_lines(resp)
                  if k == "data" and d != "[DONE]"]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.timeout(60)
def test_tool_calls_streamed_and_collected(env):
    c = client(env)
    say(env, 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    r = c.chat.completions.create(model=env.model_name, tools=TOOLS,
                                  messages=[{"role": "user", "content": "weather?"}])
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert m.content.startswith("Let me check.") and '"nope"' in m.content  # invalid: text
    chunks = list(c.chat.completions.create(model=env.model_name, tools=TOOLS, stream=True,
                                            messages=[{"role": "user", "content": "weather?"}]))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert content.startswith("Let me check.") and "<tool_call>" in content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without tools the envelope is plain text
    r = c.chat.completions.create(model=env.model_name, messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


@pytest.mark.timeout(60)
def test_stop_strings_with_tools_keep_what_the_tool_parser_held(env):
    """A stop string ends the text; whatever the tool-call parser was still holding back
    (a possible "<tool_call>" start, an unclosed envelope) is content, cut exactly."""
    c = client(env)
    msgs = [{"role": "user", "content": "x"}]
    for text, stop, want in (("a <STOP b", "STOP", "a <"),
                             ('x <tool_call>{"name": "f"STOP', "STOP", 'x <tool_call>{"name": "f"')):
        say(env, text)
        r = c.chat.completions.create(model=env.model_name, tools=TOOLS, messages=msgs, stop=stop)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")
        chunks = list(c.chat.completions.create(model=env.model_name, tools=TOOLS, messages=msgs,
                                                stop=stop, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


@pytest.mark.timeout(60)
def test_disconnect_mid_stream_aborts_at_once(env):
    rank, gw = env.rank, env.gw.gw
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    with httpx.stream("POST", env.url + "/v1/completions", timeout=20,
                      json={"model": env.model_name, "prompt": "x", "stream": True,
                            "max_tokens": 300}) as resp:
        rid = resp.headers["x-lockstep-request-id"]
        for kind, d in sse_lines(resp):
            if kind == "data" and d["choices"][0]["text"]:
                break
        closed_at = time.time()
    got = poll_until(lambda: [a for a in rank.aborts if a[0] == rid], 5, "the abort at rank 0")
    assert got[0][1] == "client_disconnect"
    assert got[0][2] - closed_at < 1.0
    poll_until(lambda: gw.cluster.active == 0, 5, "active count 0")
    assert rank.finished.get(rid) == "abort"


@pytest.mark.timeout(60)
def test_non_streaming_disconnect_aborts(env):
    rank = env.rank
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.url + "/v1/completions", timeout=0.5,
                   json={"model": env.model_name, "prompt": "x", "max_tokens": 300})
    poll_until(lambda: any(r == "client_disconnect" for _, r, _ in rank.aborts[-1:]), 5,
               "the abort of the non-streaming request")


@pytest.mark.timeout(60)
def test_a_request_rank_0_says_is_waiting_outlasts_the_read_timeout(env):
    """Rank 0 holds it three read timeouts before its first token (a long queue, a KV
    budget), saying so every 0.5 s: it is served, not cancelled; the same wait without
    the heartbeats ends in the read timeout's 504 (the existing test below)."""
    rank = env.rank
    rank.prefill_s, rank.heartbeat_s = 3 * READ_TIMEOUT, 0.5
    say(env, "worth the wait")
    r = httpx.post(env.url + "/v1/completions", timeout=20,
                   json={"model": env.model_name, "prompt": "x", "max_tokens": 16})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "worth the wait"
    assert not [a for a in rank.aborts if a[1] == "read_timeout"]
    rank.heartbeat_s = 0.0
    r = httpx.post(env.url + "/v1/completions", timeout=20,
                   json={"model": env.model_name, "prompt": "x", "max_tokens": 16})
    assert r.status_code == 504 and r.json()["error"]["code"] == "read_timeout", r.text


@pytest.mark.timeout(60)
def test_keepalive_during_prefill_and_read_timeout(env):
    rank = env.rank
    rank.prefill_s = 0.7
    say(env, "late but fine")
    with httpx.stream("POST", env.url + "/v1/chat/completions", timeout=20,
                      json={"model": env.model_name, "stream": True,
                            "messages": [{"role": "user", "content": "x"}]}) as resp:
        events = list(sse_lines(resp))
    first_data = next(i for i, (k, d) in enumerate(events)
                      if k == "data" and d != "[DONE]" and d["choices"][0]["delta"].get("content"))
    assert sum(1 for k, _ in events[:first_data] if k == "comment") >= 2
    final = [d for k, d in events if k == "data" and d != "[DONE]"][-1]
    assert final["lockstep"]["ttft_model_ms"] >= 600 and final["lockstep"]["ttft_visible_ms"] >= 600
    # silent rank: the read timeout cancels rank-side and tells the client clearly
    rank.silent = True
    t0 = time.monotonic()
    r = httpx.post(env.url + "/v1/completions", timeout=20,
                   json={"model": env.model_name, "prompt": "x"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "read_timeout"
    assert READ_TIMEOUT <= time.monotonic() - t0 < READ_TIMEOUT + 2
    # the client's own disconnect after the 504 may add a second abort; the first says why
    poll_until(lambda: any(a[1] == "read_timeout" for a in rank.aborts), 5,
               "rank 0 to receive the read-timeout abort")
    with pytest.raises(openai.APIError, match="no token"):
        list(client(env).completions.create(model=env.model_name, prompt="x", stream=True))


@pytest.mark.timeout(60)
def test_orphans_and_lost_finals_do_not_leak(env):
    rank, gw = env.rank, env.gw.gw
    rank.drop_final = True  # the final chunk of an aborted request is lost
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    with httpx.stream("POST", env.url + "/v1/completions", timeout=20,
                      json={"model": env.model_name, "prompt": "x", "stream": True}) as resp:
        next(resp.iter_lines())
    poll_until(lambda: gw.cluster.active == 0, 5, "the drain to verify with STATS and forget it")
    # backend finished, consumer gone (never read its final chunk) → reaped after the grace
    rank.drop_final = False
    backend = next(iter(gw.cluster.backends.values()))
    from services.gateway.core.request_channel import RequestStream

    s = RequestStream(backend, "orphan-1", 1)
    s.queue.put_nowait(type("M", (), {"body": type("T", (), {"finish_reason": "stop"})()})())
    s.consumer_seen = s.queue.final_at = time.monotonic() - 10
    backend.streams["orphan-1"] = s
    assert backend.reap_orphans() == 1 and "orphan-1" not in backend.streams


@pytest.mark.timeout(60)
def test_bad_input_gets_openai_errors_and_service_continues(env):
    u, m = env.url, env.model_name

    def post(path, body, **kw):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(u + path, content=data, timeout=10,
                          headers={"content-type": "application/json", **kw.get("headers", {})})

    cases = [
        (post("/v1/chat/completions", b"{not json"), 400, "invalid_json"),
        (post("/v1/chat/completions", {"model": m, "messages": "hi"}), 400, "invalid_value"),
        (post("/v1/completions", {"model": m, "prompt": "x", "max_tokens": -5}), 400, "invalid_value"),
        (post("/v1/completions", {"model": m, "prompt": "x", "temperature": "hot"}), 400, "invalid_value"),
        (post("/v1/completions", {"model": m, "prompt": "x", "n": 17}), 400, "invalid_value"),
            (post("/v1/completions", {"model": m, "prompt": "x", "suffix": "y"}), 400,
             "unsupported_parameter"),
        (post("/v1/completions", {"model": "gpt-nope", "prompt": "x"}), 404, "model_not_found"),
        (post("/v1/completions", {"model": m, "prompt": "x" * 100_000}), 413, "request_too_large"),
        (httpx.post(u + "/admin/api/cluster/abort-all", timeout=10), 401, "invalid_admin_token"),
        (httpx.get(u + "/admin/api/cluster/status", timeout=10,
                   headers={"authorization": "Bearer wrong"}), 401, "invalid_admin_token"),
        (httpx.get(u + "/v1/nothing", timeout=10), 404, "not_found"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["code"] == code and err["message"] and "type" in err and "param" in err
    assert cases[2][0].json()["error"]["param"] == "max_tokens"
    say(env, "still serving")
    r = client(env).completions.create(model=m, prompt="x")
    assert r.choices[0].text == "still serving"


@pytest.mark.timeout(60)
def test_rank_errors_become_http_by_code_not_by_text(env):
    """Rank 0's refusal reaches the client with the status its error_code maps to; the
    text (here always words the old prefix match would have sorted otherwise) is only
    carried in the message."""
    u, m, rank = env.url, env.model_name, env.rank
    cases = [(ErrorCode.INVALID_REQUEST, "not serving (phase loading)", 400, "invalid_request"),
             (ErrorCode.NOT_SERVING, "empty prompt", 503, "model_not_ready"),
             (ErrorCode.RANK_STOPPED, "duplicate request_id", 502, "backend_error")]
    try:
        for code, text, status, openai_code in cases:
            rank.refuse = lambda g, c=code, t=text: (c, t)
            r = httpx.post(u + "/v1/completions", json={"model": m, "prompt": "x"}, timeout=10)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == openai_code and err["message"].endswith(text)
            with httpx.stream("POST", u + "/v1/completions", timeout=10,
                              json={"model": m, "prompt": "x", "stream": True}) as s:
                events = [d for k, d in sse_lines(s) if k == "data" and d != "[DONE]"]
            assert events[-1]["error"]["code"] == openai_code, events  # in-band, streamed
    finally:
        rank.refuse = None


@pytest.mark.timeout(60)
def test_headers_metrics_health(env):
    say(env, "metrics please")
    r = httpx.post(env.url + "/v1/chat/completions", timeout=10,
                   json={"model": env.model_name, "messages": [{"role": "user", "content": "x"}]})
    assert float(r.headers["x-lockstep-ttft-model-ms"]) > 0
    assert float(r.headers["x-lockstep-ttft-visible-ms"]) >= float(r.headers["x-lockstep-ttft-model-ms"])
    text = httpx.get(env.url + "/metrics", timeout=10).text
    for name in ("lockstep_gateway_requests_total", "lockstep_ttft_model_seconds_bucket",
                 "lockstep_ttft_visible_seconds_bucket", "lockstep_token_latency_seconds_bucket",
                 "lockstep_gateway_active_requests", "lockstep_rank_step",
                 "lockstep_gateway_tokens_total", "lockstep_bus_rejected",
                 "lockstep_gateway_aborts_total", "lockstep_cluster_cancel_epoch"):
        assert name in text, name
    assert httpx.get(env.url + "/health", timeout=5).json()["status"] == "ok"
    ready = httpx.get(env.url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["ready"] is True


@pytest.mark.timeout(60)
def test_abort_all_under_load_returns_evidence(env):
    rank, gw = env.rank, env.gw.gw
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    results: list[list] = []

    def run_one():
        with httpx.stream("POST", env.url + "/v1/completions", timeout=30,
                          json={"model": env.model_name, "prompt": "x", "stream": True,
                                "max_tokens": 300}) as resp:
            results.append(list(sse_lines(resp)))

    threads = [threading.Thread(target=run_one) for _ in range(8)]
    for t in threads:
        t.start()
    poll_until(lambda: len(rank.active_ids) == 8, 10, "8 active requests at rank 0")
    r = httpx.post(env.url + "/admin/api/cluster/abort-all", timeout=30,
                   headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    ev = r.json()
    assert ev["zero_active"] is True and ev["gateway_active"] == 0 and ev["ranks"] == {"0": 0}
    for t in threads:
        t.join(10)
    assert len(results) == 8
    for events in results:
        assert events[-1] == ("data", "[DONE]")
        assert events[-2][1]["choices"][0]["finish_reason"] == "abort"
    assert gw.cluster.active == 0


@pytest.mark.timeout(60)
def test_unload_gate_then_forced_teardown(env):
    rank, sup = env.rank, env.sup
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    hdr = {"authorization": f"Bearer {TOKEN}"}
    done: list = []
    t = threading.Thread(target=lambda: done.append(httpx.post(
        env.url + "/v1/completions", timeout=30,
        json={"model": env.model_name, "prompt": "x", "max_tokens": 300})))
    t.start()
    poll_until(lambda: rank.active_ids, 10, "an active request")
    url = f"{env.url}/admin/api/cluster/deployments/{sup.deployment_id}/unload"
    r = httpx.post(url, headers=hdr, json={}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "active_requests"
    assert not any(c.command == "stop" for c in sup.commands)
    r = httpx.post(url, headers=hdr, json={"force": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["evidence"]["zero_active"] is True and body["teardown"]["outcome"]["proven"]
    t.join(10)
    assert done[0].json()["choices"][0]["finish_reason"] == "abort"
    # nothing serving now: 503 with the reason, /ready false
    poll_until(lambda: not env.gw.gw.cluster.backends, 5, "the backend to be closed")
    r = httpx.post(env.url + "/v1/completions", timeout=10,
                   json={"model": env.model_name, "prompt": "x"})
    assert r.status_code == 503 and "no deployment" in r.json()["error"]["message"]
    assert httpx.get(env.url + "/ready", timeout=5).status_code == 503
    sup.state = "serving"
    sup.publish()
    poll_until(lambda: env.gw.gw.cluster.backends, 5, "the deployment to be back")


@pytest.mark.timeout(60)
def test_gateway_stop_aborts_running_requests_and_api_keys(env):
    import dataclasses

    rank, sup = env.rank, env.sup
    rank.step_s = 0.05
    rank.script = lambda g: list(range(10, 400))
    s = dataclasses.replace(env.gw.gw.settings, port=free_port(), api_keys=("k1", "k2"))
    gw2 = GatewayThread(s, ensure_cluster_key(s.cluster_key_path)).start()
    try:
        poll_until(lambda: gw2.gw.cluster.backends, 10, "the deployment on the second gateway")
        body = {"model": env.model_name, "prompt": "x", "max_tokens": 300}
        r = httpx.post(gw2.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(gw2.url + "/v1/completions", json=body, timeout=10,
                       headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        ok = openai.OpenAI(base_url=gw2.url + "/v1", api_key="k2", max_retries=0)
        assert [m.id for m in ok.models.list().data] == [env.model_name]
        t = threading.Thread(target=lambda: httpx.post(
            gw2.url + "/v1/completions", json=body, timeout=30,
            headers={"authorization": "Bearer k1"}), daemon=True)
        t.start()
        poll_until(lambda: rank.active_ids, 10, "a running request")
        rid = rank.active_ids[0]
    finally:
        gw2.stop()
    poll_until(lambda: any(a[0] == rid for a in rank.aborts), 5, "an abort when the gateway stops")
    poll_until(lambda: not rank.active_ids, 5, "rank 0 idle again")
    assert sup.state == "serving"


@pytest.mark.timeout(60)
def test_an_admin_command_past_the_gateways_deadline_is_a_504(env, tmp_path):
    """A supervisor that is alive but slow (a long deploy, a stop): the gateway's deadline
    passes without a reply. That is 504 `timeout` saying the command may still run, not
    503; and the gateway keeps answering what the supervisor does answer."""
    sup = FakeSupervisor(env.sup.key, env.rank, env.sup.model_path,
                         silent={"backend_selection"}).start()
    settings = GatewaySettings(home=tmp_path, port=free_port(), admin_token=TOKEN,
                               admin_endpoint=sup.admin_endpoint,
                               events_endpoint=sup.events_endpoint, admin_timeout_s=1.0,
                               refresh_s=0.5)
    gw = GatewayThread(settings, env.sup.key).start()
    try:
        hdr = {"authorization": f"Bearer {TOKEN}"}
        r = httpx.post(gw.url + "/admin/api/cluster/backend-selection", headers=hdr,
                       json={"hosts": [{"ssh": "localhost"}]}, timeout=30)
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "timeout" and "may still be running" in err["message"]
        r = httpx.get(gw.url + "/admin/api/cluster/status", headers=hdr, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        gw.stop()
        sup.stop()
