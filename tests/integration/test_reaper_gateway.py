"""`POST /admin/api/cluster/reap` on the real gateway triggers a reap pass in the real
supervisor: an orphaned launch (a SIGKILLed fake supervisor with real rank processes)
is reaped, and an unreadable manifest comes back as blocking, naming the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common.home import Paths, manifest_path
from common.keys import generate_key_file
from tests.fakes.fake_launcher import ROOT, FakeSupervisor
from tests.fakes.procwatch import free_port, poll_for, process_gone
from tests.support.processes import lockstep_env
from tests.support.supervisor import PORTS_0_ENV, runtime_names

TOKEN = "reaper-test-token"


@pytest.mark.timeout(120)
def test_gateway_admin_reap(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "home").ensure()
    generate_key_file(paths.cluster_key)
    runtime = paths.runtime / "supervisor.json"
    procs: list[subprocess.Popen] = []
    fake = None
    try:
        with open(tmp_path / "supervisor.log", "wb") as out:
            sup = subprocess.Popen(
                [sys.executable, "-m", "services.supervisor", "--log-level", "WARNING"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env=lockstep_env(paths.home, **PORTS_0_ENV, LOCKSTEP_STOP_TIMEOUT="2",
                                 LOCKSTEP_KILL_TIMEOUT="2"))
        procs.append(sup)
        poll_for("supervisor.json", lambda: runtime_names(runtime, sup), 30)
        port = free_port()
        with open(tmp_path / "gateway.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.gateway", "--port", str(port)], cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT,
                env=lockstep_env(paths.home, LOCKSTEP_ADMIN_TOKEN=TOKEN)))
        base = f"http://127.0.0.1:{port}"

        def health() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        poll_for("gateway /health", health, 30, interval=0.1)

        fake = FakeSupervisor.start(paths.home, "orphan-1", "dep-orphan", 2)
        fake.kill()
        url = f"{base}/admin/api/cluster/reap"
        assert httpx.post(url, timeout=30).status_code == 401  # bearer token required
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(url, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reaped"] == ["orphan-1"] and body["blocking"] is False, body
        assert all(process_gone(x["pid"], x["start_time"]) for x in fake.ranks)
        assert not manifest_path(paths, "orphan-1").exists()

        bad = paths.manifests / "broken.json"
        bad.write_text("{")
        body = httpx.post(url, headers=auth, timeout=60).json()
        assert body["blocking"] is True and body["unreadable"][0]["path"] == str(bad), body
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if fake is not None:
            for x in fake.ranks:
                if not process_gone(x["pid"], x["start_time"]):
                    os.kill(x["pid"], 9)
