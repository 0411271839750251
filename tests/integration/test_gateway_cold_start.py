"""A fresh gateway process (`python -m services.gateway`) on a fake supervisor and rank 0:
concurrent first requests right after /ready all succeed, because the tokenizer was
loaded (once, in one thread) before /ready could be true; and 100 hostile requests leave
the gateway's log as it was (they are 400s, not tracebacks)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import free_port, poll_until
from tests.support.processes import REPO, lockstep_env, process_gone


@pytest.mark.timeout(120)
def test_a_burst_right_after_ready_is_served_by_a_fresh_gateway(tmp_path):
    home = tmp_path / "home"
    key = ensure_cluster_key(home / "keys" / "cluster.key")
    model = build_model(tmp_path / "models" / "tiny", preset="tiny")
    rank = FakeRank0(key).start()
    sup = FakeSupervisor(key, rank, str(model)).start()  # canary fresh: only the tokenizer gates
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "gateway.log"
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--home", str(home), "--port", str(port),
         "--admin-endpoint", sup.admin_endpoint, "--events-endpoint", sup.events_endpoint],
        cwd=REPO, env=lockstep_env(home), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        def ready():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            return httpx.get(url + "/ready", timeout=5)
        r = poll_until(lambda: (x := ready()).status_code == 200 and x, 60, "/ready", 0.02)
        assert [d["tokenizer"] for d in r.json()["deployments"]] == ["loaded"]

        m = model.name
        bodies = [("/v1/chat/completions" if i % 2 else "/v1/completions",
                   {"model": m, "max_tokens": 3, **({"messages": [{"role": "user", "content": f"hi {i}"}]}
                                                    if i % 2 else {"prompt": f"hello {i}"})})
                  for i in range(8)]
        go = threading.Barrier(8)
        results: dict[int, httpx.Response] = {}

        def one(i: int) -> None:
            go.wait(10)
            path, body = bodies[i]
            results[i] = httpx.post(url + path, json=body, timeout=30)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert sorted(results) == list(range(8))
        for i, resp in results.items():
            assert resp.status_code == 200, (i, resp.text)
            assert resp.json()["usage"]["completion_tokens"] >= 1

        size = log_path.stat().st_size
        bad = json.dumps({"model": m, "prompt": "a\udfff"}).encode()
        with httpx.Client(timeout=10) as c:
            for _ in range(100):
                resp = c.post(url + "/v1/completions", content=bad,
                              headers={"content-type": "application/json"})
                assert resp.status_code == 400, resp.text
        assert log_path.stat().st_size - size < 1024, log_path.read_text()[size:][:3000]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        sup.stop()
        rank.stop()
    assert process_gone(proc.pid)
