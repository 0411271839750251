"""Kill the real supervisor (`lockstep supervisor`) while a TP=2 deployment of real MLX
ranks serves; the reaper must leave nothing behind, and a new supervisor must deploy
cleanly. Every process here is real: supervisor, ranks (ring backend over loopback),
`lockstep reaper`, `lockstep admin`. Evidence: psutil and the files on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.atomic_json import read_json
from common.home import Paths, manifest_path, marker_dir
from common.keys import generate_key_file, load_cluster_key
from common.records import LaunchManifest
from tests.fakes.procwatch import poll_file, poll_for, process_gone
from tests.support.fake_model import fake_model_dir
from tests.support.processes import lockstep_env, reaper_once
from tests.support.requests import RequestsClient
from tests.support.supervisor import FAKE_RANK, PORTS_0_ENV, runtime_names

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from models.tinymodel import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny")


class Cluster:
    """Supervisors, reapers and every rank pid a test saw, cleaned up whatever happens."""

    def __init__(self, home: Path, logs: Path) -> None:
        self.home, self.logs, self.paths = home, logs, Paths(home)
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[tuple[int, float]] = []
        generate_key_file(self.paths.cluster_key)

    def _spawn(self, name: str, argv: list[str], **env: str) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}-{len(self.procs)}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO,
                                 env=lockstep_env(self.home, **env), stdout=out,
                                 stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p, log

    def supervisor(self, **env: str) -> subprocess.Popen:
        runtime = self.paths.runtime / "supervisor.json"
        runtime.unlink(missing_ok=True)
        settings = dict(PORTS_0_ENV, LOCKSTEP_LOAD_TIMEOUT="150", LOCKSTEP_STOP_TIMEOUT="5",
                        LOCKSTEP_KILL_TIMEOUT="3", LOCKSTEP_CANARY_WINDOW_S="0.5")
        p, log = self._spawn("supervisor", ["services.supervisor"], **{**settings, **env})
        poll_for("runtime/supervisor.json of the new supervisor",
                 lambda: runtime_names(runtime, p) or p.poll() is not None, 30)
        assert p.poll() is None, log.read_text()[-3000:]
        return p

    def reaper(self, *args: str) -> tuple[subprocess.Popen, Path]:
        return self._spawn("reaper", ["services.reaper", "--home", str(self.home), *args])

    def admin(self, *args: str, timeout: float = 240) -> dict:
        out = subprocess.run([sys.executable, "-m", "services", "admin", "--home",
                              str(self.home), "--json", *args], cwd=REPO,
                             env=lockstep_env(self.home),
                             capture_output=True, text=True, timeout=timeout)
        assert out.stdout, out.stderr
        return json.loads(out.stdout)

    def deploy_tp2(self, model: Path, dep_id: str,
                   info: bool = True) -> tuple[dict | None, LaunchManifest]:
        """Deploy through the CLI; its manifest, and (with `info`) its DeploymentInfo."""
        reply = self.admin("deploy", "--model", str(model), "--tp", "2", "--id", dep_id)
        assert reply["ok"] and reply["data"]["state"] == "serving", reply
        m = LaunchManifest.from_dict(read_json(manifest_path(self.paths, reply["data"]["job_id"])))
        assert len(m.ranks) == 2 and not any(r.remote for r in m.ranks)
        self.ranks += [(r.pid, r.start_time) for r in m.ranks]
        if not info:
            return None, m
        return next(d for d in self.admin("deployments")["data"]["deployments"]
                    if d["deployment_id"] == dep_id), m

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for pid, start in self.ranks:
            if not process_gone(pid, start):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path / "home", tmp_path)
    yield c
    c.close()


def _serving_request(c: Cluster, info: dict) -> RequestsClient:
    """A long greedy generation in flight through rank 0, so the kill lands mid-serve."""
    client = RequestsClient(info, load_cluster_key(c.paths.cluster_key))
    rid = client.generate([1, 2, 3, 4, 5], 2000)
    poll_for("tokens streaming from rank 0", lambda: (client.pump(), client.streams[rid])[1], 60)
    return client


def _assert_reaped(c: Cluster, m: LaunchManifest) -> None:
    left = [(r.rank, r.pid) for r in m.ranks if not process_gone(r.pid, r.start_time)]
    assert left == [], f"rank processes left: {left}"
    assert not manifest_path(c.paths, m.job_id).exists()
    assert not Path(m.secret_path).exists()
    assert not marker_dir(c.paths, m.deployment_id).exists()


def _redeploy_cleanly(c: Cluster, model: Path, dep_id: str) -> None:
    sup = c.supervisor()
    info, m = c.deploy_tp2(model, dep_id)
    client = RequestsClient(info, load_cluster_key(c.paths.cluster_key))
    try:
        rid = client.generate([1, 2, 3], 4)
        assert client.wait_finished([rid], 60) == {rid: "length"}
    finally:
        client.close()
    stop = c.admin("stop", dep_id)
    assert stop["ok"] and stop["data"]["outcome"]["proven"], stop
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 0
    _assert_reaped(c, m)


@pytest.mark.timeout(420)
def test_sigkill_supervisor_tp2_then_reaper_once(cluster: Cluster, model: Path) -> None:
    """Real supervisor + TP=2 real ranks; SIGKILL the supervisor mid-request. The ranks are
    frozen (SIGSTOP) first so that they cannot exit on their own watchdog: the reaper has
    to do the killing (SIGTERM is held while stopped, SIGKILL is not)."""
    sup = cluster.supervisor()
    info, m = cluster.deploy_tp2(model, "tp2a")
    client = _serving_request(cluster, info)
    try:
        for r in m.ranks:
            os.kill(r.pid, signal.SIGSTOP)
        sup.kill()
        sup.wait(timeout=10)
        assert all(not process_gone(r.pid, r.start_time) for r in m.ranks)
        res = reaper_once(cluster.home, "--term-timeout", "1", "--kill-timeout", "3",
                          timeout=120, env=lockstep_env(cluster.home))
    finally:
        client.close()
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["reaped"] == [m.job_id] and not report["blocking"], report
    # SIGTERM stays pending on a stopped rank (it handles SIGTERM); SIGKILL ends it.
    assert report["steps"][m.job_id] == ["sigterm", "sigkill"], report
    _assert_reaped(cluster, m)
    _redeploy_cleanly(cluster, model, "tp2b")


@pytest.mark.timeout(420)
def test_sigkill_supervisor_tp2_with_reaper_service(cluster: Cluster, model: Path) -> None:
    """The reaper service is already running: it reaps the dead supervisor's launch
    within its interval, whatever the ranks' own watchdogs do meanwhile."""
    interval = 2.0
    reaper, log = cluster.reaper("--interval", str(interval), "--term-timeout", "2",
                                 "--kill-timeout", "3")
    poll_file(log, "reap pass:", 30)
    sup = cluster.supervisor()
    info, m = cluster.deploy_tp2(model, "svc-a")
    poll_file(log, f"active=['{m.job_id}']", interval + 10)  # seen live, left alone
    client = _serving_request(cluster, info)
    try:
        sup.kill()
        sup.wait(timeout=10)
        t0 = time.monotonic()
        poll_for("the reaper service to remove the manifest",
                 lambda: not manifest_path(cluster.paths, m.job_id).exists(), interval + 15)
        took = time.monotonic() - t0
    finally:
        client.close()
    assert took < interval + 2 + 3 * 2 + 2, f"reaped after {took:.1f}s"
    poll_file(log, f"reaped=['{m.job_id}']", 10)  # the pass (marker sweep included) ended
    _assert_reaped(cluster, m)
    _redeploy_cleanly(cluster, model, "svc-b")
    assert reaper.poll() is None
    reaper.send_signal(signal.SIGTERM)
    assert reaper.wait(timeout=30) == 0


@pytest.mark.timeout(120)
def test_unreadable_manifest_blocks_deploy(cluster: Cluster, tmp_path: Path) -> None:
    """Fake ranks are enough here: the deploy must be refused before anything starts."""
    cluster.supervisor(LOCKSTEP_RANK_COMMAND=FAKE_RANK)
    bad = cluster.paths.manifests / "j-broken.json"
    bad.write_text('{"schema_version": 1, "job_id": "j-broken", "ranks": [')
    empty = fake_model_dir(tmp_path / "model")  # a config.json only: fake ranks load nothing
    reply = cluster.admin("deploy", "--model", str(empty), "--tp", "2", "--id", "blocked")
    assert not reply["ok"] and reply["code"] == "reap_blocked", reply
    assert str(bad) in reply["message"] and "not valid JSON" in reply["message"]
    assert cluster.admin("deployments")["data"]["deployments"] == []
    assert [p.name for p in cluster.paths.manifests.iterdir()] == ["j-broken.json"]
    reap = cluster.admin("reap")
    assert reap["data"]["blocking"] and reap["data"]["unreadable"][0]["path"] == str(bad)
    bad.unlink()  # the operator resolves it; nothing was guessed meanwhile
    reply = cluster.admin("deploy", "--model", str(empty), "--tp", "2", "--id", "after")
    assert reply["ok"] and reply["data"]["state"] == "serving", reply
    assert cluster.admin("stop", "after")["ok"]


@pytest.mark.timeout(180)
def test_supervisor_kill_loop_real_supervisor(cluster: Cluster, tmp_path: Path) -> None:
    """20 × (real `lockstep supervisor`, TP=2 of fake ranks, SIGKILL it mid-serve, one
    reap pass): zero rank processes, manifests, secrets and marker directories left."""
    from services.reaper.reap import reap_orphans

    empty = fake_model_dir(tmp_path / "model")  # a config.json only: fake ranks load nothing
    jobs: list[LaunchManifest] = []
    for i in range(20):
        sup = cluster.supervisor(LOCKSTEP_RANK_COMMAND=FAKE_RANK,
                                 LOCKSTEP_RANK_TELEMETRY_INTERVAL_S="0.2",
                                 LOCKSTEP_CANARY_WINDOW_S="0.1", LOCKSTEP_CANARY_RUNS="1")
        _, m = cluster.deploy_tp2(empty, f"loop-{i}", info=False)
        jobs.append(m)
        sup.kill()
        sup.wait(timeout=10)
        report = reap_orphans(cluster.paths, term_timeout=1.0, kill_timeout=2.0)
        assert report.reaped == [m.job_id] and not report.blocking, report.to_dict()
    left = [(m.deployment_id, r.pid) for m in jobs for r in m.ranks
            if not process_gone(r.pid, r.start_time)]
    assert left == []
    assert all(p.poll() is not None for p in cluster.procs)
    p = cluster.paths
    assert [list(d.iterdir()) for d in (p.manifests, p.secrets, p.markers)] == [[], [], []]
