"""The prefix cache's disk tier through `lockstep up` (TP=2, tiny preset), as a user
meets it: a conversation outlives a killed rank and a Ctrl-C, and `admin cache-clear`
empties both tiers.

- Rank 1 is SIGKILLed while turn 5 streams: the stream resumes on the redeployed
  deployment (issue 28), whose first request, the continuation, reads the earlier
  turns back from disk instead of prefilling them; the resumed text equals the same
  turn asked again afterwards.
- `up` stopped with Ctrl-C and started again on the same home serves turn 9 with
  cached_tokens covering turns 1-8, read from disk, and the text and every logprob a
  cold run gives (the same turn once `cache-clear` emptied both tiers; determinism).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.gwutil import poll_until, sse_lines
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)
# rank 0 sleeps 20 ms a step (test seam): turn 5 is surely mid-stream at the kill
OPTIONS = UpOptions(tp=2, restarts=2, extra=("--prompt-cache-disk-bytes", str(256 << 20)),
                    env={"LOCKSTEP_PEER_ABORT_GRACE": "1", "LOCKSTEP_RANK_TEST_SEAMS": "true",
                         "LOCKSTEP_TEST_STEP_DELAY_S": "0.02"})


def serving(up: UpCluster) -> dict | None:
    return next((d for d in up.deployments() if d["state"] == "serving"), None)


def chat(up: UpCluster, messages: list[dict], **kw) -> tuple[str, int, int]:
    text, prompt_tokens, cached, _ = chat_logprobs(up, messages, **kw)
    return text, prompt_tokens, cached


def chat_logprobs(up: UpCluster, messages: list[dict], **kw) -> tuple[str, int, int, list]:
    """The reply's text, prompt and cached tokens, and every token's logprob and top
    logprobs (compared exactly: determinism)."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8,
            "logprobs": True, "top_logprobs": 2, **kw}
    r = httpx.post(up.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    cached = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    lps = [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
           for t in j["choices"][0]["logprobs"]["content"]]
    return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens"], cached, lps


def rank0_cache(up: UpCluster) -> dict:
    dep = serving(up)
    return dep and next(r for r in dep["ranks"] if r["rank"] == 0)["cache"]


def turn(i: int) -> dict:
    return {"role": "user", "content": f"turn {i}: " + " ".join(
        ["harbor", "lantern", "meadow", "quartz", "saffron", "timber"][(i + k) % 6]
        for k in range(30))}


MAX5 = 48
NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: turn 5 runs to MAX5


def stream_killing(up: UpCluster, messages: list[dict], victim: int) -> str:
    """Turn 5, streamed; rank `victim` SIGKILLed once 5 chunks arrived. Its text."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": MAX5,
            "logit_bias": NO_EOS, "stream": True}
    text, chunks, finish = [], 0, None
    with httpx.stream("POST", up.url + "/v1/chat/completions", json=body,
                      timeout=httpx.Timeout(180, read=180)) as r:
        assert r.status_code == 200
        for kind, data in sse_lines(r):
            if kind != "data" or data == "[DONE]":
                continue
            assert "error" not in data, data
            ch = data["choices"][0]
            text.append(ch["delta"].get("content") or "")
            finish = ch.get("finish_reason") or finish
            chunks += 1
            if chunks == 5:
                os.kill(victim, signal.SIGKILL)
    assert chunks > 5 and finish == "length", (chunks, finish)
    return "".join(text)


def test_a_conversation_outlives_a_killed_rank_and_a_restart(tmp_path):
    home = tmp_path / "home"
    msgs: list[dict] = []
    prompts: list[int] = []

    def say(up: UpCluster, i: int) -> int:
        msgs.append(turn(i))
        text, prompt_tokens, cached = chat(up, msgs)
        msgs.append({"role": "assistant", "content": text})
        prompts.append(prompt_tokens)
        return cached

    with up_cluster(tmp_path / "first", OPTIONS, home=home) as up:
        for i in range(4):
            say(up, i)
        dep = serving(up)
        victim = next(r for r in dep["ranks"] if r["rank"] == 1)["pid"]
        up.pids.add(victim)
        msgs.append(turn(4))
        resumed = stream_killing(up, msgs, victim)
        d2 = serving(up)
        assert d2 is not None and d2["job_id"] != dep["job_id"]
        resumes = httpx.get(up.url + "/admin/api/cluster/status", headers=up.hdr,
                            timeout=10).json()["gateway"]["recent_resumes"]
        assert len(resumes) == 1, resumes
        # the continuation was the redeployed ranks' first request: the history it
        # started from came from disk (rank 0 loaded it), not a prefill
        poll_until(lambda: (rank0_cache(up) or {}).get("disk_hits", 0) >= 1, 10,
                   "rank 0's telemetry counting the disk hit")
        again, p5, cached5 = chat(up, msgs, max_tokens=MAX5, logit_bias=NO_EOS)
        assert again == resumed and cached5 >= prompts[3]
        msgs.append({"role": "assistant", "content": again})
        prompts.append(p5)
        # /metrics and admin status show the tiers apart
        metrics = httpx.get(up.url + "/metrics", timeout=10).text
        hits = [float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                if ln.startswith("lockstep_rank_prefix_cache_disk_hits_total{")
                and 'rank="0"' in ln]
        assert hits and hits[0] >= 1, metrics[-2000:]
        assert any(ln.startswith("lockstep_rank_prefix_cache_disk_bytes{")
                   for ln in metrics.splitlines())
        status = subprocess.run(
            [sys.executable, "-m", "services", "admin", "--home", str(home), "status"],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert "; disk " in status.stdout, status.stdout + status.stderr
        for i in range(5, 8):
            say(up, i)
    assert len(list((home / "kvcache").glob("*/*-rank1/*.safetensors"))) >= 1

    with up_cluster(tmp_path / "second", OPTIONS, home=home) as up:
        msgs.append(turn(8))
        text9, p9, cached9, lp9 = chat_logprobs(up, msgs, max_tokens=24, logit_bias=NO_EOS)
        assert cached9 >= prompts[7]  # the 8 turns before it, read back from disk
        dep = serving(up)
        r = httpx.post(up.url + f"/admin/api/cluster/deployments/{dep['deployment_id']}"
                       "/cache-clear", headers=up.hdr, timeout=30)
        assert r.status_code == 200, r.text
        poll_until(lambda: not list((home / "kvcache").glob("*/*/*.safetensors")), 10,
                   "both tiers empty, on every rank's disk")
        cold, p9_cold, cached_cold, lp_cold = chat_logprobs(up, msgs, max_tokens=24,
                                                            logit_bias=NO_EOS)
        # from disk or cold: the same text and the same logprobs, bit for bit
        assert (cold, p9_cold, cached_cold) == (text9, p9, 0)
        assert lp_cold == lp9 and len(lp9) == 24
