"""`lockstep up`'s redeploy budget is a rate (issue 44 item 5), with real ranks:
`up --tp 1 --restarts 1 --restart-window 40` (tiny preset).

- Rank 0 SIGKILLed: redeployed. Killed again as soon as that redeploy serves: two
  failures inside the window is past the rate. `up` keeps running with the gateway,
  supervisor and reaper; `/ready` is 503 and a request gets 503 `model_not_ready` naming
  the failed deployment; `up` says why. No redeploy comes on its own, even past the window.
- The operator deploys the model again through the admin API: it serves, `up` takes it
  over. Killed more than a window after the last redeploy: redeployed (a lifetime count
  of 1 would have refused here), and Ctrl-C still stops everything (exit 0).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.gwutil import poll_until
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster

# The second kill must fall inside the window that began when the first redeploy did,
# so the window must outlast a whole redeploy (load + canary) on a loaded machine: at
# 5 s it did not (~8 s under load), and at 15 s a fresh-clone CI run's did not either
# (the kill after the redeploy serving was redeployed, not refused). The spacing past the
# window is the wait the test makes anyway (no redeploy on its own), so a wide one is cheap.
WINDOW_S = 40.0


def _serving(c: UpCluster, other_than: str | None = None) -> dict | None:
    return next((d for d in c.deployments() if d["state"] == "serving"
                 and d["deployment_id"] != other_than), None)


def _kill_rank0(c: UpCluster, dep: dict) -> None:
    pid = next(r["pid"] for r in dep["ranks"] if r["rank"] == 0)
    c.pids.add(pid)
    os.kill(pid, signal.SIGKILL)


def _chat(c: UpCluster) -> httpx.Response:
    return httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]})


@pytest.mark.timeout(420)
def test_redeploys_are_a_rate_and_past_it_up_waits_for_the_operator(tmp_path):
    opts = UpOptions(tp=1, restarts=1, extra=("--restart-window", str(WINDOW_S),
                                              "--restart-backoff", "0.5"),
                     env={"LOCKSTEP_PEER_ABORT_GRACE": "1"}, gone_s=30)
    with up_cluster(tmp_path, opts) as c:
        proc, text = c.proc, c.text
        first = _serving(c)
        # 1: a failure, redeployed
        _kill_rank0(c, first)
        second = poll_until(lambda: _serving(c, first["deployment_id"]), 120,
                            "the first redeploy serving")
        assert "redeploying (1 of 1 within 40s)" in text(), text()[-3000:]
        # 2: at once again: two inside the window, past the rate of one
        _kill_rank0(c, second)
        poll_until(lambda: "restarts exhausted" in text(), 60, "up saying restarts exhausted")
        assert proc.poll() is None, text()[-3000:]
        r = httpx.get(c.url + "/ready", timeout=10)
        assert r.status_code == 503, r.text
        r = _chat(c)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_ready" and second["deployment_id"] in err["message"] \
            and "failed" in err["message"], err
        assert _serving(c) is None
        time.sleep(WINDOW_S + 1)  # no redeploy comes on its own, even after the window
        assert _serving(c) is None and proc.poll() is None
        # 3: the operator deploys it again: served, and up watches it
        r = httpx.post(c.url + "/admin/api/cluster/deployments", headers=c.hdr,
                       json={"model_path": first["model_path"], "tp": 1, "pp": 1},
                       timeout=60)
        assert r.status_code in (200, 202), r.text
        fourth = poll_until(lambda: _serving(c), 120, "the operator's deployment serving")
        poll_until(lambda: f"serving again as {fourth['deployment_id']}" in text(), 30,
                   "up taking the new deployment over")
        poll_until(lambda: httpx.get(c.url + "/ready", timeout=10).status_code == 200, 60,
                   "/ready again")
        assert _chat(c).status_code == 200
        # 4: more than a window after the last redeploy: within the rate, redeployed
        _kill_rank0(c, fourth)
        fifth = poll_until(lambda: _serving(c, fourth["deployment_id"]), 120,
                           "the redeploy a window later serving")
        assert text().count("redeploying (1 of 1 within 40s)") == 2, text()[-3000:]
        poll_until(lambda: httpx.get(c.url + "/ready", timeout=10).status_code == 200, 60,
                   "/ready after the last redeploy")
        assert _chat(c).status_code == 200 and proc.poll() is None
        c.pids |= {r["pid"] for r in fifth["ranks"]}
        # leaving: Ctrl-C, exit 0, every process of up and every rank gone (the helper)
