"""Each cross-process record has one strict reader, and it refuses what its writer does
not write: another schema version, a missing field, an unknown key (e.g. the
`admin_endpoint` spelling nothing writes), with an error naming the file (or, for the
DeploymentInfo on the admin wire, the deployment)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from common.atomic_json import StateFileError
from common.deployment_info import DeploymentInfoError, read_deployment_info
from common.envelope import Key
from common.home import (
    Paths,
    read_manifests,
    read_markers,
    read_supervisor_record,
    write_manifest,
    write_marker,
    write_supervisor_record,
)
from common.keys import LaunchKeys, requests_key_of
from common.messages.commands import ReplyError
from common.procs import identify
from common.records import LaunchManifest, Phase, RankMarker, RankRecord, SupervisorRecord
from services.admin.cli import human
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.homelock import SupervisorBusy, hold_home_lock
from services.supervisor.plan import DeployPlan
from services.up.preflight import supervisor_busy

SUP = SupervisorRecord(pid=4242, boot_id="b" * 32, start_time=1700000000.5,
                       admin="tcp://127.0.0.1:5001", events="tcp://127.0.0.1:5002",
                       control="tcp://127.0.0.1:5003", report="tcp://127.0.0.1:5004")
MANIFEST = LaunchManifest(
    job_id="job-1", deployment_id="dep-1", supervisor_pid=4242, supervisor_start_time=1.5,
    supervisor_boot_id="b", created_at=2.0, secret_path="/s",
    ranks=[RankRecord(rank=0, host="127.0.0.1", pid=10, pgid=10, start_time=3.0,
                      cmdline=["python"], marker_dir="/m", remote=False)])
MARKER = RankMarker(deployment_id="dep-1", job_id="job-1", rank=0, host="127.0.0.1", pid=10,
                    start_time=3.0, phase=Phase.SERVING, updated_at=4.0)


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home").ensure()


def _rewrite(path: Path, change) -> None:
    """Edit a record file in place (as damage, a foreign writer or an old version would)."""
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def _supervisor(paths: Paths) -> tuple[Path, Any]:
    write_supervisor_record(paths.supervisor_file, SUP)
    return paths.supervisor_file, lambda: read_supervisor_record(paths.supervisor_file)


def _manifest(paths: Paths) -> tuple[Path, Any]:
    p = write_manifest(paths, MANIFEST)

    def read() -> LaunchManifest:
        scan = read_manifests(paths)
        if scan.unreadable:
            raise StateFileError(*scan.unreadable[0])
        return scan.manifests[0][1]
    return p, read


def _marker(paths: Paths) -> tuple[Path, Any]:
    p = write_marker(paths, MARKER)

    def read() -> RankMarker:
        scan = read_markers(paths, "dep-1")
        if scan.unreadable:
            raise StateFileError(*scan.unreadable[0])
        return scan.markers[0][1]
    return p, read


RECORDS = {"supervisor.json": (_supervisor, SUP), "manifest": (_manifest, MANIFEST),
           "marker": (_marker, MARKER)}
DAMAGE = {
    "wrong_version": (lambda d: d.update(schema_version=2), "schema_version"),
    "missing_field": (lambda d: d.pop("supervisor_pid" if "ranks" in d else "pid"),
                      "pid': missing"),
    "unknown_key": (lambda d: d.update(admin_endpoint="tcp://x:1"), "unknown field"),
    "not_an_object": (lambda d: d.clear(), "schema_version"),
}


@pytest.mark.parametrize("record", sorted(RECORDS))
def test_each_record_reads_back_what_its_writer_wrote(paths: Paths, record: str) -> None:
    make, expected = RECORDS[record]
    path, read = make(paths)
    assert read() == expected
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("record", sorted(RECORDS))
def test_each_reader_refuses_what_no_writer_writes_naming_the_file(
        paths: Paths, record: str, damage: str) -> None:
    make, _ = RECORDS[record]
    path, read = make(paths)
    change, says = DAMAGE[damage]
    _rewrite(path, change)
    with pytest.raises(StateFileError) as exc:
        read()
    assert exc.value.path == path and str(path) in str(exc.value)
    assert says in exc.value.reason


def test_supervisor_record_missing_is_named(paths: Paths) -> None:
    with pytest.raises(StateFileError) as exc:
        read_supervisor_record(paths.supervisor_file)
    assert exc.value.reason == "missing" and exc.value.path == paths.supervisor_file
    assert paths.supervisor_file == paths.runtime / "supervisor.json"


# --- DeploymentInfo, on the admin wire ----------------------------------------------


def _deployment(cluster: Key) -> tuple[Deployment, LaunchKeys]:
    keys = LaunchKeys(secrets.token_bytes(32), "dep-1", "job-1")
    plan = DeployPlan(model_path="/models/tiny", tp=2, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    dep = Deployment(deployment_id="dep-1", job_id="job-1", plan=plan, initial="serving",
                     keys=keys, requests_endpoint="tcp://127.0.0.1:6000",
                     canary_at=5.0, error=None, teardown={"path": ["term"], "ok": True},
                     ranks={0: RankState(rank=0, host="127.0.0.1", rejects={"plan.mac": 1}),
                            1: RankState(rank=1, host="127.0.0.1")})
    return dep, keys


def test_the_supervisors_deployment_info_reads_strictly_and_its_key_opens() -> None:
    cluster = Key.from_secret(b"c" * 32)
    dep, keys = _deployment(cluster)
    wire = dep.to_wire(cluster_key=cluster)  # exactly what `status` / `deployments` send
    info = read_deployment_info(wire)
    assert (info.deployment_id, info.job_id, info.state, info.world_size) == \
        ("dep-1", "job-1", "serving", 2)
    assert [r.rank for r in info.ranks] == [0, 1] and info.ranks[0].rejects == {"plan.mac": 1}
    assert requests_key_of(info, cluster).key_id == keys.requests.key_id
    assert requests_key_of(wire, cluster).key_id == keys.requests.key_id


@pytest.mark.parametrize(("change", "reason"), [
    (lambda d: d.pop("requests_endpoint"), "missing_field"),
    (lambda d: d.update(requests_key="00" * 32), "extra_field"),  # plaintext: never taken
    (lambda d: d.update(tp="2"), "wrong_type"),
    (lambda d: d["ranks"][0].pop("phase"), "missing_field"),
    (lambda d: d["ranks"][0].update(colour="red"), "extra_field"),
])
def test_deployment_info_reader_refuses_what_the_supervisor_does_not_send(change,
                                                                         reason: str) -> None:
    cluster = Key.from_secret(b"c" * 32)
    wire = _deployment(cluster)[0].to_wire(cluster_key=cluster)
    change(wire)
    with pytest.raises(DeploymentInfoError) as exc:
        read_deployment_info(wire)
    assert exc.value.reason == reason and exc.value.deployment_id == "dep-1"
    assert "dep-1" in str(exc.value)


def test_admin_cli_prints_deployments_through_the_strict_reader() -> None:
    cluster = Key.from_secret(b"c" * 32)
    wire = _deployment(cluster)[0].to_wire(cluster_key=cluster)
    out = human("deployments", {"deployments": [wire]})
    assert out.splitlines()[0].startswith("dep-1  serving")
    assert "tp=2 pp=1 backend=ring job=job-1" in out and "rank 1 pid 0" in out
    with pytest.raises(ReplyError, match="deployments reply: extra_field: "
                       r"deployments\[\]\.requests_key"):
        human("deployments", {"deployments": [{**wire, "requests_key": "00" * 32}]})


def test_up_preflight_and_the_home_lock_name_the_supervisor_from_its_record(
        paths: Paths) -> None:
    me = identify(os.getpid())
    assert me is not None
    rec = SupervisorRecord(pid=me.pid, boot_id="b", start_time=me.start_time,
                           admin="tcp://127.0.0.1:5001", events="", control="", report="")
    write_supervisor_record(paths.supervisor_file, rec)
    # Lock free, but the record names a live process (as a supervisor without the lock
    # would): preflight says who, from the record.
    assert f"(pid {me.pid}, admin tcp://127.0.0.1:5001;" in (supervisor_busy(paths) or "")
    fd = hold_home_lock(paths)
    try:
        with pytest.raises(SupervisorBusy, match=f"pid {me.pid}, admin tcp://127.0.0.1:5001"):
            hold_home_lock(paths)
        _rewrite(paths.supervisor_file, lambda d: d.update(admin_endpoint=d.pop("admin")))
        with pytest.raises(SupervisorBusy) as exc:  # the lock is the evidence: still refused
            hold_home_lock(paths)
        assert "admin" not in str(exc.value).split(str(paths.home))[1]
    finally:
        os.close(fd)
    assert supervisor_busy(paths) is None  # a record it refuses names nobody
