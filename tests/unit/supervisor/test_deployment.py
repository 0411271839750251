"""A deployment's and a rank's mutable fields change through their own methods: a
report, a probe, an abort, a teardown recorded."""

from __future__ import annotations

from pathlib import Path

from common.messages import Phase, ProcState, Telemetry
from common.procs import ProcessIdentity
from common.records import LaunchManifest
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.plan import DeployPlan


def deployment() -> Deployment:
    plan = DeployPlan(model_path="/m/tiny", tp=1, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    return Deployment("d", "j", plan)


def test_telemetry_then_an_ack_update_the_rank() -> None:
    rs = RankState(rank=0, host="h")
    tel = Telemetry("d", "j", 0, 42, Phase.SERVING, 7, 2, 3, mem_active=5,
                    rejects={"plan.mac": 1}, error="slow")
    rs.on_telemetry(tel, now=100.0, rx=5.0)
    assert (rs.phase, rs.step, rs.active, rs.cancel_epoch, rs.mem_active) == (
        Phase.SERVING, 7, 2, 3, 5)
    assert (rs.last_seen, rs.telemetry_rx, rs.rejects, rs.error) == (100.0, 5.0,
                                                                     {"plan.mac": 1}, "slow")
    tel.rejects["plan.mac"] = 9  # a copy was kept
    assert rs.rejects == {"plan.mac": 1}
    rs.on_telemetry(Telemetry("d", "j", 0, 42, Phase.SERVING, 8, 0, 3, cache=None), 101.0, 6.0)
    assert rs.error == "slow" and rs.cache is None  # no error in a report keeps the last one
    rs.on_ack(4, now=102.0, rx=7.0)
    rs.on_ack(2, now=103.0, rx=8.0)  # an older epoch: seen, not acked
    assert (rs.acked_epoch, rs.acked_at, rs.last_seen) == (4, 7.0, 103.0)


def test_a_probe_keeps_the_last_marker_and_clears_the_last_error() -> None:
    rs = RankState(rank=1, host="b")
    rs.on_probe_failed("ssh: timed out")
    assert rs.remote_error == "ssh: timed out"
    rs.on_probe(ProcState.ALIVE, None)
    assert (rs.remote_error, rs.remote_state, rs.remote_marker) == (None, ProcState.ALIVE, None)


def test_abort_lease_and_teardown_records() -> None:
    dep = deployment()
    dep.request_abort("supervisor closing")
    dep.request_abort("stop requested")
    assert dep.abort_reason == "supervisor closing"  # the first reason asked is kept
    assert [dep.next_lease_seq() for _ in range(3)] == [1, 2, 3] and dep.lease_seq == 3
    dep.remote_files_left(["b: gone"])  # nothing recorded yet: nothing to add to
    assert dep.teardown is None
    dep.record_teardown({"proven": True})
    dep.remote_files_left([])
    dep.remote_files_left(["b: gone"])
    assert dep.teardown == {"proven": True, "remote_files_left": ["b: gone"]}
    dep.manifest = LaunchManifest(
        job_id="j", deployment_id="d", supervisor_pid=1, supervisor_start_time=0.0,
        supervisor_boot_id="boot", created_at=0.0, ranks=[], secret_path="/s")
    for i in range(25):
        written = dep.add_teardown_failure(f"attempt {i}")
    assert written is dep.manifest and len(written.teardown_failures) == 20
    assert written.teardown_failures[-1] == "attempt 24"


def test_a_rank_started_and_its_marker_read() -> None:
    rs = RankState(rank=0, host="h")
    ident = ProcessIdentity(pid=42, start_time=1.0, cmdline=("python",))
    rs.started(ident, 42, None, None, Path("/logs/j-rank0.log"))
    assert (rs.pid, rs.pgid, rs.log_path, rs.remote) == (42, 42, Path("/logs/j-rank0.log"), None)
    rs.on_marker(Phase.READY)
    assert rs.phase == Phase.READY
