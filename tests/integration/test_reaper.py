"""The reaper against real orphaned launches: a fake supervisor (tests/fakes/fake_launcher)
writes a real manifest, starts real rank processes in their own sessions, and is
SIGKILLed. Evidence is psutil and the files on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from common.envelope import RejectCounter, Verifier
from common.home import Paths, manifest_path, marker_dir, read_manifests
from common.keys import generate_key_file, load_cluster_key
from common.messages import EVENTS
from services.reaper.reap import reap_orphans
from tests.fakes.fake_launcher import ROOT, FakeSupervisor
from tests.fakes.procwatch import poll_file, poll_for, process_gone, process_running
from tests.support.processes import reaper_once

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home").ensure()


@pytest.fixture
def fakes():
    started: list[FakeSupervisor] = []
    yield started
    for f in started:  # a test that failed half-way must not leak ranks
        if f.proc.poll() is None:
            f.proc.kill()
            f.proc.wait(timeout=10)
        for r in f.ranks:
            if not process_gone(r["pid"], r["start_time"]):
                os.kill(r["pid"], signal.SIGKILL)


def _start(fakes: list, paths: Paths, job: str, ranks: int = 2, **kw) -> FakeSupervisor:
    f = FakeSupervisor.start(paths.home, job, f"dep-{job}", ranks, **kw)
    fakes.append(f)
    return f


def _ranks_gone(f: FakeSupervisor) -> bool:
    return all(process_gone(r["pid"], r["start_time"]) for r in f.ranks)


@pytest.mark.timeout(60)
def test_killed_supervisor_is_reaped_by_cli(paths: Paths, fakes) -> None:
    f = _start(fakes, paths, "job-a")
    assert all(process_running(p) for p in f.rank_pids)
    f.kill()
    res = reaper_once(paths.home, "--term-timeout", "2", "--kill-timeout", "2", env=ENV)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["reaped"] == ["job-a"] and report["blocking"] is False
    assert report["retired_markers"] == ["dep-job-a"]
    assert _ranks_gone(f)
    assert not manifest_path(paths, "job-a").exists()
    assert not (paths.secrets / "job-a.key").exists()
    assert not marker_dir(paths, "dep-job-a").exists()


@pytest.mark.timeout(60)
def test_ranks_ignoring_sigterm_are_killed(paths: Paths, fakes) -> None:
    f = _start(fakes, paths, "job-b", env={"LOCKSTEP_FAKE_IGNORE_TERM": "1"})
    f.kill()
    events = []
    report = reap_orphans(paths, term_timeout=0.3, kill_timeout=2, publish=events.append)
    assert report.reaped == ["job-b"]
    assert events[0].name == "reaped" and events[0].data["path"] == ["sigterm", "sigkill"]
    assert _ranks_gone(f) and not read_manifests(paths).manifests


@pytest.mark.timeout(60)
def test_live_supervisor_never_touched(paths: Paths, fakes) -> None:
    f = _start(fakes, paths, "job-live")
    before = manifest_path(paths, "job-live").read_bytes()
    for _ in range(3):
        assert reaper_once(paths.home, env=ENV).returncode == 0
        report = reap_orphans(paths, term_timeout=0.1, kill_timeout=0.1)
        assert report.active == ["job-live"] and not report.reaped
    assert all(not process_gone(r["pid"], r["start_time"]) for r in f.ranks)
    assert manifest_path(paths, "job-live").read_bytes() == before
    assert sorted(p.name for p in marker_dir(paths, "dep-job-live").iterdir()) == [
        "rank-0.json", "rank-1.json"]
    assert f.stop() == 0  # its own teardown still works: nothing was disturbed
    assert _ranks_gone(f) and not manifest_path(paths, "job-live").exists()


@pytest.mark.timeout(60)
def test_unreadable_manifest_blocks_cli(paths: Paths, fakes) -> None:
    bad = paths.manifests / "job-x.json"
    bad.write_text("{ not json")
    f = _start(fakes, paths, "job-c")
    f.kill()
    res = reaper_once(paths.home, env=ENV)
    assert res.returncode == 1
    report = json.loads(res.stdout)
    assert report["blocking"] and report["unreadable"][0]["path"] == str(bad)
    assert report["reaped"] == ["job-c"] and _ranks_gone(f)
    assert bad.exists()
    res = subprocess.run([sys.executable, "-m", "services.reaper", "--home", str(paths.home),
                          "--once"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and f"UNREADABLE {bad}" in res.stdout


@pytest.mark.timeout(60)
def test_reaper_service_reaps_within_interval(paths: Paths, fakes, tmp_path: Path) -> None:
    generate_key_file(paths.cluster_key)
    log = tmp_path / "reaper.log"
    interval = 1.0
    with open(log, "wb") as out:
        svc = subprocess.Popen(
            [sys.executable, "-m", "services.reaper", "--home", str(paths.home), "--interval",
             str(interval), "--term-timeout", "1", "--kill-timeout", "1", "--events-port", "0"],
            cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        endpoint = poll_file(log, "events PUB on ", 20).rsplit(" ", 1)[1]
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"events")
        poll_file(log, "reap pass:", 20)
        f = _start(fakes, paths, "job-svc")
        t0 = time.monotonic()
        f.kill()
        poll_for("manifest removed", lambda: not manifest_path(paths, "job-svc").exists(),
                 interval + 5)
        took = time.monotonic() - t0
        assert took < interval + 2, f"reaped after {took:.1f}s"
        poll_file(log, "reaped=['job-svc']", 10)  # the pass (marker sweep included) ended
        assert _ranks_gone(f) and not marker_dir(paths, "dep-job-svc").exists()
        # The pass was published, signed with the cluster key.
        verifier = Verifier([load_cluster_key(paths.cluster_key)], EVENTS,
                            RejectCounter("test", "events"))
        names = []

        def reaped_event() -> bool:
            while sub.poll(50):
                topic, env = sub.recv_multipart()
                msg = verifier.decode(env)
                assert topic == b"events" and msg.body.topic in ("reap", "reaper")
                if msg.body.topic == "reap":  # ("reaper": its rejection counters)
                    names.append((msg.body.name, msg.body.data.get("job_id")))
            return ("reaped", "job-svc") in names
        poll_for("reaped event", reaped_event, 10)
        svc.send_signal(signal.SIGTERM)
        assert svc.wait(timeout=10) == 0
        poll_file(log, "reaper stopped", 5)
    finally:
        sub.close(0)
        ctx.term()
        if svc.poll() is None:
            svc.kill()
            svc.wait()


@pytest.mark.timeout(90)
def test_repeated_supervisor_kill_leaves_nothing(paths: Paths, fakes) -> None:
    """20 × (start a TP=2-shaped fake launch, SIGKILL its supervisor, reap): zero
    processes, manifests, secrets and marker directories left."""
    for i in range(20):
        env = {"LOCKSTEP_FAKE_IGNORE_TERM": "1"} if i % 2 else None
        f = _start(fakes, paths, f"loop-{i}", env=env)
        f.kill()
        report = reap_orphans(paths, term_timeout=0.2, kill_timeout=1.0)
        assert report.reaped == [f"loop-{i}"] and not report.blocking, report.to_dict()
    left = [(f.job_id, r["pid"]) for f in fakes for r in f.ranks
            if not process_gone(r["pid"], r["start_time"])]
    assert left == []
    assert all(process_gone(f.proc.pid, f.start_time) for f in fakes)
    assert not read_manifests(paths).manifests and not read_manifests(paths).unreadable
    assert list(paths.manifests.iterdir()) == []
    assert list(paths.secrets.iterdir()) == []
    assert list(paths.markers.iterdir()) == []
