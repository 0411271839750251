"""The supervisor and the reaper with ranks on remote hosts (network namespaces with their
own sshd), using the fake rank (`tests/fakes/fake_rank.py`): launch over ssh, serve,
verified teardown over ssh, a rank that ignores SIGTERM, an orphaned launch reaped over
ssh after the supervisor was SIGKILLed, and a host unreachable at stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from common.atomic_json import read_json
from common.home import Paths, manifest_path
from common.keys import load_cluster_key
from common.rankspec import RankSpec
from common.records import LaunchManifest
from services.admin.cli import AdminClient
from tests.netns.hosts import REPO_ROOT
from tests.netns.remote_support import (
    assert_nothing_left,
    gone_locally,
    gone_over_ssh,
    hosts_doc,
    launch_files,
    netns_of,
    poll_for,
    remote_home,
)
from tests.support.fake_model import fake_model_dir
from tests.support.processes import reaper_once
from tests.support.requests import RequestsClient
from tests.support.supervisor import (
    FAKE_RANK,
    RunningSupervisor,
    ensure_key,
    fake_settings,
    supervisor_argv,
)

pytestmark = pytest.mark.netns

A, B = 0, 1


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return fake_model_dir(tmp_path / "fake-model")


@pytest.fixture
def supervisor(tmp_path: Path):
    """supervisor(**settings): a RunningSupervisor with fake ranks, ssh tuned to the
    cluster (connect timeout 3 s) and a lease that outlives every test (so a rank only
    goes because it was stopped). Closed with a verified teardown at the end."""
    running: list[RunningSupervisor] = []

    def start(rank_env: dict[str, str] | None = None, **kw) -> RunningSupervisor:
        settings = fake_settings(tmp_path / "home", ssh_connect_timeout=3.0, lease_ttl=120.0)
        rs = RunningSupervisor(replace(settings, **kw), rank_env=rank_env)
        running.append(rs)
        return rs

    yield start
    for rs in running:
        rs.close()


def _placed(manifest: LaunchManifest, hosts: list[int]) -> list[dict]:
    return [{"host": h, "pid": r.pid, "start_time": r.start_time}
            for r, h in zip(manifest.ranks, hosts, strict=True)]


def _manifest(home: Path, job_id: str) -> LaunchManifest:
    return LaunchManifest.from_dict(read_json(manifest_path(Paths(home), job_id)))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.timeout(240)
def test_deploy_serve_stop_on_two_hosts(netns_cluster, supervisor, model_dir, tmp_path,
                                        monkeypatch):
    c = netns_cluster
    monkeypatch.setenv("LOCKSTEP_SUPERVISOR_ONLY_MARK", "must-not-reach-remote-ranks")
    rs = supervisor()
    home = tmp_path / "home"
    t0 = time.monotonic()
    out = rs.ok("deploy", timeout=150, model_path=str(model_dir), tp=2,
                hosts=hosts_doc(c, [A, B])["hosts"], deployment_id="remote")
    launch_s = time.monotonic() - t0
    assert out["state"] == "serving"
    info = rs.ok("deployments")["deployments"][0]
    assert [r["remote"] for r in info["ranks"]] == [True, True]
    manifest = _manifest(home, out["job_id"])
    job = out["job_id"]
    for r, h in zip(manifest.ranks, (A, B), strict=True):
        assert r.remote and r.ssh == f"{c.user}@{c.address(h)}" and r.host == c.names[h]
        assert r.home == str(remote_home(c, h)) and r.ssh_config == str(c.ssh_config)
        assert netns_of(r.pid) == c.namespaces[h]  # it runs on that host
        ident = c.agent(h, "identify", str(r.pid))  # the recorded identity, read there
        assert ident["cmdline"] == r.cmdline and abs(ident["start_time"] - r.start_time) < 0.01
        there = Paths(remote_home(c, h))
        secret = there.secrets / f"{job}.key"
        assert secret.stat().st_mode & 0o777 == 0o600
        spec_path = there.runtime / "jobs" / job / f"rank-{r.rank}.spec.json"
        assert spec_path.stat().st_mode & 0o777 == 0o600 and str(spec_path) in r.cmdline
        spec = RankSpec.load(spec_path)
        assert spec.home == str(remote_home(c, h)) and spec.secret_path == str(secret)
        # control/report on the supervisor's bridge address; rank 0's sockets on host A
        assert spec.control_endpoint.startswith(f"tcp://{c.control_address}:")
        assert spec.report_endpoint.startswith(f"tcp://{c.control_address}:")
        assert spec.requests_endpoint.startswith(f"tcp://{c.address(A)}:")
        env = _environ(r.pid)
        assert env["MLX_RANK"] == str(r.rank) and env["LOCKSTEP_HOME"] == spec.home
        assert env["MLX_HOSTFILE"] == str(there.runtime / "jobs" / job / "hostfile.json")
        assert env["MLX_MAX_OPS_PER_BUFFER"] == "16"  # the 5.3 defaults, applied there
        assert "LOCKSTEP_SUPERVISOR_ONLY_MARK" not in env
        assert secret.read_text().strip() not in " ".join(r.cmdline)
        hostfile = json.loads((there.runtime / "jobs" / job / "hostfile.json").read_text())
        assert [e[0].rsplit(":", 1)[0] for e in hostfile] == [c.address(A), c.address(B)]

    client = RequestsClient(info)
    try:
        rid = client.generate([5, 6, 7], 6)
        assert client.wait_finished([rid], 30) == {rid: "length"}
        assert client.tokens(rid) == [5, 6, 7, 5, 6, 7]  # the fake rank echoes
    finally:
        client.close()

    t0 = time.monotonic()
    stop = rs.ok("stop", deployment_id="remote", timeout=120)["outcome"]
    stop_s = time.monotonic() - t0
    assert stop["proven"] and stop["survivors"] == [] and stop["path"] == ["shutdown"]
    assert set(stop["hosts"]) == {c.names[A], c.names[B]}
    assert all(h["error"] is None and h["path"] == [] for h in stop["hosts"].values())
    assert_nothing_left(c, _placed(manifest, [A, B]), job, "remote")
    assert not manifest_path(Paths(home), job).exists()
    assert rs.ok("deployments")["deployments"] == []
    print(f"\nremote launch (2 fake ranks on 2 hosts, to serving): {launch_s:.2f}s; "
          f"verified remote teardown: {stop_s:.2f}s (outcome {stop['duration_s']:.2f}s)")


@pytest.mark.timeout(240)
def test_remote_rank_ignoring_sigterm_is_killed_over_ssh(netns_cluster, supervisor,
                                                         model_dir, tmp_path):
    c = netns_cluster
    rs = supervisor(rank_env={"LOCKSTEP_FAKE_IGNORE_SIGTERM": "1"})
    out = rs.ok("deploy", timeout=150, model_path=str(model_dir), tp=2,
                hosts=hosts_doc(c, [A, B])["hosts"], deployment_id="stubborn")
    manifest = _manifest(tmp_path / "home", out["job_id"])
    t0 = time.monotonic()
    stop = rs.ok("stop", deployment_id="stubborn", timeout=120)["outcome"]
    stop_s = time.monotonic() - t0
    assert stop["proven"] and stop["path"] == ["shutdown", "sigterm", "sigkill"], stop
    assert stop["hosts"][c.names[B]]["path"] == ["sigterm", "sigkill"]
    assert stop["hosts"][c.names[A]]["path"] == []  # rank 0 left on the shutdown message
    assert_nothing_left(c, _placed(manifest, [A, B]), out["job_id"], "stubborn")
    print(f"\nremote teardown with a rank ignoring SIGTERM: {stop_s:.2f}s")


def _start_supervisor_process(home: Path, hosts_file: Path, log: Path) -> tuple:
    ensure_key(home)
    argv = supervisor_argv(home, "--rank-command", FAKE_RANK, "--hosts", str(hosts_file),
                           "--lease-ttl", "120", "--load-timeout", "60",
                           "--canary-window-s", "0.2", "--ssh-connect-timeout", "3",
                           "--rank-telemetry-interval-s", "0.2")
    out = open(log, "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=out, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert line, f"supervisor did not start: {log.read_text()[-2000:]}"
    return proc, json.loads(line), out


@pytest.mark.timeout(240)
def test_reaper_reaps_remote_ranks_of_a_killed_supervisor(netns_cluster, model_dir, tmp_path):
    c = netns_cluster
    home = tmp_path / "home"
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps(hosts_doc(c, [B], ranks_per_host=2)))
    proc, eps, errlog = _start_supervisor_process(home, hosts_file, tmp_path / "sup.log")
    try:
        admin = AdminClient(eps["admin"], load_cluster_key(home / "keys" / "cluster.key"))
        reply = admin.call("deploy", 150, model_path=str(model_dir), tp=2,
                           deployment_id="orphan")
        admin.close()
        assert reply.ok, f"{reply.code} {reply.message}"
        job = reply.data["job_id"]
        manifest = _manifest(home, job)
        assert [r.remote for r in manifest.ranks] == [True, True]
        assert all(netns_of(r.pid) == c.namespaces[B] for r in manifest.ranks)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no teardown: the ranks are orphaned
        proc.wait(10)
        errlog.close()
    placed = _placed(manifest, [B, B])
    assert not any(gone_over_ssh(c, B, r["pid"], r["start_time"]) for r in placed)
    t0 = time.monotonic()
    cp = reaper_once(home, "--term-timeout", "5", "--kill-timeout", "3", timeout=120)
    reap_s = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout + cp.stderr
    report = json.loads(cp.stdout)
    assert report["reaped"] == [job] and report["steps"][job] == ["sigterm"], report
    assert_nothing_left(c, placed, job, "orphan")
    assert not manifest_path(Paths(home), job).exists()
    assert not (Paths(home).secrets / f"{job}.key").exists()
    print(f"\nreaper --once over ssh (2 orphaned ranks on one host): {reap_s:.2f}s")


@pytest.mark.timeout(300)
def test_host_unreachable_at_stop_keeps_manifest_and_retry_succeeds(
        netns_cluster, supervisor, model_dir, tmp_path):
    c = netns_cluster
    rs = supervisor()
    home = tmp_path / "home"
    out = rs.ok("deploy", timeout=150, model_path=str(model_dir), tp=2,
                hosts=hosts_doc(c, [A, B])["hosts"], deployment_id="cut")
    job = out["job_id"]
    manifest = _manifest(home, job)
    c.link_down(B)
    try:
        t0 = time.monotonic()
        reply = rs.call("stop", deployment_id="cut", timeout=120)
        failed_s = time.monotonic() - t0
        assert not reply.ok and reply.code == "teardown_failed", reply
        assert c.names[B] in reply.message and f"pid {manifest.ranks[1].pid}" in reply.message
        survivors = reply.data["outcome"]["survivors"]
        assert [(s["rank"], s["host"]) for s in survivors] == [(1, c.names[B])]
        assert "ssh" in survivors[0]["reason"] or "failed" in survivors[0]["reason"]
        assert manifest_path(Paths(home), job).exists()  # kept: the next stop retries
        assert _manifest(home, job).teardown_failures
        assert rs.ok("deployments")["deployments"][0]["state"] == "teardown_failed"
        assert gone_locally(manifest.ranks[0].pid, manifest.ranks[0].start_time)
        assert not gone_locally(manifest.ranks[1].pid, manifest.ranks[1].start_time)
        assert launch_files(c, B, job, "cut")  # nothing removed there
    finally:
        c.link_up(B)
    poll_for("ssh to host B", lambda: c.ssh(B, ["true"], timeout=20).returncode == 0, 30)
    t0 = time.monotonic()
    stop = rs.ok("stop", deployment_id="cut", timeout=120)["outcome"]
    retry_s = time.monotonic() - t0
    assert stop["proven"], stop
    assert_nothing_left(c, _placed(manifest, [A, B]), job, "cut")
    assert not manifest_path(Paths(home), job).exists()
    print(f"\nstop with host B unreachable failed after {failed_s:.2f}s; "
          f"retry after link_up proven in {retry_s:.2f}s (path {stop['path']})")


@pytest.mark.timeout(240)
def test_remote_rank_failing_during_load_is_a_launch_error_with_its_reason(
        netns_cluster, supervisor, model_dir, tmp_path):
    c = netns_cluster
    rs = supervisor(rank_env={"LOCKSTEP_FAKE_CRASH_ON_LOAD": "1"})
    reply = rs.call("deploy", timeout=150, model_path=str(model_dir), tp=2,
                    hosts=hosts_doc(c, [A, B])["hosts"], deployment_id="crash")
    assert not reply.ok and reply.code == "launch_failed", reply
    # The reason comes from the marker read on host B, over ssh.
    assert "rank 1" in reply.message and c.names[B] in reply.message
    assert "LOCKSTEP_FAKE_CRASH_ON_LOAD" in reply.message
    job = reply.data["job_id"]
    assert reply.data["teardown"]["proven"]
    manifest_gone = not manifest_path(Paths(tmp_path / "home"), job).exists()
    assert manifest_gone and launch_files(c, A, job, "crash") == []
    assert launch_files(c, B, job, "crash") == []
