"""Admission pieces: the pre-auth budget, rate-limited rejection logs, the supervisor's
report admission (routing by key id, retired launches, handshake gate), the rank's
initiator link, and sealed keys in admin replies."""

from __future__ import annotations

import logging
import secrets
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import messages as m
from common.bus import Channel
from common.deployment_info import DeploymentInfo, DeploymentInfoError
from common.envelope import PREFIX, Key, Reason, Signer
from common.frame_budget import Budget, LogLimiter
from common.handshake import Initiator, session_keys
from common.keys import KeyFileError, LaunchKeys, requests_key_of, seal_key, unseal_key
from common.rankspec import SCHEMA_VERSION, RankSpec
from common.schema import to_wire
from services.rank.auth import InitiatorLink
from services.supervisor.report_gate import ReportAdmission
from tests.support.clock import FakeClock

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_budget_refills_and_charges_big_frames_more():
    clock = FakeClock(10.0)
    b = Budget(rate=100.0, burst=10.0, clock=clock)
    for _ in range(9):
        b.charge()
    assert not b.exhausted()
    b.charge()
    assert b.exhausted() and b.pauses == 1
    assert b.resume_at() == pytest.approx(clock.now + 0.1)  # 10 tokens at 100/s
    clock.now += 0.1
    assert not b.exhausted()
    b.charge(nbytes=4 * 1024 * 1024)  # 1 + 64 tokens
    assert b.exhausted()
    assert b.resume_at() == pytest.approx(clock.now + (10 + 55) / 100.0)


def test_log_limiter_caps_and_summarises(caplog):
    clock = FakeClock(10.0)
    lim = LogLimiter(logging.getLogger("t.limit"), lines=3, period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "t.limit"):
        for i in range(1000):
            lim.warning("reject %d", i)
        clock.now += 10.0
        lim.warning("later")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[:3] == ["reject 0", "reject 1", "reject 2"]
    assert "997 more like these suppressed" in msgs[3] and msgs[4] == "later"
    assert len(msgs) == 5


def test_sealed_key_opens_only_with_the_cluster_key_and_context():
    cluster, other = Key.from_secret(b"c" * 32), Key.from_secret(b"o" * 32)
    req = Key.from_secret(b"r" * 32)
    sealed = seal_key(cluster, req, context="d/j")
    assert req.secret.hex() not in sealed
    assert unseal_key(cluster, sealed, context="d/j").secret == req.secret
    for key, ctx in ((other, "d/j"), (cluster, "d/j2")):
        with pytest.raises(KeyFileError):
            unseal_key(key, sealed, context=ctx)
    info = deployment_info("d", "j", sealed)
    assert requests_key_of(info, cluster).key_id == req.key_id
    # Only a sealed key is taken: a plaintext one (what test fakes used to send) is not.
    with pytest.raises(DeploymentInfoError) as exc:
        requests_key_of({**info, "requests_key": req.secret.hex()}, cluster)
    assert exc.value.reason == "extra_field"
    with pytest.raises(KeyFileError, match="no requests key"):
        requests_key_of({**info, "requests_key_sealed": ""}, cluster)


def deployment_info(dep: str, job: str, sealed: str) -> dict:
    return to_wire(DeploymentInfo(
        deployment_id=dep, job_id=job, state="serving", model="m", model_path="/m", tp=1,
        pp=1, backend="none", world_size=1, requests_endpoint="tcp://127.0.0.1:1",
        requests_key_sealed=sealed, canary_at=None, error=None, teardown=None, ranks=[]))


# --- supervisor report admission ------------------------------------------------------


def launch(dep: str = "dep", job: str = "job", world: int = 2):
    keys = LaunchKeys(secrets.token_bytes(32), dep, job)
    chan = Channel("supervisor", "report", sender="sup", send_key=keys.report, accept=m.REPORT)
    return SimpleNamespace(deployment_id=dep, job_id=job, world_size=world, keys=keys), chan


def rank_handshake(adm: ReportAdmission, sent: list, dep, rank: int, ident: bytes) -> Signer:
    s = Signer(dep.keys.report, f"rank-{rank}")
    up, down = session_keys(dep.keys, rank)
    init = Initiator("report", dep.deployment_id, dep.job_id, rank, ident, up, down)
    assert adm.admit([ident, s.encode(init.hello())]) is None
    chan_verify = Channel("rank", "report", sender="x", send_key=dep.keys.report,
                          accept=m.REPORT_TO_RANK)
    challenge = chan_verify.unpack(sent[-1][1]).body
    assert adm.admit([ident, s.encode(init.on_challenge(challenge))]) is None
    assert chan_verify.unpack(sent[-1][1]).body == m.AuthOk(rank=rank)
    return s


def test_report_admission_routes_authenticates_and_retires():
    sent: list[tuple[bytes, bytes]] = []
    adm = ReportAdmission(lambda ident, data: sent.append((ident, data)))
    dep, chan = launch()
    adm.add(dep.keys.report, chan, dep)
    tel = m.Telemetry("dep", "job", 1, 4242, "serving", 3, 0, 0)
    s = Signer(dep.keys.report, "rank-1")
    assert adm.admit([b"r1", s.encode(tel)]) is None  # before the handshake
    s = rank_handshake(adm, sent, dep, 1, b"r1")
    route, msg = adm.admit([b"r1", s.encode(tel)])
    assert route is dep and msg.body == tel
    forged = m.Telemetry("dep", "job", 0, 4242, "serving", 3, 0, 0)  # rank 1 speaking as 0
    assert adm.admit([b"r1", s.encode(forged)]) is None
    old, _ = launch("dep", "job-old")  # a rank of an older launch
    assert adm.admit([b"o", Signer(old.keys.report, "x").encode(tel)]) is None
    adm.drop(dep.keys.report)
    assert adm.admit([b"r1", s.encode(tel)]) is None  # the launch ended: retired_key
    counts = chan.rejects.snapshot() | adm.rejects.snapshot()
    assert counts["unauthenticated"] == 1 and counts["wrong_peer"] == 1
    assert adm.rejects.snapshot() == {"unknown_key": 1, "retired_key": 1}


@FUZZ
@given(st.lists(st.binary(max_size=120), min_size=0, max_size=4), st.booleans())
def test_fuzz_report_admission_frames(frames, with_prefix):
    """Arbitrary frames (optionally behind a live launch's key id): rejected and counted,
    never raised, never admitted."""
    adm = ReportAdmission(lambda *_: None)
    dep, chan = launch()
    adm.add(dep.keys.report, chan, dep)
    if with_prefix and len(frames) == 2:
        frames[1] = PREFIX.pack(b"LS", 1, dep.keys.report.key_id, 5) + frames[1]
    assert adm.admit(frames) is None


# --- the rank's initiator link ------------------------------------------------------------


def spec(rank: int = 1) -> RankSpec:
    return RankSpec(schema_version=SCHEMA_VERSION, deployment_id="dep", job_id="job", rank=rank,
                    world_size=2, tp=2, pp=1, host="h", model_path="/m", backend="ring",
                    home="/tmp", secret_path="/s", control_endpoint="tcp://a:1",
                    report_endpoint="tcp://a:2", plan_endpoint="tcp://a:3",
                    requests_endpoint="tcp://a:4", supervisor_pid=1)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["challenge", "ok", "plan", "ping"]),
                          st.binary(max_size=40), st.integers(-2, 3)), max_size=8))
def test_fuzz_initiator_link_trusts_nothing_unproven(seq):
    keys = LaunchKeys(b"k" * 32, "dep", "job")
    chan = Channel("rank", "plan", sender="r1", send_key=keys.plan, accept=m.PLAN_TO_FOLLOWER)
    out: list = []
    link = InitiatorLink("plan", spec(), keys, chan, b"me", out.append)
    link.timers(0.0)
    assert isinstance(out[0], m.AuthHello)
    s = Signer(keys.plan, "mallory")
    bodies = {"challenge": lambda b, i: m.AuthChallenge(b[:16].ljust(16, b"x"), b, i),
              "ok": lambda b, i: m.AuthOk(i), "plan": lambda b, i: m.Plan(i, 0, False),
              "ping": lambda b, i: m.Ping(i, 0.0)}
    for what, blob, i in seq:
        msg = chan.unpack(s.encode(bodies[what](blob, i)))
        assert link.on_message(msg) is None  # nothing passes before rank 0's proof
    assert not link.peer_verified and not link.accepted
    assert set(chan.rejects.snapshot()) <= {r.value for r in Reason}


def test_rank_keeps_its_descriptor_limit_when_mlx_lm_is_imported():
    """mlx_lm.utils lowers RLIMIT_NOFILE to (2048, 4096) on import; a rank must not lose
    its limit to that (each connection to rank 0's listening sockets is a descriptor)."""
    import subprocess
    import sys

    code = ("import resource; before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "from services.rank.limits import keep_fd_limit\n"
            "with keep_fd_limit():\n    import mlx_lm.utils\n"
            "after = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "assert after == before, (before, after)\n"
            "assert resource.setrlimit.__name__ == 'setrlimit'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
