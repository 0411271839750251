"""reap_orphans on hand-made manifests: identity rules, failures, markers, seams.

Processes here are real (`sleep`, this test process) but no launcher runs; the
integration tests drive the whole flow with a fake supervisor."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
import time
from pathlib import Path

import pytest

from common.atomic_json import read_json
from common.home import Paths, manifest_path, marker_dir, write_manifest, write_marker
from common.messages import Event
from common.procs import identify
from common.records import LaunchManifest, Phase, RankMarker, RankRecord
from services.reaper.reap import REMOTE_UNAVAILABLE, reap_orphans, supervisor_state
from tests.fakes.procwatch import poll_for, process_gone, process_running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home").ensure()


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        argv = list(args or ("sleep", "600"))
        p = subprocess.Popen(argv, start_new_session=True)
        procs.append(p)
        # Popen returns before /proc shows the new argv: wait for it, as a launcher must.
        poll_for(f"pid {p.pid} to show its argv",
                 lambda: getattr(identify(p.pid), "cmdline", None) == tuple(argv), 10,
                 interval=0.002)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _manifest(paths: Paths, job: str, *, ranks: list[RankRecord], sup_pid: int | None = None,
              sup_start: float | None = None, dep: str | None = None) -> LaunchManifest:
    me = identify(os.getpid())
    assert me is not None
    secret = paths.secrets / f"{job}.key"
    secret.write_text("00" * 32)
    m = LaunchManifest(job_id=job, deployment_id=dep or f"dep-{job}",
                       supervisor_pid=sup_pid or _dead_pid(),
                       supervisor_start_time=me.start_time if sup_start is None else sup_start,
                       supervisor_boot_id="test", created_at=time.time(), ranks=ranks,
                       secret_path=str(secret))
    write_manifest(paths, m)
    return m


def _rank(paths: Paths, pid: int, *, rank: int = 0, remote: bool = False, dep: str = "dep",
          start_shift: float = 0.0, cmdline: list[str] | None = None,
          pgid: int | None = None) -> RankRecord:
    ident = identify(pid)
    start = ident.start_time if ident else time.time() - 1000
    cmd = list(ident.cmdline) if ident else ["gone"]
    return RankRecord(rank=rank, host="h-b" if remote else "localhost", pid=pid,
                      pgid=pgid if pgid is not None else pid, start_time=start + start_shift,
                      cmdline=cmdline if cmdline is not None else cmd,
                      marker_dir=str(marker_dir(paths, dep)), remote=remote,
                      ssh="root@h-b" if remote else None)


def _marker(paths: Paths, dep: str, rank: int, pid: int, start_time: float) -> None:
    write_marker(paths, RankMarker(deployment_id=dep, job_id="j", rank=rank, host="localhost",
                                   pid=pid, start_time=start_time, phase=Phase.SERVING,
                                   updated_at=time.time()))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[object, int]] = []

    def __call__(self, target: object, sig: int) -> None:
        self.calls.append((target, sig))


def test_live_supervisor_job_is_untouched(paths: Paths, spawn) -> None:
    rank = spawn()
    me = identify(os.getpid())
    m = _manifest(paths, "live", ranks=[_rank(paths, rank.pid)], sup_pid=me.pid,
                  sup_start=me.start_time)
    _marker(paths, m.deployment_id, 0, rank.pid, identify(rank.pid).start_time)
    before = manifest_path(paths, "live").read_bytes()
    kill = Recorder()
    report = reap_orphans(paths, kill=kill, term_timeout=0.2, kill_timeout=0.2)
    assert report.active == ["live"] and not report.reaped and not report.blocking
    assert kill.calls == []
    assert process_running(rank.pid)
    assert manifest_path(paths, "live").read_bytes() == before
    assert marker_dir(paths, m.deployment_id).is_dir()
    assert Path(m.secret_path).exists()


def test_dead_supervisor_reaped_and_state_cleared(paths: Paths, spawn) -> None:
    ranks = [spawn(), spawn()]
    m = _manifest(paths, "dead", ranks=[_rank(paths, p.pid, rank=i) for i, p in enumerate(ranks)])
    for i, p in enumerate(ranks):
        _marker(paths, m.deployment_id, i, p.pid, identify(p.pid).start_time)
    events: list[Event] = []
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2, publish=events.append)
    assert report.reaped == ["dead"] and not report.blocking
    for p in ranks:
        assert p.wait(timeout=5) == -15  # ended by the SIGTERM step
    assert not manifest_path(paths, "dead").exists()
    assert not Path(m.secret_path).exists()
    assert not marker_dir(paths, m.deployment_id).exists()
    assert report.retired_markers == [m.deployment_id]
    names = [e.name for e in events]
    assert names == ["reaped", "pass"]
    assert events[0].data["path"] == ["sigterm"] and events[-1].data["reaped"] == ["dead"]


def test_reused_supervisor_pid_is_dead(paths: Paths, spawn) -> None:
    other = spawn()  # an unrelated live process now holds the supervisor's pid
    rank = spawn()
    m = _manifest(paths, "reused", ranks=[_rank(paths, rank.pid)], sup_pid=other.pid,
                  sup_start=identify(other.pid).start_time - 50)
    alive, why = supervisor_state(m)
    assert not alive and "reused" in why
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2)
    assert report.reaped == ["reused"]
    assert rank.wait(timeout=5) == -15
    assert process_running(other.pid)  # the pid's new owner is never signalled


def test_reused_rank_pid_is_not_signalled(paths: Paths, spawn) -> None:
    stranger = spawn()  # holds the recorded pid, started at another time
    _manifest(paths, "stale", ranks=[_rank(paths, stranger.pid, start_shift=-30)])
    kill = Recorder()
    report = reap_orphans(paths, kill=kill, term_timeout=0.2, kill_timeout=0.2)
    assert kill.calls == []  # neither the pid nor its group
    assert report.reaped == ["stale"]  # the recorded rank is gone: cleared as stale
    assert process_running(stranger.pid)
    assert not manifest_path(paths, "stale").exists()


@pytest.mark.parametrize("recorded", [[], ["python", "-m", "services.rank"]])
def test_ambiguous_identity_is_neither_signalled_nor_cleared(paths: Paths, spawn,
                                                             recorded: list[str]) -> None:
    """pid and start time match, the command line does not (e.g. read mid-exec, when
    /proc shows it empty): not proven to be the rank, not proven gone either."""
    proc = spawn()
    _manifest(paths, "amb", ranks=[_rank(paths, proc.pid, cmdline=recorded)])
    kill = Recorder()
    report = reap_orphans(paths, kill=kill, term_timeout=0.2, kill_timeout=0.2)
    assert kill.calls == [] and process_running(proc.pid)
    assert report.blocking and "identity ambiguous" in report.failures[0]["reason"]
    assert manifest_path(paths, "amb").exists()


def test_reused_pgid_is_never_signalled(paths: Paths, spawn) -> None:
    leader = spawn()  # an unrelated group leader now owns the recorded pgid
    rec = _rank(paths, _dead_pid(), pgid=leader.pid)
    _manifest(paths, "pgid", ranks=[rec])
    kill = Recorder()
    report = reap_orphans(paths, kill=kill, term_timeout=0.2, kill_timeout=0.2)
    assert kill.calls == [] and report.reaped == ["pgid"]
    assert process_running(leader.pid)


def test_unkillable_rank_keeps_manifest_with_failure(paths: Paths, spawn) -> None:
    rank = spawn()
    m = _manifest(paths, "stuck", ranks=[_rank(paths, rank.pid)])
    _marker(paths, m.deployment_id, 0, rank.pid, identify(rank.pid).start_time)
    kill = Recorder()  # signals "sent" but nothing happens: the rank survives every step
    report = reap_orphans(paths, kill=kill, term_timeout=0.1, kill_timeout=0.1)
    assert report.blocking and not report.reaped
    (failure,) = report.failures
    assert failure["job_id"] == "stuck" and str(rank.pid) in failure["reason"]
    assert failure["survivors"] == [{"rank": 0, "host": "localhost", "pid": rank.pid}]
    assert [s for _, s in kill.calls] == [15, 9, 9]
    kept = LaunchManifest.from_dict(read_json(manifest_path(paths, "stuck")))
    assert len(kept.teardown_failures) == 1 and "sigkill-retry" in kept.teardown_failures[0]
    assert Path(m.secret_path).exists() and marker_dir(paths, m.deployment_id).is_dir()
    assert "job stuck not reaped" in report.blockers()
    # The next pass retries and, with real signals, resolves it.
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2)
    assert report.reaped == ["stuck"] and not report.blocking
    assert not manifest_path(paths, "stuck").exists()
    assert not marker_dir(paths, m.deployment_id).exists()


def test_failure_records_are_bounded(paths: Paths, spawn) -> None:
    rank = spawn()
    _manifest(paths, "stuck", ranks=[_rank(paths, rank.pid)])
    for _ in range(25):
        reap_orphans(paths, kill=Recorder(), term_timeout=0.0, kill_timeout=0.0)
    kept = LaunchManifest.from_dict(read_json(manifest_path(paths, "stuck")))
    assert len(kept.teardown_failures) == 20


def test_remote_ranks_without_runner_fail_clearly(paths: Paths, spawn) -> None:
    local = spawn()
    _manifest(paths, "rem", ranks=[_rank(paths, local.pid, rank=0),
                                   _rank(paths, 4242, rank=1, remote=True)])
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2)
    (failure,) = report.failures
    assert REMOTE_UNAVAILABLE in failure["reason"] and "h-b" in failure["reason"]
    assert failure["survivors"] == [{"rank": 1, "host": "h-b", "pid": 4242}]
    assert local.wait(timeout=5) == -15  # the local rank is still reaped
    assert manifest_path(paths, "rem").exists()


def test_remote_runner_seam(paths: Paths) -> None:
    _manifest(paths, "rem", ranks=[_rank(paths, 4242, rank=1, remote=True)])
    seen = []

    def failing(manifest, ranks, *, term_timeout, kill_timeout):
        seen.append([r.rank for r in ranks])
        raise OSError("ssh: connect to host h-b: No route to host")

    report = reap_orphans(paths, remote=failing)
    assert "No route to host" in report.failures[0]["reason"] and seen == [[1]]
    report = reap_orphans(paths, remote=lambda m, r, **kw: [])
    assert report.reaped == ["rem"] and not manifest_path(paths, "rem").exists()


def test_unreadable_manifest_blocks_and_is_named(paths: Paths, spawn) -> None:
    bad = paths.manifests / "broken.json"
    bad.write_text('{"schema_version": 1, "job_id": ')
    wrong = paths.manifests / "other.json"
    wrong.write_text('{"schema_version": 7}')
    rank = spawn()
    _manifest(paths, "orphan", ranks=[_rank(paths, rank.pid)])
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2)
    assert report.blocking and report.reaped == ["orphan"]  # readable ones still reaped
    assert {u["path"] for u in report.unreadable} == {str(bad), str(wrong)}
    assert "not valid JSON" in next(u["error"] for u in report.unreadable if u["path"] == str(bad))
    assert str(bad) in report.blockers() and str(wrong) in report.blockers()
    assert bad.exists() and wrong.exists()  # never removed, never guessed


def test_marker_sweep(paths: Paths, spawn) -> None:
    live = spawn()
    live_start = identify(live.pid).start_time
    _marker(paths, "dead-owners", 0, _dead_pid(), time.time() - 100)
    _marker(paths, "dead-owners", 1, live.pid, live_start - 40)  # pid reused: owner dead
    _marker(paths, "live-owner", 0, _dead_pid(), time.time() - 100)
    _marker(paths, "live-owner", 1, live.pid, live_start)
    _marker(paths, "unreadable", 0, _dead_pid(), time.time() - 100)
    (marker_dir(paths, "unreadable") / "rank-1.json").write_text("{nope")
    marker_dir(paths, "young-empty").mkdir()
    old = marker_dir(paths, "old-empty")
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    me = identify(os.getpid())
    _manifest(paths, "act", ranks=[], sup_pid=me.pid, sup_start=me.start_time, dep="active")
    _marker(paths, "active", 0, _dead_pid(), time.time() - 100)  # an active job's: kept
    report = reap_orphans(paths)
    assert sorted(report.retired_markers) == ["dead-owners", "old-empty"]
    left = sorted(p.name for p in paths.markers.iterdir())
    assert left == ["active", "live-owner", "unreadable", "young-empty"]
    assert [u["path"] for u in report.unreadable_markers] == [
        str(marker_dir(paths, "unreadable") / "rank-1.json")]
    assert not report.blocking  # unreadable markers inform; they do not block launches


def test_unreadable_manifest_stops_marker_sweep(paths: Paths) -> None:
    (paths.manifests / "broken.json").write_text("garbage")
    _marker(paths, "dead-owners", 0, _dead_pid(), time.time() - 100)
    report = reap_orphans(paths)
    assert report.retired_markers == [] and marker_dir(paths, "dead-owners").is_dir()


def test_publish_errors_do_not_break_a_pass(paths: Paths, spawn) -> None:
    rank = spawn()
    _manifest(paths, "j", ranks=[_rank(paths, rank.pid)])

    def broken(event: Event) -> None:
        raise RuntimeError("bus down")

    assert reap_orphans(paths, publish=broken, term_timeout=2, kill_timeout=2).reaped == ["j"]


def test_concurrent_pass_waits_for_lock(paths: Paths, spawn) -> None:
    rank = spawn()
    _manifest(paths, "j", ranks=[_rank(paths, rank.pid)])
    fd = os.open(paths.state / "reap.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        report = reap_orphans(paths, lock_timeout=0.3)
    finally:
        os.close(fd)
    assert report.blocking and "reap.lock" in report.failures[0]["reason"]
    assert process_running(rank.pid) and manifest_path(paths, "j").exists()
    assert reap_orphans(paths, term_timeout=2, kill_timeout=2).reaped == ["j"]


def test_secret_outside_secrets_dir_is_kept(paths: Paths, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.key"
    outside.write_text("x")
    m = _manifest(paths, "j", ranks=[])
    write_manifest(paths, dataclasses.replace(m, secret_path=str(outside)))
    assert reap_orphans(paths).reaped == ["j"]
    assert outside.exists()


def test_report_dict_shape(paths: Paths) -> None:
    d = reap_orphans(paths).to_dict()
    assert {"reaped", "active", "failures", "unreadable", "blocking"} <= set(d)
    assert d["blocking"] is False
    assert process_gone(_dead_pid())


def test_disk_errors_are_failures_not_exceptions(paths: Paths, spawn, monkeypatch) -> None:
    import services.reaper.reap as reap_mod

    def cannot(*a, **kw):
        raise PermissionError(13, "Permission denied")

    rank = spawn()
    _manifest(paths, "j", ranks=[_rank(paths, rank.pid)])
    monkeypatch.setattr(reap_mod, "remove_manifest", cannot)
    report = reap_orphans(paths, term_timeout=2, kill_timeout=2)
    assert report.blocking and "Permission denied" in report.failures[0]["reason"]
    assert rank.wait(timeout=5) == -15  # the ranks were still reaped
    monkeypatch.setattr(reap_mod, "_pass_lock", cannot)
    report = reap_orphans(paths)
    assert report.blocking and "reap pass failed" in report.failures[0]["reason"]
