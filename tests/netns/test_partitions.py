"""Network partitions between real MLX ranks on two network-namespace hosts (TP=2, rank 0
on host A, rank 1 on host B, ring backend between them), run by the real supervisor with
short watchdog settings (DESIGN 7): a flap shorter than the peer abort grace ends the
in-flight stream with `abort` and the deployment keeps serving with the same greedy
tokens; a partition longer than the grace ends rank 0 `peer_lost`, the supervisor records
`rank_lost`, a stop while host B is cut off is a TeardownError naming host B with the
manifest kept, and after link_up a stop is a verified teardown. Last, the real
supervisor is SIGKILLed with real ranks on both hosts and `lockstep reaper --once` reaps
them over ssh. Nothing may be left on either host (ssh and psutil: the namespaces share
this machine's pid space)."""

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
from common.records import LaunchManifest
from services.admin.cli import AdminClient
from services.supervisor.after_failure import attempt_deadline, retry_window
from tests.e2e.rank_harness import model_dir
from tests.netns.hosts import REPO_ROOT
from tests.netns.remote_support import (
    assert_nothing_left,
    gone_locally,
    hosts_doc,
    netns_of,
    poll_for,
    remote_home,
)
from tests.support.processes import reaper_once
from tests.support.requests import RequestsClient
from tests.support.supervisor import (
    RunningSupervisor,
    ensure_key,
    fake_settings,
    supervisor_argv,
)

pytestmark = pytest.mark.netns

A, B = 0, 1
GRACE_S = 6.0  # peer_abort_grace: re-probing after the abort stage
FLAP_EXTRA_S = 1.5  # link kept down this long after the abort stage (well inside the grace)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# rank 0 sleeps this long before each step (test seam), so a long generation is in flight
# for tens of seconds on the tiny model
STEP_DELAY = "LOCKSTEP_TEST_STEP_DELAY_S=0.02"


def _settings(home: Path):
    return replace(fake_settings(home), rank_command="", load_timeout=300.0,
                   canary_window_s=1.0, canary_timeout_s=120.0, stop_timeout=5.0,
                   graceful_timeout=5.0, kill_timeout=3.0, rank_telemetry_interval_s=0.5,
                   ssh_connect_timeout=3.0, lease_ttl=30.0, peer_abort_grace=GRACE_S,
                   rank_test_seams=True, remote_poll_s=0.3)


def _manifest(home: Path, job_id: str) -> LaunchManifest:
    return LaunchManifest.from_dict(read_json(manifest_path(Paths(home), job_id)))


def _placed(m: LaunchManifest, hosts: list[int]) -> list[dict]:
    return [{"host": h, "pid": r.pid, "start_time": r.start_time}
            for r, h in zip(m.ranks, hosts, strict=True)]


def _deploy(c, rs: RunningSupervisor, home: Path, dep_id: str) -> tuple[dict, LaunchManifest]:
    out = rs.ok("deploy", timeout=400, model_path=str(model_dir()), deployment_id=dep_id, tp=2,
                hosts=hosts_doc(c, [A, B])["hosts"], envs=[STEP_DELAY])
    assert out["state"] == "serving", out
    info = next(d for d in rs.ok("deployments")["deployments"] if d["deployment_id"] == dep_id)
    m = _manifest(home, out["job_id"])
    assert [netns_of(r.pid) for r in m.ranks] == [c.namespaces[A], c.namespaces[B]]
    return info, m


def _greedy(info: dict, n: int = 12) -> list[int]:
    client = RequestsClient(info)
    try:
        rid = client.generate(PROMPT, n)
        assert client.wait_finished([rid], 120) == {rid: "length"}
        return client.tokens(rid)
    finally:
        client.close()


def _in_flight(info: dict) -> tuple[RequestsClient, str]:
    client = RequestsClient(info)
    rid = client.generate(PROMPT, 3000)
    poll_for("tokens of the long request", lambda: (client.pump(), client.tokens(rid))[1], 60)
    return client, rid


def _marker(c, host: int, dep_id: str, rank: int) -> dict | None:
    p = Paths(remote_home(c, host)).markers / dep_id / f"rank-{rank}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _dep_state(rs: RunningSupervisor, dep_id: str) -> str | None:
    deps = rs.ok("deployments")["deployments"]
    return next((d["state"] for d in deps if d["deployment_id"] == dep_id), None)


@pytest.fixture
def supervisor(netns_cluster, tmp_path):
    rs = RunningSupervisor(_settings(tmp_path / "home"))
    yield rs
    netns_cluster.link_up(B)  # whatever happened, the next test gets its host back
    rs.close()


@pytest.mark.timeout(240)
def test_flap_shorter_than_grace_aborts_stream_and_keeps_serving(netns_cluster, supervisor,
                                                                 tmp_path):
    c, rs, home = netns_cluster, supervisor, tmp_path / "home"
    info, m = _deploy(c, rs, home, "flap")
    before = _greedy(info)
    client, rid = _in_flight(info)
    try:
        t0 = time.monotonic()
        c.link_down(B)
        try:
            # 2 failed probe rounds → abort stage: the stream ends with `abort`
            poll_for("the abort stage to end the stream",
                     lambda: (client.pump(), client.finish_reason(rid))[1],
                     GRACE_S - 1.5, interval=0.05)
            aborted_after = time.monotonic() - t0
            # stay cut off into the re-probe window (the fault's length, not a wait for
            # anything): rank 0 must keep re-probing and recover within the grace
            time.sleep(FLAP_EXTRA_S)
        finally:
            c.link_up(B)
        down_s = time.monotonic() - t0
        assert client.finish_reason(rid) == "abort", client.streams[rid][-1]
        assert down_s < GRACE_S, f"link was down {down_s:.1f}s, grace {GRACE_S}s"
    finally:
        client.close()
    # The ring resumes: the abort's removal plan reaches rank 1, serving goes on.
    t1 = time.monotonic()
    after = _greedy(info)
    recovered_s = time.monotonic() - t1
    assert after == before, f"greedy tokens changed across the flap: {before} → {after}"
    assert _dep_state(rs, "flap") == "serving"
    assert all(not gone_locally(r.pid, r.start_time) for r in m.ranks)  # same ranks
    assert _marker(c, A, "flap", 0)["phase"] == "serving"
    stop = rs.ok("stop", deployment_id="flap", timeout=120)["outcome"]
    assert stop["proven"], stop
    assert_nothing_left(c, _placed(m, [A, B]), m.job_id, "flap")
    print(f"\nflap: stream aborted {aborted_after:.2f}s after link_down, link down "
          f"{down_s:.2f}s, next request served in {recovered_s:.2f}s")


@pytest.mark.timeout(300)
def test_partition_longer_than_grace_peer_lost_then_verified_teardown(netns_cluster,
                                                                       supervisor, tmp_path):
    c, rs, home = netns_cluster, supervisor, tmp_path / "home"
    info, m = _deploy(c, rs, home, "cut")
    client, rid = _in_flight(info)
    try:
        t0 = time.monotonic()
        c.link_down(B)
        poll_for("the stream to end", lambda: (client.pump(), client.finish_reason(rid))[1],
                 GRACE_S)
        assert client.finish_reason(rid) == "abort"
        marker = poll_for("rank 0's marker peer_lost",
                          lambda: (_marker(c, A, "cut", 0) or {}).get("phase") == "peer_lost"
                          and _marker(c, A, "cut", 0), GRACE_S + 15)
        lost_s = time.monotonic() - t0
        poll_for("rank 0 to exit", lambda: gone_locally(m.ranks[0].pid, m.ranks[0].start_time),
                 15)
        # The supervisor notices: rank_lost → failed, then its own teardown cannot reach B.
        state = poll_for("the supervisor to notice",
                         lambda: _dep_state(rs, "cut") in ("failed", "teardown_failed")
                         and _dep_state(rs, "cut"), 30)
        status = rs.ok("status")
        dep = next(d for d in status["deployments"] if d["deployment_id"] == "cut")
        assert "rank 0" in (dep.get("error") or ""), dep
        # It retries while host B is cut off (the state stays failed), then gives up.
        poll_for("the automatic teardown to give up on host B",
                 lambda: _dep_state(rs, "cut") == "teardown_failed",
                 retry_window(rs.sup.settings) + attempt_deadline(rs.sup.settings))
        reply = poll_for("a stop that is not refused as busy",
                         lambda: (r := rs.call("stop", deployment_id="cut", timeout=120)).code
                         != "conflict" and r, 60, interval=0.5)
        assert not reply.ok and reply.code == "teardown_failed", reply
        assert c.names[B] in reply.message, reply.message
        assert manifest_path(Paths(home), m.job_id).exists()
    finally:
        client.close()
        c.link_up(B)
    poll_for("ssh to host B", lambda: c.ssh(B, ["true"], timeout=20).returncode == 0, 30)
    stop = rs.ok("stop", deployment_id="cut", timeout=120)["outcome"]
    assert stop["proven"], stop
    assert_nothing_left(c, _placed(m, [A, B]), m.job_id, "cut")
    assert not manifest_path(Paths(home), m.job_id).exists()
    assert rs.ok("deployments")["deployments"] == []
    print(f"\npartition: rank 0 peer_lost {lost_s:.2f}s after link_down "
          f"(marker error {marker.get('error')!r}); state {state}; retry stop path "
          f"{stop['path']}")


@pytest.mark.timeout(300)
def test_sigkill_supervisor_real_ranks_reaped_over_ssh(netns_cluster, tmp_path):
    c = netns_cluster
    home = tmp_path / "home"
    ensure_key(home)
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps(hosts_doc(c, [A, B])))
    argv = supervisor_argv(home, "--hosts", str(hosts_file), "--lease-ttl", "120",
                           "--load-timeout", "300", "--canary-window-s", "1",
                           "--ssh-connect-timeout", "3", "--rank-telemetry-interval-s", "0.5")
    log = open(tmp_path / "sup.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    manifest = None
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "sup.log").read_text()[-2000:]
        eps = json.loads(line)
        admin = AdminClient(eps["admin"], load_cluster_key(home / "keys" / "cluster.key"))
        reply = admin.call("deploy", 400, model_path=str(model_dir()), tp=2,
                           deployment_id="orphan")
        admin.close()
        assert reply.ok, f"{reply.code} {reply.message}"
        manifest = _manifest(home, reply.data["job_id"])
        assert [netns_of(r.pid) for r in manifest.ranks] == [c.namespaces[A], c.namespaces[B]]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no teardown: the real ranks are orphaned
        proc.wait(10)
        log.close()
    placed = _placed(manifest, [A, B])
    assert not any(gone_locally(r["pid"], r["start_time"]) for r in placed)
    t0 = time.monotonic()
    cp = reaper_once(home, "--term-timeout", "5", "--kill-timeout", "3", timeout=120)
    reap_s = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout + cp.stderr
    report = json.loads(cp.stdout)
    assert report["reaped"] == [manifest.job_id] and not report["blocking"], report
    assert_nothing_left(c, placed, manifest.job_id, "orphan")
    assert not manifest_path(Paths(home), manifest.job_id).exists()
    print(f"\nreaper --once over ssh (real ranks on A and B): {reap_s:.2f}s, "
          f"steps {report['steps'][manifest.job_id]}")
