"""Verified teardown against real (fake-rank) processes: obedient, SIGTERM-ignoring,
unkillable (kill seam), crashing during load, never ready, and a reused pid in a marker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from common.home import Paths, manifest_path, marker_dir
from common.procs import ProcessIdentity, start_time_of
from services.supervisor.teardown import TeardownSeams
from tests.support.supervisor import pid_gone, poll_for


def _pids(rs, dep_id):
    deps = {d["deployment_id"]: d for d in rs.ok("deployments")["deployments"]}
    return [r["pid"] for r in deps[dep_id]["ranks"]]


def _assert_clean(home, job_id, dep_id, pids):
    for pid in pids:
        assert pid_gone(pid), f"pid {pid} still running"
    paths = Paths(home)
    assert not manifest_path(paths, job_id).exists()
    assert not marker_dir(paths, dep_id).exists()
    assert not (paths.secrets / f"{job_id}.key").exists()


@pytest.mark.timeout(60)
def test_deploy_serve_stop_obedient(start_supervisor, home, model_dir):
    rs = start_supervisor()
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="ok")
    assert out["state"] == "serving"
    paths = Paths(home)
    manifest = json.loads(manifest_path(paths, out["job_id"]).read_text())
    pids = _pids(rs, "ok")
    assert sorted(r["pid"] for r in manifest["ranks"]) == sorted(pids)
    for r in manifest["ranks"]:  # each rank leads its own session / process group
        assert r["pgid"] == r["pid"] and r["start_time"] > 0
    assert oct(manifest_path(paths, out["job_id"]).stat().st_mode & 0o777) == "0o600"
    stop = rs.ok("stop", deployment_id="ok")
    assert stop["outcome"]["proven"] and stop["outcome"]["path"] == ["shutdown"]
    _assert_clean(home, out["job_id"], "ok", pids)
    assert rs.ok("deployments")["deployments"] == []


@pytest.mark.timeout(60)
def test_sigterm_ignoring_rank_is_killed_by_sigkill(start_supervisor, home, model_dir,
                                                     monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "1")
    rs = start_supervisor(graceful_timeout=0.5, stop_timeout=1.0)
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="stubborn")
    pids = _pids(rs, "stubborn")
    stop = rs.ok("stop", deployment_id="stubborn")
    assert stop["outcome"]["path"] == ["shutdown", "sigterm", "sigkill"], stop
    assert stop["outcome"]["survivors"] == []
    _assert_clean(home, out["job_id"], "stubborn", pids)


@pytest.mark.timeout(60)
def test_unkillable_survivor_keeps_state_and_next_stop_retries(start_supervisor, home,
                                                               model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "1")
    blocked: set[int] = set()
    swallowed: list[tuple[int, int]] = []

    def kill(target, sig):  # the seam: signals to a blocked pid (or its group) vanish
        pid = target.pid if isinstance(target, ProcessIdentity) else target
        if pid in blocked:
            swallowed.append((pid, sig))
            return
        (os.kill if isinstance(target, ProcessIdentity) else os.killpg)(pid, sig)

    rs = start_supervisor(seams=TeardownSeams(kill=kill), graceful_timeout=0.3,
                          stop_timeout=0.5, kill_timeout=0.5)
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="stuck")
    pids = _pids(rs, "stuck")
    blocked.add(pids[1])
    reply = rs.call("stop", deployment_id="stuck")
    assert not reply.ok and reply.code == "teardown_failed", reply
    assert f"rank 1 pid {pids[1]}" in reply.message
    assert [s["pid"] for s in reply.data["outcome"]["survivors"]] == [pids[1]]
    assert {sig for _, sig in swallowed} == {signal.SIGTERM, signal.SIGKILL}
    assert pid_gone(pids[0]) and not pid_gone(pids[1])
    paths = Paths(home)
    manifest = json.loads(manifest_path(paths, out["job_id"]).read_text())
    assert manifest["teardown_failures"] and str(pids[1]) in manifest["teardown_failures"][-1]
    dep = rs.ok("deployments")["deployments"][0]
    assert dep["state"] == "teardown_failed" and dep["teardown"]["survivors"]

    blocked.clear()  # the seam is removed: the next stop retries and proves it
    stop = rs.ok("stop", deployment_id="stuck")
    assert stop["outcome"]["proven"] and "sigkill" in stop["outcome"]["path"]
    _assert_clean(home, out["job_id"], "stuck", pids)


@pytest.mark.timeout(60)
def test_rank_crashing_during_load_fails_the_deploy(start_supervisor, home, model_dir,
                                                     monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_CRASH_ON_LOAD", "1")
    rs = start_supervisor()
    reply = rs.call("deploy", model_path=str(model_dir), tp=2, deployment_id="crash")
    assert not reply.ok and reply.code == "launch_failed", reply
    assert "rank 1" in reply.message and "fake crash during load" in reply.message
    assert reply.data["rank"] == 1 and reply.data["teardown"]["proven"]
    dep = rs.ok("deployments")["deployments"][0]
    assert dep["state"] == "failed"
    pids = [r["pid"] for r in dep["ranks"]]
    _assert_clean(home, reply.data["job_id"], "crash", pids)
    rs.ok("stop", deployment_id="crash")  # a failed deployment is removed by stop
    assert rs.ok("deployments")["deployments"] == []


@pytest.mark.timeout(60)
def test_never_ready_times_out_and_exit_late_is_waited_for(start_supervisor, home,
                                                          model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_NEVER_READY", "0")
    monkeypatch.setenv("LOCKSTEP_FAKE_EXIT_LATE_S", "0.5")
    rs = start_supervisor(load_timeout=1.5)
    t0 = time.monotonic()
    reply = rs.call("deploy", model_path=str(model_dir), tp=2, deployment_id="slow")
    assert reply.code == "launch_failed" and "not ready within" in reply.message, reply
    assert "rank 0: marker loading" in reply.message
    assert reply.data["teardown"]["proven"]
    assert time.monotonic() - t0 >= 1.5 + 0.5  # the late exit was waited for, not assumed
    dep = rs.ok("deployments")["deployments"][0]
    _assert_clean(home, reply.data["job_id"], "slow", [r["pid"] for r in dep["ranks"]])


@pytest.mark.timeout(60)
def test_reused_pid_in_marker_is_never_signalled(start_supervisor, home, model_dir):
    rs = start_supervisor()
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="reuse")
    pids = _pids(rs, "reuse")
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        proc = psutil.Process(bystander.pid)
        d = marker_dir(Paths(home), "reuse")
        base = json.loads((d / "rank-0.json").read_text())
        # Same pid number, different start time: the pid was reused by someone else.
        reused = dict(base, rank=7, pid=bystander.pid, start_time=start_time_of(proc) - 50.0)
        # Right pid and start time, but a command line that names no rank of this job.
        foreign = dict(base, rank=8, pid=bystander.pid, start_time=start_time_of(proc))
        (d / "rank-7.json").write_text(json.dumps(reused))
        (d / "rank-8.json").write_text(json.dumps(foreign))
        stop = rs.ok("stop", deployment_id="reuse")
        skipped = {s["rank"]: s["reason"] for s in stop["outcome"]["skipped"]}
        assert "pid reused" in skipped[7] and "does not name this launch" in skipped[8]
        assert stop["outcome"]["swept"] == []
        assert bystander.poll() is None and proc.status() != psutil.STATUS_ZOMBIE
        _assert_clean(home, out["job_id"], "reuse", pids)
    finally:
        bystander.kill()
        bystander.wait()
    poll_for(lambda: bystander.poll() is not None, 5, "bystander exit")


@pytest.mark.timeout(60)
def test_launch_failure_whose_teardown_fails_reports_both(start_supervisor, home, model_dir,
                                                          monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_CRASH_ON_LOAD", "1")
    monkeypatch.setenv("LOCKSTEP_FAKE_NEVER_READY", "0")
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "0")
    blocked = {"on": True}
    rank0: list[int] = []

    def kill(target, sig):
        pid = target.pid if isinstance(target, ProcessIdentity) else target
        if blocked["on"] and pid in rank0:
            return
        (os.kill if isinstance(target, ProcessIdentity) else os.killpg)(pid, sig)

    rs = start_supervisor(seams=TeardownSeams(kill=kill), graceful_timeout=0.3,
                          stop_timeout=0.3, kill_timeout=0.3)
    original = rs.sup.launcher.start

    def start(*a, **kw):  # learn rank 0's pid as it starts, so the seam can protect it
        started = original(*a, **kw)
        if kw["rank"] == 0:
            rank0.append(started.identity.pid)
        return started

    rs.sup.launcher.start = start
    reply = rs.call("deploy", model_path=str(model_dir), tp=2, deployment_id="both")
    assert reply.code == "launch_failed", reply
    # The launch error first, the teardown error attached.
    assert reply.message.startswith("rank 1") and "fake crash during load" in reply.message
    assert "teardown failed too" in reply.message
    assert f"pid {rank0[0]}" in reply.data["teardown_error"]
    assert reply.data["state"] == "teardown_failed"
    paths = Paths(home)
    assert manifest_path(paths, reply.data["job_id"]).exists()
    dep = rs.ok("deployments")["deployments"][0]
    assert dep["state"] == "teardown_failed" and "fake crash" in dep["error"]

    blocked["on"] = False
    stop = rs.ok("stop", deployment_id="both")
    assert stop["outcome"]["proven"]
    _assert_clean(home, reply.data["job_id"], "both", [r["pid"] for r in dep["ranks"]])


@pytest.mark.timeout(30)
def test_unreadable_manifest_blocks_launch(start_supervisor, home, model_dir):
    rs = start_supervisor()
    bad = Paths(home).manifests / "j-broken.json"
    bad.write_text("{not json")
    reply = rs.call("deploy", model_path=str(model_dir), tp=2, deployment_id="blocked")
    assert reply.code == "reap_blocked" and str(bad) in reply.message, reply
    assert reply.data["unreadable"][0]["path"] == str(bad)
    assert rs.ok("deployments")["deployments"] == []  # nothing was spawned
    assert rs.ok("reap")["blocking"] is True
    bad.unlink()
    assert rs.ok("deploy", model_path=str(model_dir), deployment_id="blocked")["state"] == "serving"
