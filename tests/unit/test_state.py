"""Atomic state files, the on-disk layout, and the manifest and marker readers."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import home as state
from common.atomic_json import StateFileError, read_json, write_json_atomic
from common.home import (
    Paths,
    manifest_path,
    marker_path,
    read_manifests,
    read_markers,
    retire_markers,
    write_manifest,
    write_marker,
)
from common.records import LaunchManifest, Phase, RankMarker, RankRecord

ROOT = Path(__file__).resolve().parents[2]


def rank_record(rank: int = 0, **kw: Any) -> RankRecord:
    base: dict[str, Any] = dict(rank=rank, host="127.0.0.1", pid=4000 + rank, pgid=4000 + rank,
                                start_time=1700000000.25, cmdline=["python", "-m", "rank"],
                                marker_dir="/x/markers/dep-1", remote=False, ssh=None)
    return RankRecord(**{**base, **kw})


def manifest(job_id: str = "job-1", **kw: Any) -> LaunchManifest:
    base: dict[str, Any] = dict(job_id=job_id, deployment_id="dep-1", supervisor_pid=321,
                                supervisor_start_time=1700000000.5, supervisor_boot_id="b00t",
                                created_at=1700000001.0, secret_path="/x/secrets/job-1.key",
                                ranks=[rank_record(0),
                                       rank_record(1, remote=True, ssh="user@h2", host="h2")])
    return LaunchManifest(**{**base, **kw})


def marker(rank: int = 0, **kw: Any) -> RankMarker:
    base: dict[str, Any] = dict(deployment_id="dep-1", job_id="job-1", rank=rank, host="h",
                                pid=5000 + rank, start_time=1700000002.0, phase=Phase.SERVING,
                                updated_at=1700000003.0, step=17, active=2, cancel_epoch=3,
                                error=None, extra={"mem": {"active_mb": 12.5, "peak": [1, 2]}})
    return RankMarker(**{**base, **kw})


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home").ensure()


def mode_of(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# --- records ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_records_round_trip_through_dicts_and_json() -> None:
    for record in (rank_record(), manifest(), manifest(teardown_failures=["rank 1 pid 9"]),
                   marker(), marker(phase=Phase.FAILED, error="stalled", extra={})):
        d = record.to_dict()
        again = type(record).from_dict(json.loads(json.dumps(d)))
        assert again == record
    assert marker().to_dict()["phase"] == "serving"
    assert f"{Phase.PEER_LOST}" == str(Phase.PEER_LOST) == "peer_lost"
    assert manifest().to_dict()["schema_version"] == 1
    # Optional on read: teardown_failures and extra.
    d = manifest().to_dict()
    del d["teardown_failures"]
    assert LaunchManifest.from_dict(d).teardown_failures == []
    # Integral numbers are accepted for float fields, and come back as floats.
    r = RankRecord.from_dict({**rank_record().to_dict(), "start_time": 1700000000})
    assert r.start_time == 1700000000.0 and type(r.start_time) is float


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_marker_extra_round_trips_any_json(extra: dict[str, Any]) -> None:
    m = marker(extra=extra)
    assert RankMarker.from_dict(json.loads(json.dumps(m.to_dict()))) == m


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("record", "field", "value"), [
    (rank_record(), "pid", "4000"),
    (rank_record(), "pid", 0),
    (rank_record(), "rank", True),
    (rank_record(), "remote", 1),
    (rank_record(), "cmdline", ["python", 3]),
    (rank_record(), "ssh", 5),
    (rank_record(), "start_time", float("nan")),
    (manifest(), "job_id", "../escape"),
    (manifest(), "deployment_id", "a/b"),
    (manifest(), "schema_version", 2),
    (manifest(), "ranks", {"0": {}}),
    (manifest(), "teardown_failures", "rank 0"),
    (marker(), "phase", "zombie"),
    (marker(), "step", -1),
    (marker(), "extra", {"t": (1, 2)}),
    (marker(), "extra", {"t": {1: "x"}}),
    (marker(), "error", ["x"]),
])
def test_from_dict_rejects_wrong_types_naming_the_field(record: Any, field: str,
                                                        value: Any) -> None:
    d = record.to_dict()
    d[field] = value
    with pytest.raises(StateFileError, match=repr(field)):
        type(record).from_dict(d, path="/some/file.json")
    # And to_dict never produces what from_dict would reject.
    bad = dataclasses.replace(record, **{field: value})
    with pytest.raises(StateFileError, match=repr(field)):
        bad.to_dict()


@pytest.mark.timeout(30)
def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    with pytest.raises(StateFileError, match="unknown field"):
        RankMarker.from_dict({**marker().to_dict(), "surprise": 1})
    d = marker().to_dict()
    del d["cancel_epoch"]
    with pytest.raises(StateFileError, match="'cancel_epoch': missing"):
        RankMarker.from_dict(d)
    d = manifest().to_dict()
    d["ranks"][1]["pgid"] = None
    with pytest.raises(StateFileError, match=r"ranks\[1\].*'pgid'"):
        LaunchManifest.from_dict(d)


# --- atomic files and modes ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_files_are_0600_from_creation_and_dirs_0700(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        opened.append((str(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", spy_open)
    old_umask = os.umask(0)  # the widest umask: modes must not depend on it
    try:
        paths = Paths(tmp_path / "home").ensure()
        target = paths.state / "x.json"
        write_json_atomic(target, {"schema_version": 1, "v": 1})
        p = write_marker(paths, marker())
    finally:
        os.umask(old_umask)
    for d in (paths.home, paths.keys_dir, paths.runtime, paths.manifests, paths.markers,
              paths.secrets, paths.logs, paths.state, paths.models, p.parent):
        assert mode_of(d) == 0o700, d
    assert mode_of(target) == 0o600 and mode_of(p) == 0o600
    temps = [(f, m) for path, f, m in opened if path.endswith(".tmp")]
    assert len(temps) == 2
    for flags, mode in temps:
        assert flags & os.O_EXCL and flags & os.O_CREAT and mode == 0o600
    assert [q.name for q in paths.state.iterdir()] == ["x.json"]  # no temp left behind


@pytest.mark.timeout(30)
def test_ensure_tightens_existing_subdirs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "runtime" / "markers").mkdir(parents=True, mode=0o755)
    os.chmod(home / "runtime" / "markers", 0o755)
    paths = Paths(home).ensure()
    assert mode_of(paths.markers) == 0o700 and mode_of(paths.runtime) == 0o700


@pytest.mark.timeout(30)
def test_paths_layout_and_default_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path / "lh"))
    p = Paths()
    assert p.home == tmp_path / "lh"
    assert p.cluster_key == p.home / "keys" / "cluster.key"
    assert p.admin_token == p.home / "admin.token"
    assert p.manifests == p.home / "runtime" / "manifests"
    assert p.secrets == p.runtime / "secrets" and p.logs == p.runtime / "logs"
    assert p.models == p.home / "models" and p.state == p.runtime / "state"
    monkeypatch.delenv("LOCKSTEP_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "u"))
    assert Paths().home == tmp_path / "u" / ".lockstep"
    assert manifest_path(p, "job-1") == p.manifests / "job-1.json"
    assert marker_path(p, "dep-1", 3) == p.markers / "dep-1" / "rank-3.json"
    for bad in ("", "..", ".hidden", "a/b", "../x", "x" * 200):
        with pytest.raises(ValueError):
            manifest_path(p, bad)
        with pytest.raises(ValueError):
            marker_path(p, bad, 0)
    with pytest.raises(ValueError):
        marker_path(p, "dep-1", -1)


@pytest.mark.timeout(30)
def test_write_json_atomic_adds_nothing_and_needs_schema_version(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="schema_version"):
        write_json_atomic(tmp_path / "a.json", {"v": 1})
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "a.json", {"schema_version": 1, "v": float("inf")})
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(tmp_path / "a.json", {"schema_version": 1, "v": 1})
    assert read_json(tmp_path / "a.json") == {"schema_version": 1, "v": 1}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("content", "reason"), [
    (None, "missing"),
    (b'{"schema_version": 1, "v": ', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "not an object"),
    (b'{"v": 1}', "no schema_version"),
    (b'{"schema_version": 2}', "unsupported schema_version 2"),
    (b'{"schema_version": "1"}', "unsupported schema_version '1'"),
    (b'{"schema_version": true}', "unsupported schema_version True"),
    (b'{"schema_version": 1, "v": NaN}', "non-JSON constant"),
    (b'{"schema_version": 1, "schema_version": 1}', "duplicate key"),
])
def test_read_json_names_the_file_and_the_reason(tmp_path: Path, content: bytes | None,
                                                 reason: str) -> None:
    target = tmp_path / "s.json"
    if content is not None:
        target.write_bytes(content)
    with pytest.raises(StateFileError) as err:
        read_json(target)
    assert err.value.path == target and reason in err.value.reason
    assert str(target) in str(err.value)


WRITER = r"""
import sys
sys.path.insert(0, sys.argv[2])
from common.atomic_json import write_json_atomic
payload = ["x" * 90] * 20000   # ~2 MB: a write takes long enough to be interrupted
seq = 0
while True:
    write_json_atomic(sys.argv[1], {"schema_version": 1, "seq": seq, "n": len(payload),
                                    "payload": payload, "end": "complete"})
    if seq == 0:
        print("ready", flush=True)
    seq += 1
"""


@pytest.mark.timeout(180)
def test_sigkill_mid_write_never_leaves_a_torn_file(tmp_path: Path) -> None:
    seed = 1201  # fixed: the kill moments still vary with scheduling, the plan does not
    rng = random.Random(seed)
    present = 0
    for round_ in range(20):
        d = tmp_path / f"round-{round_}"
        d.mkdir()
        target = d / "state.json"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(ROOT)],
                                  stdout=subprocess.PIPE)
        try:
            assert writer.stdout is not None
            if round_ % 2 == 0:
                # Wait until the loop is running, then kill it somewhere inside a write.
                ready, _, _ = select.select([writer.stdout], [], [], 30.0)
                assert ready and writer.stdout.readline() == b"ready\n", f"seed {seed}"
                time.sleep(rng.uniform(0.0, 0.05))  # the random moment, not a sync point
            else:
                time.sleep(rng.uniform(0.0, 0.4))  # may hit start-up or the first write
            writer.kill()
            writer.wait(timeout=30)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait(timeout=30)
            if writer.stdout is not None:
                writer.stdout.close()
        if target.exists():
            present += 1
            obj = read_json(target)  # raises on a torn file
            assert obj["end"] == "complete" and len(obj["payload"]) == obj["n"], f"seed {seed}"
            assert mode_of(target) == 0o600
        # Whatever else the crash left behind is a dot-named temp file.
        assert all(p.name.startswith(".state.json.") and p.name.endswith(".tmp")
                   for p in d.iterdir() if p != target), f"seed {seed}"
    assert present >= 10, f"seed {seed}: the even rounds always have a complete file"


# --- manifests and markers on disk -----------------------------------------------------


@pytest.mark.timeout(30)
def test_manifests_round_trip_and_foreign_files_are_ignored(paths: Paths) -> None:
    good = manifest("job-1")
    write_manifest(paths, good)
    for name in ("notes.txt", "job-2.json.bak", ".job-3.json.1a2b.tmp", "README"):
        (paths.manifests / name).write_text("not a manifest")
    (paths.manifests / "subdir").mkdir()
    scan = read_manifests(paths)
    assert scan.manifests == [(paths.manifests / "job-1.json", good)]
    assert scan.unreadable == []
    assert state.remove_manifest(paths, "job-1") and not state.remove_manifest(paths, "job-1")
    assert read_manifests(Paths(paths.home / "nowhere")).manifests == []


@pytest.mark.timeout(30)
def test_unreadable_and_wrong_version_manifests_are_reported(paths: Paths) -> None:
    write_manifest(paths, manifest("job-ok"))
    (paths.manifests / "job-torn.json").write_text('{"schema_version": 1, "job_id": ')
    write_json_atomic(paths.manifests / "job-v2.json", {**manifest("job-v2").to_dict(),
                                                        "schema_version": 2})
    write_json_atomic(paths.manifests / "job-renamed.json", manifest("job-other").to_dict())
    bad = manifest("job-badrank").to_dict()
    bad["ranks"][0]["pid"] = -1
    write_json_atomic(paths.manifests / "job-badrank.json", bad)
    scan = read_manifests(paths)
    assert [m.job_id for _, m in scan.manifests] == ["job-ok"]
    reasons = {p.name: r for p, r in scan.unreadable}
    assert set(reasons) == {"job-torn.json", "job-v2.json", "job-renamed.json",
                            "job-badrank.json"}
    assert "not valid JSON" in reasons["job-torn.json"]
    assert "schema_version 2" in reasons["job-v2.json"]
    assert "does not match job_id" in reasons["job-renamed.json"]
    assert "'pid'" in reasons["job-badrank.json"]
    assert all(p.parent == paths.manifests for p, _ in scan.unreadable)


@pytest.mark.timeout(30)
def test_markers_round_trip_and_only_rank_files_are_read(paths: Paths) -> None:
    m0, m1 = marker(0), marker(1, phase=Phase.READY)
    other = marker(0, deployment_id="dep-2")
    for m in (m0, m1, other):
        write_marker(paths, m)
    d = paths.markers / "dep-1"
    for name in ("rank-0.removals.jsonl", "cancel.json", "foo.json", ".rank-0.json.ab12.tmp",
                 "rank-01.json", "rank--1.json", "rank-x.json", "rank-0.json.bak",
                 "Rank-2.json", "rank-\u0663.json"):  # the last: an Arabic-Indic digit three
        (d / name).write_text("{garbage")
    (paths.markers / "rank-0.json").write_text("{garbage")  # not inside a deployment dir
    (paths.markers / ".dep-9.retired-abcd").mkdir()
    (paths.markers / ".dep-9.retired-abcd" / "rank-0.json").write_text("{garbage")
    scan = read_markers(paths, "dep-1")
    assert scan.markers == [(d / "rank-0.json", m0), (d / "rank-1.json", m1)]
    assert scan.unreadable == []
    everything = read_markers(paths)
    assert [(p.parent.name, m.rank) for p, m in everything.markers] == [
        ("dep-1", 0), ("dep-1", 1), ("dep-2", 0)]
    assert everything.unreadable == []
    assert read_markers(paths, "dep-none").markers == []


@pytest.mark.timeout(30)
def test_unreadable_markers_are_reported_never_guessed(paths: Paths) -> None:
    write_marker(paths, marker(0))
    d = paths.markers / "dep-1"
    (d / "rank-1.json").write_text('{"schema_version": 1, "rank": 1')
    write_json_atomic(d / "rank-2.json", {**marker(2).to_dict(), "schema_version": 7})
    write_json_atomic(d / "rank-3.json", marker(4).to_dict())  # content says rank 4
    (d / "rank-5.json").mkdir()  # a marker name that is not a file
    os.mkfifo(d / "rank-6.json")  # must not hang the reader
    foreign = paths.markers / "dep-2"
    foreign.mkdir()
    write_json_atomic(foreign / "rank-0.json", marker(0).to_dict())  # says dep-1
    scan = read_markers(paths)
    assert [m.rank for _, m in scan.markers] == [0]
    reasons = {str(p.relative_to(paths.markers)): r for p, r in scan.unreadable}
    assert set(reasons) == {"dep-1/rank-1.json", "dep-1/rank-2.json", "dep-1/rank-3.json",
                            "dep-1/rank-5.json", "dep-1/rank-6.json", "dep-2/rank-0.json"}
    assert "not valid JSON" in reasons["dep-1/rank-1.json"]
    assert "schema_version 7" in reasons["dep-1/rank-2.json"]
    assert "does not match its path" in reasons["dep-1/rank-3.json"]
    assert "not a regular file" in reasons["dep-1/rank-5.json"]
    assert "not a regular file" in reasons["dep-1/rank-6.json"]
    assert "does not match its path" in reasons["dep-2/rank-0.json"]


@pytest.mark.timeout(30)
def test_retire_markers_removes_the_deployment_directory(paths: Paths) -> None:
    write_marker(paths, marker(0))
    write_marker(paths, marker(0, deployment_id="dep-2"))
    (paths.markers / "dep-1" / "rank-0.removals.jsonl").write_text("{}\n")
    assert retire_markers(paths, "dep-1")
    assert not (paths.markers / "dep-1").exists()
    assert not retire_markers(paths, "dep-1")
    assert [p.name for p in paths.markers.iterdir()] == ["dep-2"]
    assert [m.deployment_id for _, m in read_markers(paths).markers] == ["dep-2"]
