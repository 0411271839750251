"""The admin socket: forged, replayed and wrong-key messages are rejected (never answered)
and counted, while real clients keep being served; bad arguments and unknown commands get
stable codes; backend selection and replan signatures over the wire."""

from __future__ import annotations

import secrets
import threading

import psutil
import pytest
import zmq

from common.bus import configure, new_request_id
from common.deployment_info import read_deployment_info
from common.envelope import Key, Signer
from common.messages import AdminRequest
from tests.support.supervisor import poll_for


def _admin_rejections(rs) -> dict[str, int]:
    rows = rs.ok("status")["rejections"]
    return {r["reason"]: r["count"] for r in rows
            if r["service"] == "supervisor" and r["socket"] == "admin"}


@pytest.mark.timeout(60)
def test_forged_replayed_and_wrong_key_are_rejected_while_serving(start_supervisor):
    rs = start_supervisor()
    before = _admin_rejections(rs)
    ctx = zmq.Context()
    raw = configure(ctx.socket(zmq.DEALER))
    raw.connect(rs.sup.sockets.admin_endpoint)
    good = Signer(rs.key, "attacker")
    wrong = Signer(Key.from_secret(secrets.token_bytes(32)), "attacker")
    pings_ok: list[bool] = []
    stop = threading.Event()

    def real_client() -> None:  # a real client, served throughout the attack
        from services.admin.cli import AdminClient

        c = AdminClient(rs.sup.sockets.admin_endpoint, rs.key)
        try:
            while not stop.is_set():
                pings_ok.append(c.call("ping", 5.0).ok)
        finally:
            c.close()

    t = threading.Thread(target=real_client)
    t.start()
    try:
        n = 50
        for _ in range(n):
            frame = good.encode(AdminRequest(request_id=new_request_id(), command="ping"))
            raw.send(frame[:-1] + bytes([frame[-1] ^ 1]))  # forged: MAC does not match
            raw.send(wrong.encode(AdminRequest(request_id=new_request_id(), command="ping")))
            raw.send(b"garbage")
        replay = good.encode(AdminRequest(request_id="replayed", command="ping"))
        raw.send(replay)
        assert raw.poll(5000), "the first, genuine copy is answered"
        raw.recv_multipart()
        for _ in range(n):
            raw.send(replay)  # replayed: same sender, boot and sequence

        def counted():
            now = _admin_rejections(rs)
            delta = {k: now.get(k, 0) - before.get(k, 0) for k in now}
            return delta if (delta.get("bad_mac", 0) >= n and delta.get("unknown_key", 0) >= n
                             and delta.get("replay", 0) >= n
                             and delta.get("too_short", 0) >= n) else None

        delta = poll_for(counted, 10, "rejections to be counted")
        assert delta["replay"] == n
        assert not raw.poll(200), "rejected messages are never answered"
    finally:
        stop.set()
        t.join(10)
        raw.close(0)
        ctx.term()
    assert len(pings_ok) >= 5 and all(pings_ok)


@pytest.mark.timeout(30)
def test_bad_arguments_and_unknown_commands_have_stable_codes(start_supervisor):
    rs = start_supervisor()
    r = rs.call("deploy", tp="two")
    assert (r.ok, r.code) == (False, "bad_request") and "args.tp" in r.message
    r = rs.call("deploy", nonsense=1)
    assert r.code == "bad_request" and "args.nonsense" in r.message
    r = rs.call("stop")
    assert r.code == "bad_request" and "args.deployment_id" in r.message
    assert rs.call("fly").code == "unknown_command"
    assert rs.call("stop", deployment_id="nope").code == "not_found"
    r = rs.call("deploy", model_path="/nonexistent", tp=2, pp=1)
    assert r.code == "bad_request" and "model_path" in r.message
    ping = rs.ok("ping")
    assert ping["pid"] == rs.sup.me.pid and ping["boot_id"] and ping["version"]


@pytest.mark.timeout(30)
def test_backend_selection_over_the_wire(start_supervisor):
    rs = start_supervisor()
    ready = {"ssh": "localhost", "rdma_ctl": True, "rdma_devices": ["rdma_en3"]}
    sel = rs.ok("backend_selection", hosts=[ready, dict(ready, ssh="127.0.0.1")])
    assert sel["backend"] == "jaccl" and sel["blockers"] == []
    sel = rs.ok("backend_selection", hosts=[ready, dict(ready, rdma_ctl=False, name="b")])
    assert sel["backend"] == "ring"
    assert sel["blockers"] == [{"member": "b", "reason": "RDMA control is not enabled "
                                                        "(rdma_ctl false)"}]
    sel = rs.ok("backend_selection", hosts=[ready])
    assert sel["backend"] == "none"
    r = rs.call("backend_selection", hosts=[{"ssh": "a", "bogus": 1}])
    assert r.code == "bad_request" and "bogus" in r.message


@pytest.mark.timeout(60)
def test_replan_preview_signature_and_apply(start_supervisor, model_dir):
    rs = start_supervisor()
    first = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="rp")
    preview = rs.ok("replan", deployment_id="rp", backend="auto")
    assert preview["preview"] and preview["plan"]["backend"] == "ring"
    bad = rs.call("replan", deployment_id="rp", backend="auto", signature="0" * 64)
    assert bad.code == "signature_mismatch"
    # A signature made for another backend's plan does not apply to this one.
    ring = rs.ok("replan", deployment_id="rp", backend="ring")["signature"]
    assert ring != preview["signature"]
    other = rs.call("replan", deployment_id="rp", backend="auto", signature=ring)
    assert other.code == "signature_mismatch"
    applied = rs.ok("replan", deployment_id="rp", backend="auto",
                    signature=preview["signature"])
    assert not applied["preview"] and applied["state"] == "serving"
    assert applied["job_id"] != first["job_id"]
    # The old preview named the old launch: it no longer applies.
    stale = rs.call("replan", deployment_id="rp", backend="auto",
                    signature=preview["signature"])
    assert stale.code == "signature_mismatch"


@pytest.mark.timeout(60)
def test_a_topology_the_model_cannot_take_is_refused_before_anything_starts(start_supervisor,
                                                                             model_dir, home):
    rs = start_supervisor()
    runtime = home / "runtime"
    before = sorted(runtime.rglob("*"))
    # this worker's children now (under xdist, a worker may hold others' until they exit)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    for tp, pp, says in ((3, 1, "tp=3 does not divide its 4 heads and 2 KV heads"),
                         (1, 5, "pp=5 is more than its 4 layers"),
                         (2, 2, "tp > 1 together with pp > 1")):
        r = rs.call("deploy", model_path=str(model_dir), tp=tp, pp=pp, deployment_id="bad")
        assert r.code == "bad_request", r
        assert says in r.message and "valid: --tp 1 or 2, or --pp 2..4" in r.message, r.message
    # nothing was launched: no deployment, no manifest, no rank spec or log, no child
    assert rs.ok("deployments")["deployments"] == []
    assert sorted(runtime.rglob("*")) == before
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in children] == []


@pytest.mark.timeout(60)
def test_sampling_defaults_resolve_operator_over_generation_config(start_supervisor, model_dir):
    (model_dir / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}')
    rs = start_supervisor()
    r = rs.call("deploy", model_path=str(model_dir), tp=1, sampling={"temperature": 3.0})
    assert r.code == "bad_request" and "temperature must be a finite number in [0, 2]" in r.message
    rs.ok("deploy", model_path=str(model_dir), tp=1, deployment_id="s",
          sampling={"temperature": 0.0, "min_p": 0.1})
    (info,) = [read_deployment_info(d) for d in rs.ok("deployments")["deployments"]]
    got = info.sampling
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (
        0.0, 0.95, 20, 0.1, 1.0)
    assert {k: str(v) for k, v in got.origin.items()} == {
        "temperature": "operator", "top_p": "generation_config", "top_k": "generation_config",
        "min_p": "operator", "repetition_penalty": "server", "xtc_probability": "server",
        "xtc_threshold": "server"}


@pytest.mark.timeout(120)
def test_deploy_replicas_makes_one_deployment_per_replica(start_supervisor, model_dir):
    rs = start_supervisor()
    out = rs.ok("deploy", model_path=str(model_dir), tp=1, replicas=2, deployment_id="rep")
    assert [d["deployment_id"] for d in out["deployments"]] == ["rep-r0", "rep-r1"]
    assert {d["state"] for d in out["deployments"]} == {"serving"}
    infos = {d.deployment_id: d for d in map(read_deployment_info,
                                             rs.ok("deployments")["deployments"])}
    assert [(infos[i].replica, infos[i].replicas) for i in ("rep-r0", "rep-r1")] == [(0, 2), (1, 2)]
    assert infos["rep-r0"].job_id != infos["rep-r1"].job_id  # each its own launch
    # one replica alone (as `up` redeploys one): its own id; a live id is a conflict
    r = rs.call("deploy", model_path=str(model_dir), tp=1, replicas=2, replica=1,
                deployment_id="rep-r1")
    assert r.code == "conflict", r
    r = rs.call("deploy", model_path=str(model_dir), tp=1, replicas=2, replica=2)
    assert r.code == "bad_request" and "replica: must be within 0..1" in r.message, r
