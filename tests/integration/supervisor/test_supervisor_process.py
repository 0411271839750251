"""`lockstep supervisor` and `lockstep admin` as real processes: endpoints in
runtime/supervisor.json, the CLI, the supervisor lease (a wedged supervisor is noticed by
the ranks), rank-lost incidents on events, reap of a dead supervisor's launch at start,
and SIGTERM → verified teardown of every deployment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from common.bus import Channel, configure
from common.home import Paths, read_manifests, read_supervisor_record
from common.keys import generate_key_file, load_cluster_key
from common.messages import EVENTS, Event
from tests.support.fake_model import fake_model_dir
from tests.support.processes import lockstep_env
from tests.support.supervisor import (
    FAKE_RANK,
    PORTS_0_ENV,
    pid_gone,
    poll_for,
    runtime_names,
)

REPO = Path(__file__).resolve().parents[3]


def _start(home: Path, **settings: str) -> subprocess.Popen:
    env = lockstep_env(home, **PORTS_0_ENV, LOCKSTEP_RANK_COMMAND=FAKE_RANK,
                       LOCKSTEP_RANK_TELEMETRY_INTERVAL_S="0.2", LOCKSTEP_CANARY_WINDOW_S="0.2",
                       LOCKSTEP_GRACEFUL_TIMEOUT="2", LOCKSTEP_STOP_TIMEOUT="2", **settings)
    runtime = home / "runtime" / "supervisor.json"
    if runtime.exists():
        runtime.unlink()
    p = subprocess.Popen([sys.executable, "-m", "services.supervisor", "--log-level", "WARNING"],
                         env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    poll_for(lambda: runtime_names(runtime, p), 20, "runtime/supervisor.json")
    assert oct(runtime.stat().st_mode & 0o777) == "0o600"
    return p


def _admin(home: Path, *args: str, ok: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-m", "services", "admin", "--home", str(home),
                          "--json", *args], env=lockstep_env(), cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    reply = json.loads(out.stdout)
    assert reply["ok"] is ok, reply
    assert out.returncode == (0 if ok else 1)
    return reply


def _events(home: Path) -> tuple[zmq.Context, zmq.Socket, Channel]:
    ctx = zmq.Context()
    sub = configure(ctx.socket(zmq.SUB))
    sub.setsockopt(zmq.SUBSCRIBE, b"events")
    sub.connect(read_supervisor_record(home / "runtime" / "supervisor.json").events)
    key = load_cluster_key(home / "keys" / "cluster.key")
    return ctx, sub, Channel("test", "events", sender="t", send_key=key, accept=EVENTS)


def _drain(sub: zmq.Socket, ch: Channel, seen: list[Event]) -> list[Event]:
    while sub.poll(50):
        msg = ch.unpack_sub(sub.recv_multipart(), b"events")
        if msg is not None:
            seen.append(msg.body)
    return seen


@pytest.mark.timeout(90)
def test_lease_reap_cli_and_sigterm(tmp_path):
    home = tmp_path / "home"
    generate_key_file(home / "keys" / "cluster.key")
    model = fake_model_dir(tmp_path / "m")
    procs: list[subprocess.Popen] = []
    try:
        # 1. a supervisor that gets wedged (SIGSTOP): ranks see the lease go stale.
        sup = _start(home, LOCKSTEP_LEASE_TTL="1.5", LOCKSTEP_LEASE_INTERVAL="0.2")
        procs.append(sup)
        ctx, sub, ch = _events(home)
        dep = _admin(home, "deploy", "--model", str(model), "--tp", "2", "--id", "p1")["data"]
        assert dep["state"] == "serving"
        info = _admin(home, "deployments")["data"]["deployments"][0]
        pids = [r["pid"] for r in info["ranks"]]
        human = subprocess.run([sys.executable, "-m", "services", "admin", "--home",
                                str(home), "status"], env=lockstep_env(), cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout
        assert "p1" in human and "serving" in human
        os.kill(sup.pid, signal.SIGSTOP)
        poll_for(lambda: all(pid_gone(p) for p in pids), 15, "ranks to exit on a stale lease")
        markers = {r: json.loads((home / "runtime/markers/p1" / f"rank-{r}.json").read_text())
                   for r in (0, 1)}
        assert {m["phase"] for m in markers.values()} == {"launcher_lost"}
        assert "lease stale" in markers[0]["error"]
        os.kill(sup.pid, signal.SIGCONT)
        seen: list[Event] = []
        poll_for(lambda: any(e.name == "rank_lost" for e in _drain(sub, ch, seen)), 10,
                 "a rank_lost incident on events")
        lost = next(e for e in seen if e.name == "rank_lost")
        assert lost.deployment_id == "p1" and "rank" in lost.reason
        assert any(e.name == "state" and e.state == "failed" for e in seen)
        sub.close(0)
        ctx.term()

        # 2. the supervisor dies with a live launch: its ranks exit (parent gone) and the
        #    next supervisor reaps the manifest at start.
        dep2 = _admin(home, "deploy", "--model", str(model), "--tp", "2", "--id", "p2")["data"]
        pids2 = [r["pid"] for r in _admin(home, "deployments")["data"]["deployments"][-1]["ranks"]]
        sup.kill()
        sup.wait()
        poll_for(lambda: all(pid_gone(p) for p in pids2), 15, "orphaned ranks to exit")
        sup2 = _start(home)
        procs.append(sup2)
        status = _admin(home, "status")["data"]
        assert dep2["job_id"] in status["reaper"]["reaped"]
        assert [m.job_id for _, m in read_manifests(Paths(home)).manifests] == []

        # 3. SIGTERM takes the same path as stop: verified teardown of every deployment.
        _admin(home, "deploy", "--model", str(model), "--tp", "2", "--id", "p3")
        pids3 = [r["pid"] for r in _admin(home, "deployments")["data"]["deployments"][0]["ranks"]]
        sup2.send_signal(signal.SIGTERM)
        assert sup2.wait(30) == 0
        assert all(pid_gone(p) for p in pids3)
        assert read_manifests(Paths(home)).manifests == []
        assert not (home / "runtime" / "supervisor.json").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
