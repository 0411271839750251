"""Admission through a redeploy (issue 43 item 6), live: `lockstep up` (TP=2 tiny,
`--restarts 1`), a rank SIGKILLed, and 8 requests (6 completions, 2 streamed chats) sent
as soon as the gateway says nothing serves, while the only deployment is being redeployed
(`up` promised to redeploy it: runtime/redeploy.json). With the gateway's default
`admit_wait` they all wait and complete with 200; with `LOCKSTEP_ADMIT_WAIT=0` they all
get 503 at once, as before.
Then a second kill spends the redeploy rate: nothing is coming back, the record is gone,
and a new request gets 503 at once (not after a wait). Evidence from outside: HTTP
answers, the home's record, `up`'s output, psutil."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import httpx
import psutil
import pytest

from common.home import Paths
from tests.gwutil import poll_until
from tests.support.up_cluster import UpOptions, up_cluster

READY_S = 240.0


def rank_pids(home) -> list[int]:
    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if "services.rank" in " ".join(p.info["cmdline"] or [])
                  and str(home) in " ".join(p.info["cmdline"] or []))


def ask(url: str, i: int) -> tuple[int, str]:
    """(status, text or error code) of one request: completions, or a streamed chat."""
    if i % 4 == 3:
        body = {"model": "tiny", "stream": True, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"hello {i}"}]}
        text = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(r.read())["error"]["code"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    assert "error" not in d, d
                    text += [c["delta"].get("content") or "" for c in d["choices"]]
        return 200, "".join(text)
    r = httpx.post(url + "/v1/completions", timeout=180, json={
        "model": "tiny", "prompt": f"hello {i}", "max_tokens": 8, "temperature": 0})
    if r.status_code != 200:
        return r.status_code, r.json()["error"]["code"]
    return 200, r.json()["choices"][0]["text"]


@pytest.mark.parametrize("admit_wait", ["default", "0"])
def test_requests_sent_during_a_redeploy_wait_for_it(tmp_path, admit_wait):
    env = {} if admit_wait == "default" else {"LOCKSTEP_ADMIT_WAIT": admit_wait}
    with up_cluster(tmp_path, UpOptions(tp=2, restarts=1, env=env, ready_s=READY_S)) as c:
        url, out, record = c.url, c.out, Paths(c.home).redeploy_file
        first = rank_pids(c.home)
        c.pids |= set(first)
        assert record.exists()  # from the first serving on: a failure is redeployed
        os.kill(first[-1], signal.SIGKILL)
        poll_until(lambda: httpx.get(url + "/ready", timeout=10).status_code == 503, 60,
                   "the gateway to see the failure", interval=0.02)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(url, i), range(8)))
        if admit_wait == "0":  # today's behaviour: refused at once
            assert [s for s, _ in got] == [503] * 8, got
            assert {code for _, code in got} == {"model_not_ready"}, got
            return
        assert [s for s, _ in got] == [200] * 8, got
        assert all(text for _, text in got), got
        second = rank_pids(c.home)
        c.pids |= set(second)
        assert len(second) == 2 and not set(second) & set(first)  # served by the redeploy
        assert record.exists()  # the promise stands

        # the rate spent: nothing comes back, a request is refused at once
        os.kill(second[-1], signal.SIGKILL)
        poll_until(lambda: "restarts exhausted" in out.read_text(), 120, "up to give up")
        assert not record.exists()
        status, code = ask(url, 0)
        assert (status, code) == (503, "model_not_ready")
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert "admit_wait" not in r.json()["error"]["message"]  # not the end of a wait
        assert c.proc.poll() is None
