"""Resume beyond chat streams (issue 28, item 4), on one `lockstep up --model tiny --tp 2`
(real supervisor, reaper, gateway and MLX ranks) and real signals:

- one follower SIGKILLed while four requests of other kinds are mid-flight — a
  non-streamed chat completion, a streamed greedy chat with logprobs (top_logprobs 2), an
  Anthropic /v1/messages stream (the `anthropic` client's `messages.stream`) and an OpenAI
  /v1/responses stream (the `openai` client's streamed
  `responses.create`): each is resumed once
  by the gateway's own count (so each was in flight when the fault came: a request that had
  finished would not resume) and ends exactly as an unfaulted run of the same four on the
  same cluster: text, finish/stop reason, usage, and one logprobs entry per token with the
  same tokens;
- an abort-all while requests wait to resume (a follower SIGKILLed; the gateway shows them
  resuming and no redeploy serves yet) ends them as "abort", not resumed, and leaves
  nothing active on the gateway nor on any rank of the redeployed deployment.

Every request is greedy and long by construction (chat: EOS biased away; messages and
responses have no logit_bias, and the tiny preset's greedy answer to MSG runs past
max_tokens: the reference run proves it by its stop reason).
"""

from __future__ import annotations

import math
import re
import signal
import threading

import anthropic
import httpx
import openai
import pytest

from tests.gwutil import GaveUp, poll_until, sse_lines
from tests.support.processes import process_gone
from tests.support.resume_live import MSG, NO_EOS, fault, resume_options, resumes, serving
from tests.support.up_cluster import UpCluster, up_fixture

MAX = 160  # tokens per request: far past where the fault lands, short enough to be cheap
CHAT = {"model": "tiny", "messages": MSG, "temperature": 0, "max_tokens": MAX,
        "logit_bias": NO_EOS}
KINDS = ("chat", "logprobs", "messages", "responses")
LP_TOL = 1e-3  # a resumed token's logprob comes from a prefill, not a decode step


cluster = up_fixture(resume_options(tp=2))


def _status(c: UpCluster) -> dict:
    return httpx.get(c.url + "/admin/api/cluster/status", headers=c.hdr,
                     timeout=10).json()["gateway"]


def _gave_up(c: UpCluster) -> float:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r"^lockstep_gateway_resume_gave_up_total\{[^}]*\} (\S+)$", text, re.M))


# --- the four requests; each returns what its client saw and bumps `seen[kind]` per delta


def _chat(c: UpCluster, seen: dict) -> dict:
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=240)
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    return {"text": ch["message"]["content"], "finish": ch["finish_reason"],
            "usage": {k: body["usage"][k] for k in
                      ("prompt_tokens", "completion_tokens", "total_tokens")},
            "where": (r.headers["x-lockstep-deployment"], r.headers["x-lockstep-resumed"])}


def _logprobs(c: UpCluster, seen: dict) -> dict:
    body = {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}}
    text, lps, finish, usage = [], [], None, None
    with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=240) as r:
        assert r.status_code == 200, r.read()
        for what, data in sse_lines(r):
            if what != "data" or data == "[DONE]":
                continue
            assert "error" not in data, data
            usage = data.get("usage") or usage
            for ch in data["choices"]:
                text.append(ch["delta"].get("content") or "")
                lps += (ch.get("logprobs") or {}).get("content") or []
                finish = ch.get("finish_reason") or finish
                seen["logprobs"] = len(lps)
    return {"text": "".join(text), "finish": finish, "logprobs": lps,
            "completion_tokens": usage["completion_tokens"]}


def _messages(c: UpCluster, seen: dict) -> dict:
    client = anthropic.Anthropic(base_url=c.url, api_key="none", max_retries=0, timeout=240)
    with client.messages.stream(model="tiny", messages=MSG, max_tokens=MAX,
                                extra_body={"temperature": 0}) as s:
        for _ in s.text_stream:
            seen["messages"] = seen.get("messages", 0) + 1
        m = s.get_final_message()
    return {"text": "".join(b.text for b in m.content if b.type == "text"),
            "finish": m.stop_reason, "tokens": m.usage.output_tokens}


def _responses(c: UpCluster, seen: dict) -> dict:
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0,
                           timeout=240)
    # create(stream=True), not responses.stream: that helper wants response.completed,
    # and a response cut at max_output_tokens ends with response.incomplete (as OpenAI's)
    r = None
    for ev in client.responses.create(model="tiny", input=MSG[0]["content"], stream=True,
                                      max_output_tokens=MAX, temperature=0):
        if ev.type == "response.output_text.delta":
            seen["responses"] = seen.get("responses", 0) + 1
        assert ev.type not in ("response.failed", "error"), ev
        if ev.type in ("response.completed", "response.incomplete"):
            r = ev.response
    assert r is not None, "the stream ended without its final event"
    return {"text": r.output_text, "finish": (r.status, r.incomplete_details.reason
                                              if r.incomplete_details else None),
            "tokens": r.usage.output_tokens}


RUN = {"chat": _chat, "logprobs": _logprobs, "messages": _messages, "responses": _responses}


def _run_four(c: UpCluster, inject=None) -> dict:
    """The four at once; `inject()` once every stream streamed and all four are admitted."""
    got: dict = {}
    seen: dict = {}

    def one(kind: str) -> None:
        try:
            got[kind] = RUN[kind](c, seen)
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            got[kind] = {"error": repr(exc)}

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in KINDS]
    for t in threads:
        t.start()
    if inject is not None:
        def all_in_flight() -> bool:
            if got:
                raise GaveUp(f"finished before the fault: {got}")
            streams = [seen.get(k, 0) for k in ("logprobs", "messages", "responses")]
            return min(streams) >= 3 and _status(c)["active"] == len(KINDS)
        poll_until(all_in_flight, 60, "every request in flight, every stream streaming")
        inject()
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a request never ended"
    for kind, res in got.items():
        assert "error" not in res, (kind, res)
    return got


@pytest.fixture(scope="module")
def four(cluster):
    """The four unfaulted, then the four again with a follower SIGKILLed mid-flight."""
    reference = _run_four(cluster)
    # long by construction: every one ran to its token limit
    assert reference["chat"]["finish"] == "length", reference["chat"]
    assert reference["logprobs"]["finish"] == "length"
    assert reference["messages"]["finish"] == "max_tokens", reference["messages"]
    assert reference["responses"]["finish"] == ("incomplete", "max_output_tokens")
    before, pids = resumes(cluster), []
    got = _run_four(cluster, lambda: pids.extend(fault(cluster, 1, signal.SIGKILL).pids))
    # each of the four resumed exactly once: each was in flight when the follower died
    assert resumes(cluster) - before == len(KINDS)
    poll_until(lambda: all(process_gone(p) for p in pids), 60, "the dead launch's ranks gone")
    return reference, got


@pytest.mark.timeout(300)
def test_a_non_streamed_chat_returns_as_if_unfaulted(four):
    reference, got = four
    (ref_dep, ref_n), (dep, n) = reference["chat"]["where"], got["chat"]["where"]
    body = lambda d: {k: v for k, v in d.items() if k != "where"}  # noqa: E731
    assert body(got["chat"]) == body(reference["chat"])  # content, finish_reason, usage
    assert got["chat"]["usage"]["completion_tokens"] == MAX
    # the headers name the deployment that finished it, and that it resumed once
    assert (ref_n, n) == ("0", "1") and dep != ref_dep


@pytest.mark.timeout(300)
def test_logprobs_go_on_across_the_resume(four):
    reference, got = four
    ref, res = reference["logprobs"], got["logprobs"]
    assert res["text"] == ref["text"] and res["finish"] == ref["finish"] == "length"
    assert len(res["logprobs"]) == len(ref["logprobs"]) == res["completion_tokens"] == MAX
    for i, (a, b) in enumerate(zip(res["logprobs"], ref["logprobs"], strict=True)):
        assert a["token"] == b["token"], (i, a, b)
        assert math.isclose(a["logprob"], b["logprob"], abs_tol=LP_TOL), (i, a, b)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert math.isclose(x["logprob"], y["logprob"], abs_tol=LP_TOL), (i, a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["messages", "responses"])
def test_messages_and_responses_streams_resume(four, kind):
    reference, got = four
    assert got[kind] == reference[kind]  # final text, stop reason, output tokens
    assert got[kind]["tokens"] == MAX


@pytest.mark.timeout(300)
def test_abort_all_ends_requests_waiting_to_resume(cluster):
    c = cluster
    before, gave_up = resumes(c), _gave_up(c)
    body = {**CHAT, "max_tokens": 400, "stream": True}
    got: dict = {}
    seen: dict = {}

    def stream(i: int) -> None:
        finish, n = None, 0
        try:
            with httpx.stream("POST", c.url + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                for what, data in sse_lines(r):
                    if what != "data" or data == "[DONE]":
                        continue
                    assert "error" not in data, data
                    for ch in data["choices"]:
                        n += 1
                        seen[i] = n
                        finish = ch.get("finish_reason") or finish
            got[i] = {"finish": finish, "chunks": n}
        except Exception as exc:  # noqa: BLE001 - reported below
            got[i] = {"error": repr(exc)}

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    def streaming() -> bool:
        if got:
            raise GaveUp(f"a stream ended before the fault: {got}")
        return len(seen) == 2 and min(seen.values()) >= 3
    poll_until(streaming, 60, "both streams streaming")
    pids = fault(c, 1, signal.SIGKILL).pids
    # proven waiting: the gateway holds both as resuming, and no redeploy serves yet
    poll_until(lambda: _status(c)["resuming"] == 2, 30, "both streams waiting to resume")
    deps = httpx.get(c.url + "/admin/api/cluster/deployments", headers=c.hdr,
                     timeout=10).json()["deployments"]
    assert not [d for d in deps if d["state"] == "serving"
                and any(r["pid"] not in pids for r in d["ranks"])], deps
    # the dead follower never acks: it counts as zero because it is observed gone, and
    # rank 0 acks the abort (or leaves on its peer's loss): zero active, on evidence
    r = httpx.post(c.url + "/admin/api/cluster/abort-all", headers=c.hdr,
                   json={"timeout_s": 30}, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["gateway_active"] == 0 and reply["zero_active"] is True, reply
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream never ended"
    assert got == {0: {"finish": "abort", "chunks": got[0]["chunks"]},
                   1: {"finish": "abort", "chunks": got[1]["chunks"]}}, got
    assert resumes(c) == before and _gave_up(c) == gave_up  # cancelled, not resumed
    assert _status(c)["resuming"] == 0
    # the redeploy serves; nothing runs there, nor on the gateway
    poll_until(lambda: all(process_gone(p) for p in pids), 60, "the dead launch's ranks gone")
    new = poll_until(lambda: (lambda d: d if all(x["pid"] not in pids for x in d["ranks"])
                              else None)(serving(c)), 120, "the redeploy serving")
    poll_until(lambda: all(x["active"] == 0 for x in serving(c)["ranks"])
               and _status(c)["active"] == 0, 20, "zero active everywhere")
    assert len(new["ranks"]) == 2
    assert resumes(c) == before
