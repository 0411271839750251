"""`lockstep up` keeps serving after a rank dies: the failed deployment is torn down with
proof and redeployed; Ctrl-C afterwards still stops everything (real supervisor, reaper,
gateway and TP=2 MLX ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from common.procs import snapshot_children
from tests.gwutil import free_port, poll_until
from tests.support.processes import process_gone, up_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_up_redeploys_after_a_rank_dies_then_stops_cleanly(tmp_path):
    port = free_port()
    out = tmp_path / "up.out"
    cmd = up_argv(tmp_path / "home", port, "--restarts", "1")
    with open(out, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    text = lambda: out.read_text(errors="replace")  # noqa: E731
    try:
        poll_until(lambda: text().count("Press Ctrl-C") == 1, 240, "the first banner", 0.5)
        token = (tmp_path / "home" / "admin.token").read_text().strip()
        hdr = {"authorization": f"Bearer {token}"}
        deps = httpx.get(url + "/admin/api/cluster/deployments", headers=hdr,
                         timeout=10).json()["deployments"]
        first = next(d for d in deps if d["state"] == "serving")
        pids = [r["pid"] for r in first["ranks"]]
        os.kill(pids[1], signal.SIGKILL)

        poll_until(lambda: text().count("Press Ctrl-C") == 2, 240, "the redeploy's banner", 0.5)
        assert "redeploying (0 restart(s) left)" in text()
        poll_until(lambda: all(process_gone(p) for p in pids), 30,
                   "the failed launch's ranks to be gone")
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": first["model"], "prompt": "a", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        deps = httpx.get(url + "/admin/api/cluster/deployments", headers=hdr,
                         timeout=10).json()["deployments"]
        assert [d["deployment_id"] for d in deps if d["state"] == "serving"] != [
            first["deployment_id"]]

        tree = snapshot_children(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, text()[-3000:]
        poll_until(lambda: all(process_gone(i.pid) for i in tree), 15,
                   "every process of lockstep up")
        assert "every process stopped" in text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
