"""HTTP abuse against the gateway (issue 12, part 5): lone surrogates, deep JSON, huge
prompts, work that would stall the event loop, unexpected errors, admin auth order, and
readiness that must not outlive its deployment. A real uvicorn server per test, real
signed ZeroMQ channels, a fake rank 0 and a fake supervisor (tests/fakes)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import shutil
import threading
import time

import httpx
import psutil
import pytest

from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until

TOKEN = "admin-secret-token"
SLOW_TEMPLATE = "{%- for i in range(2000) %}{%- for j in range(10000) %}{%- endfor %}{%- endfor %}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    home = tmp_path_factory.mktemp("gwhome")
    key = ensure_cluster_key(home / "keys" / "cluster.key")
    model = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")
    rank = FakeRank0(key).start()
    yield {"home": home, "key": key, "model": model, "rank": rank}
    rank.stop()


@pytest.fixture(autouse=True)
def reset_rank(base):
    base["rank"].script = None
    yield
    base["rank"].script = None


@contextlib.contextmanager
def gateway(base, model_path=None, routes=(), **kw):
    """A fake supervisor serving `model_path` (default: the tiny model) and a gateway on it,
    ready (/ready 200) before the body runs."""
    sup = FakeSupervisor(base["key"], base["rank"], str(model_path or base["model"])).start()
    settings = GatewaySettings(home=base["home"], port=free_port(), admin_token=TOKEN,
                               admin_endpoint=sup.admin_endpoint,
                               events_endpoint=sup.events_endpoint, refresh_s=0.5, **kw)
    gw = GatewayThread(settings, base["key"])
    for path, fn in routes:
        gw.app.add_api_route(path, fn, methods=["GET"])
    gw.start()
    try:
        poll_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, 20,
                   "the gateway to be ready")
        yield gw, sup
    finally:
        gw.stop()
        sup.stop()


def one_connection(port: int, requests: list[tuple[str, str, bytes | None]]):
    """Send every (method, path, body) on one keep-alive connection; per response:
    (status, json body, the client's local address). A server that closed the
    connection after a response shows as a new local address (or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    out = []
    try:
        for method, path, body in requests:
            conn.request(method, path, body=body, headers={"content-type": "application/json"})
            r = conn.getresponse()
            data = json.loads(r.read() or b"null")
            out.append((r.status, data, conn.sock.getsockname() if conn.sock else None))
    finally:
        conn.close()
    return out


@pytest.mark.timeout(60)
def test_lone_surrogates_are_400s_naming_the_field_on_a_kept_alive_connection(base):
    m = base["model"].name
    user = {"role": "user", "content": "hi"}
    cases = [  # json.dumps escapes a lone surrogate as \udxxx, as an attacker's client would
        ("/v1/completions", {"model": m, "prompt": "a\udfff"}, "prompt"),
        ("/v1/completions", {"model": m, "prompt": "a\udfff", "stream": True}, "prompt"),
        ("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("/v1/chat/completions", {"model": m, "stream": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"model": "\udc00", "messages": [user]}, "model"),
        ("/v1/completions", {"model": m, "prompt": "x", "stop": ["ok", "\udbff"]}, "stop.1"),
    ]
    with gateway(base) as (gw, _):
        reqs = [("POST", path, json.dumps(body).encode()) for path, body, _ in cases]
        reqs.append(("POST", "/v1/completions",  # a valid pair is one character: fine
                     json.dumps({"model": m, "prompt": "rocket \ud83d\ude80", "max_tokens": 2}).encode()))
        got = one_connection(gw.port, reqs)
    for (status, body, _), (_, _, param) in zip(got, cases, strict=False):
        assert status == 400, body
        assert (body["error"]["param"], body["error"]["code"]) == (param, "invalid_value"), body
        assert "surrogate" in body["error"]["message"]
    assert got[-1][0] == 200, got[-1]
    assert len({addr for *_, addr in got}) == 1 and got[0][2] is not None  # never closed


@pytest.mark.timeout(60)
def test_json_nested_deep_anywhere_is_a_400(base):
    m = base["model"].name

    def tools_body(depth: int) -> bytes:
        schema = '{"a": ' * depth + "1" + "}" * depth
        return (f'{{"model": "{m}", "max_tokens": 2, "messages": [{{"role": "user", "content": "x"}}],'
                f' "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}]}}'
                ).encode()

    with gateway(base) as (gw, _):
        got = one_connection(gw.port, [
            ("POST", "/v1/completions", b"[" * 10000 + b"]" * 10000),
            ("POST", "/v1/chat/completions", tools_body(10000)),
            ("POST", "/v1/chat/completions", tools_body(100)),  # under Python's recursion limit
            ("POST", "/v1/completions", (f'{{"model": "{m}", "prompt": "x", "user": ' + "[" * 5000
                                         + "]" * 5000 + "}").encode()),
            ("POST", "/v1/chat/completions", tools_body(50)),  # a deep but sane schema: served
        ])
        admin = httpx.post(gw.url + "/admin/api/cluster/deployments", timeout=10,
                           content=b'{"tp": ' + b"[" * 10000 + b"]" * 10000 + b"}",
                           headers={"authorization": f"Bearer {TOKEN}"})
    for status, body, _ in got[:4]:
        assert status == 400 and body["error"]["code"] == "invalid_json", body
        assert "deeper than 64" in body["error"]["message"]
    assert got[4][0] == 200, got[4]
    assert len({addr for *_, addr in got}) == 1
    assert admin.status_code == 400 and admin.json()["error"]["code"] == "invalid_json"


@pytest.mark.timeout(120)
def test_prompts_are_bounded_before_they_are_tokenized(base):
    """The tiny model's context is 4096 tokens: at 8 bytes per token at most 32 KiB of
    prompt is worth tokenizing. Tokenizing a 4 MB prompt here takes ~20 s and GBs."""
    m = base["model"].name
    huge = json.dumps({"model": m, "prompt": "hello world, " * 320_000}).encode()
    assert 4_000_000 < len(huge) < 4 * 1024 * 1024

    def post(gw, path, body: bytes):
        return httpx.post(gw.url + path, content=body, timeout=60,
                          headers={"content-type": "application/json"})

    with gateway(base) as (gw, _):
        me = psutil.Process()
        rss0, peak = me.memory_info().rss, [0]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results: list[httpx.Response] = []
        t0 = time.monotonic()
        posts = [threading.Thread(target=lambda: results.append(post(gw, "/v1/completions", huge)))
                 for _ in range(6)]
        for t in posts:
            t.start()
        for t in posts:
            t.join(60)
        elapsed = time.monotonic() - t0
        done.set()
        sampler.join(5)
        assert len(results) == 6
        for r in results:
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == (
                "prompt", "context_length_exceeded"), r.text
            assert "32768 bytes" in err["message"]
        assert elapsed < 15, elapsed  # tokenizing them: minutes
        assert peak[0] - rss0 < 600 * 1024 * 1024, (rss0, peak[0])  # tokenizing: GBs

        user = {"role": "user", "content": ""}
        tool = {"type": "function", "function": {"name": "f", "description": "d" * 10_000}}
        cases = [
            ({"model": m, "messages": [user] * 120_000}, "messages", "too_many_items"),
            ({"model": m, "messages": [user], "tools": [tool] * 390}, "tools", "too_many_items"),
            ({"model": m, "messages": [user], "tools": [tool] * 100}, "messages",
             "context_length_exceeded"),
            ({"model": m, "messages": [{"role": "user", "content": "y" * 40_000}]}, "messages",
             "context_length_exceeded"),
        ]
        for body, param, code in cases:
            r = post(gw, "/v1/chat/completions", json.dumps(body).encode())
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), r.text
        r = post(gw, "/v1/completions", json.dumps({"model": m, "prompt": [5] * 5000}).encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = post(gw, "/v1/completions", json.dumps({"model": m, "prompt": "x" * 20_000,
                                                    "max_tokens": 2}).encode())
        assert r.status_code in (200, 400), r.text  # under the byte bound: tokenized, then judged
        r = post(gw, "/v1/completions", json.dumps({"model": m, "prompt": "fine", "max_tokens": 2}).encode())
        assert r.status_code == 200, r.text


@pytest.mark.timeout(120)
def test_a_slow_chat_template_does_not_stall_the_event_loop(base, tmp_path):
    """A template that takes seconds (here: on purpose) renders in a worker thread: a
    /health sent during the render is answered during it, and a stream on the same
    gateway keeps flowing. On the loop, both would wait for the render to end."""
    slow = tmp_path / "slow"
    shutil.copytree(base["model"], slow)
    cfg = json.loads((slow / "tokenizer_config.json").read_text())
    jinja = slow / "chat_template.jinja"
    original = jinja.read_text() if jinja.exists() else cfg["chat_template"]
    jinja.unlink(missing_ok=True)
    cfg["chat_template"] = SLOW_TEMPLATE + original
    (slow / "tokenizer_config.json").write_text(json.dumps(cfg))
    rendered_at: list[float] = []

    def script(g):
        rendered_at.append(time.monotonic())  # the GENERATE arrives once the render is done
        return [5, 6]

    base["rank"].script = script
    with gateway(base, model_path=slow) as (gw, _):
        heavy: list[httpx.Response] = []
        t_send = time.monotonic()
        th = threading.Thread(target=lambda: heavy.append(httpx.post(
            gw.url + "/v1/chat/completions", timeout=60,
            json={"model": "slow", "messages": [{"role": "user", "content": "hi"}]})))
        th.start()
        health: list[tuple[float, float]] = []
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            while th.is_alive():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append((t0, time.monotonic()))
                time.sleep(0.01)
        th.join(60)
    assert heavy and heavy[0].status_code == 200, heavy
    assert rendered_at, "the heavy request never reached rank 0"
    render_end = rendered_at[0]
    assert render_end - t_send > 0.5, "the template was not slow: this test proves nothing"
    mid = t_send + (render_end - t_send) / 2
    during = [(a, b) for a, b in health if a > mid and b < render_end]
    assert during, f"no /health answered in the render's second half ({len(health)} sent)"


@pytest.mark.timeout(60)
def test_an_unexpected_error_is_one_line_a_500_and_the_connection_stays(base, caplog):
    def boom():
        raise TypeError("kaboom \ud800 with a lone surrogate and\na newline")

    caplog.set_level(logging.WARNING, logger="lockstep.gateway.errors")
    with gateway(base, routes=[("/test/boom", boom)]) as (gw, _):
        got = one_connection(gw.port, [("GET", "/test/boom", None)] * 30 + [("GET", "/health", None)])
    for status, body, _ in got[:30]:
        assert status == 500 and body["error"] == {
            "message": "internal error: TypeError", "type": "server_error", "param": None,
            "code": "internal"}
    assert got[30][0] == 200
    assert len({addr for *_, addr in got}) == 1 and got[0][2] is not None
    lines = [r for r in caplog.records if r.name == "lockstep.gateway.errors"]
    assert len(lines) == 10, [r.getMessage() for r in lines]  # the rest suppressed (counted)
    for r in lines:
        text = r.getMessage()
        assert "\n" not in text and r.exc_info is None
        assert "GET /test/boom: TypeError: kaboom \\ud800" in text and "test_gateway_abuse.py:" in text
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.ERROR]


@pytest.mark.timeout(60)
def test_admin_delete_authenticates_before_it_validates(base):
    with gateway(base) as (gw, _):
        url = gw.url + "/admin/api/cluster/deployments/x"
        r = httpx.delete(url + "?force=maybe", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", r.text
        hdr = {"authorization": f"Bearer {TOKEN}"}
        r = httpx.delete(url + "?force=maybe", timeout=10, headers=hdr)
        assert r.status_code == 400 and r.json()["error"]["param"] == "force", r.text
        r = httpx.delete(url + "?force=true", timeout=10, headers=hdr)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


@pytest.mark.timeout(60)
def test_ready_follows_a_deployment_that_failed_while_the_supervisor_is_busy(base):
    """The supervisor publishes `failed`, then stops answering (busy with that failure):
    /ready must not keep vouching for the deployment it last listed."""
    with gateway(base, admin_timeout_s=1.0, ready_view_max_age_s=120) as (gw, sup):
        sup.silent = {"status", "deployments"}
        sup.state = "failed"
        sup.publish("state", topic="deployment")
        r = poll_until(lambda: (x := httpx.get(gw.url + "/ready", timeout=5)).status_code == 503 and x,
                       5, "/ready to turn 503")
        assert r.json()["ready"] is False
        c = httpx.post(gw.url + "/v1/completions", timeout=10,
                       json={"model": base["model"].name, "prompt": "x"})
        assert c.status_code == 503 and c.json()["error"]["code"] == "model_not_ready", c.text
        assert "is failed" in c.json()["error"]["message"]
        sup.silent, sup.state = set(), "serving"  # it answers again: serving again
        poll_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, 10,
                   "/ready back to 200")


@pytest.mark.timeout(60)
def test_ready_is_503_when_the_supervisor_stops_answering(base):
    with gateway(base, admin_timeout_s=0.5, ready_view_max_age_s=2.0) as (gw, sup):
        silent_at = time.monotonic()
        sup.silent = {"status", "deployments"}
        r = poll_until(lambda: (x := httpx.get(gw.url + "/ready", timeout=5)).status_code == 503 and x,
                       10, "/ready to turn 503")
        assert time.monotonic() - silent_at >= 2.0 - 0.6  # not before the view is that old
        assert "last answer" in r.json()["reason"]
        sup.silent = set()
        poll_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, 10,
                   "/ready back to 200")


@pytest.mark.timeout(60)
def test_a_tokenizer_that_cannot_load_keeps_ready_false_and_says_why(base, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no tokenizer files at all
    sup = FakeSupervisor(base["key"], base["rank"], str(broken)).start()
    settings = GatewaySettings(home=base["home"], port=free_port(), admin_endpoint=sup.admin_endpoint,
                               events_endpoint=sup.events_endpoint, refresh_s=0.5)
    gw = GatewayThread(settings, base["key"]).start()
    try:
        def failed():
            r = httpx.get(gw.url + "/ready", timeout=5)
            deps = r.json()["deployments"]
            return r.status_code == 503 and deps and deps[0]["tokenizer"].startswith("failed: ") and r
        r = poll_until(failed, 30, "the tokenizer load to fail")
        assert "loaded tokenizer" in r.json()["reason"]
        c = httpx.post(gw.url + "/v1/completions", timeout=10, json={"model": "broken", "prompt": "x"})
        assert c.status_code == 503 and c.json()["error"]["code"] == "no_tokenizer", c.text
        assert c.headers["retry-after"]
    finally:
        gw.stop()
        sup.stop()
