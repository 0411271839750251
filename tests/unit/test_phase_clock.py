"""The phase clock (services/rank/phase_clock.py): per-thread tallies summed on read,
carried in rank telemetry, through the supervisor's DeploymentInfo, out as the
gateway's `lockstep_rank_phase_*_total` counters."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from prometheus_client import generate_latest

from common.deployment_info import DeploymentInfo, RankInfo
from common.messages import Backend, DeploymentState, PhaseTimes, Telemetry
from common.schema import decode_into, to_wire
from services.gateway.core.metrics import Metrics
from services.rank.phase_clock import LoopPhase, PhaseClock
from services.supervisor.deployment import RankState


def test_a_tally_adds_seconds_and_runs_and_hands_on_its_end():
    clock = PhaseClock()
    t = clock.tally()
    assert clock.snapshot() == PhaseTimes()  # nothing ran: no phase listed
    t0 = t.now()
    time.sleep(0.01)
    t1 = t.add(LoopPhase.PLAN, t0)
    t.add(LoopPhase.STEP, t1)
    t.add(LoopPhase.STEP, t.now())
    snap = clock.snapshot()
    assert set(snap.seconds) == set(snap.counts) == {"plan", "step"}
    assert snap.counts == {"plan": 1, "step": 2}
    assert 0.01 <= snap.seconds["plan"] < 5 and 0 <= snap.seconds["step"] < snap.seconds["plan"]


def test_threads_each_write_their_own_tally_and_a_read_sums_them_exactly():
    clock = PhaseClock()
    n, runs = 4, 5000
    go = threading.Barrier(n + 1)

    def work(phase: LoopPhase) -> None:
        t = clock.tally()
        go.wait(10)
        for _ in range(runs):
            t.add(phase, t.now())

    phases = [LoopPhase.STEP, LoopPhase.STEP, LoopPhase.SIGN_SEND_TOKENS, LoopPhase.DRAIN]
    threads = [threading.Thread(target=work, args=(p,)) for p in phases]
    for th in threads:
        th.start()
    go.wait(10)
    mid = clock.snapshot()  # while they count: never more than was done
    assert all(v <= 2 * runs for v in mid.counts.values())
    for th in threads:
        th.join(30)
    snap = clock.snapshot()
    assert snap.counts == {"step": 2 * runs, "sign_send_tokens": runs, "drain": runs}


def test_telemetry_carries_the_phases_and_an_older_one_without_them_still_decodes():
    phases = PhaseTimes(seconds={"step": 1.25, "emit": 0.5}, counts={"step": 10, "emit": 10})
    tel = Telemetry("d", "j", 0, 1, "serving", 10, 0, 0, phases=phases)
    assert decode_into(Telemetry, to_wire(tel)) == tel
    old = to_wire(tel)
    del old["phases"]
    assert decode_into(Telemetry, old).phases is None


def test_the_gateway_exports_each_ranks_phases_as_counters():
    rs0 = RankState(rank=0, host="h", phases=PhaseTimes(
        seconds={"step": 1.5, "sign_send_tokens": 0.25}, counts={"step": 3, "sign_send_tokens": 3}))
    ranks = [rs0.to_wire(), RankState(rank=1, host="h").to_wire()]  # rank 1: no telemetry yet
    for r in ranks:  # what the supervisor sends is what the gateway's reader accepts
        assert decode_into(RankInfo, r).phases == (rs0.phases if r["rank"] == 0 else None)
    m = Metrics()
    info = DeploymentInfo(deployment_id="dep", job_id="j", state=DeploymentState.SERVING,
                          model="x", model_path="/m", tp=2, pp=1, backend=Backend.RING,
                          world_size=2, requests_endpoint="", requests_key_sealed="",
                          canary_at=None, error=None, teardown=None,
                          ranks=[decode_into(RankInfo, r) for r in ranks])
    m.cluster = SimpleNamespace(backends={}, status=None, supervisor_error=None,
                                reaper_rejections=[], deployments={"dep": info})
    text = generate_latest(m.registry).decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
             for ln in text.splitlines() if ln.startswith("lockstep_rank_phase_")}
    assert lines == {
        'lockstep_rank_phase_seconds_total{deployment="dep",phase="step",rank="0"}': 1.5,
        'lockstep_rank_phase_seconds_total{deployment="dep",phase="sign_send_tokens",rank="0"}':
            0.25,
        'lockstep_rank_phase_runs_total{deployment="dep",phase="step",rank="0"}': 3.0,
        'lockstep_rank_phase_runs_total{deployment="dep",phase="sign_send_tokens",rank="0"}': 3.0,
    }


def test_the_bench_turns_two_reads_into_microseconds_per_token():
    from bench.rank_metrics import phase_us_per_token, series

    text = "\n".join([
        '# TYPE lockstep_rank_phase_seconds_total counter',
        'lockstep_rank_phase_seconds_total{deployment="d",phase="step",rank="0"} 2.5',
        'lockstep_rank_phase_seconds_total{deployment="d",phase="emit",rank="0"} 0.5',
        'lockstep_rank_phase_seconds_total{deployment="d",phase="step",rank="1"} 2.0',
        'lockstep_rank_telemetry_age_seconds{deployment="d",rank="0"} 0.3'])
    after = series(text, "lockstep_rank_phase_seconds_total")
    assert after == {"0": {"step": 2.5, "emit": 0.5}, "1": {"step": 2.0}}
    assert series(text, "lockstep_rank_telemetry_age_seconds") == {"0": {"": 0.3}}
    # a phase absent from the first read had not run yet: it counts from 0
    assert phase_us_per_token({"0": {"step": 0.5}}, after, 1000) == {
        "rank_0": {"emit": 500.0, "step": 2000.0}, "rank_1": {"step": 2000.0}}
    assert phase_us_per_token(None, after, 1000) is None  # no fresh read: no figure
