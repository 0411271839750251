"""Where Lockstep keeps its state ($LOCKSTEP_HOME), and the records on disk there: launch
manifests and rank markers (DESIGN section 4) and the supervisor's runtime file. Each is
written atomically (common.atomic_json) and has one strict reader here (the record types
are in common.records), which every process uses. Readers report what they cannot read,
with its path; they never guess.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic_json import StateFileError, fsync_dir, read_json, write_json_atomic
from common.records import (
    ID_RE,
    AdoptionRecord,
    LaunchManifest,
    RankMarker,
    RedeployRecord,
    SupervisorRecord,
)

# Exactly what write_marker writes; [0-9] not \d, which also matches non-ASCII digits.
_MARKER_RE = re.compile(r"rank-(0|[1-9][0-9]{0,5})\.json")


# --- layout ---------------------------------------------------------------------------


def default_home() -> Path:
    """$LOCKSTEP_HOME (~ expanded), else ~/.lockstep: the one place this is decided."""
    env = os.environ.get("LOCKSTEP_HOME")
    return Path(env).expanduser() if env else Path.home() / ".lockstep"


@dataclass(frozen=True)
class Paths:
    """The directory layout under $LOCKSTEP_HOME (default ~/.lockstep)."""

    home: Path = field(default_factory=default_home)
    keys_dir: Path = field(init=False)
    cluster_key: Path = field(init=False)
    admin_token: Path = field(init=False)
    runtime: Path = field(init=False)
    manifests: Path = field(init=False)
    markers: Path = field(init=False)
    secrets: Path = field(init=False)
    logs: Path = field(init=False)
    state: Path = field(init=False)
    models: Path = field(init=False)
    supervisor_file: Path = field(init=False)
    adoption_file: Path = field(init=False)
    redeploy_file: Path = field(init=False)

    def __post_init__(self) -> None:
        home = Path(self.home).expanduser().absolute()  # a later chdir cannot move it
        runtime = home / "runtime"
        layout = {"home": home, "keys_dir": home / "keys",
                  "cluster_key": home / "keys" / "cluster.key",
                  "admin_token": home / "admin.token", "runtime": runtime,
                  "manifests": runtime / "manifests", "markers": runtime / "markers",
                  "secrets": runtime / "secrets", "logs": runtime / "logs",
                  "state": runtime / "state", "models": home / "models",
                  "supervisor_file": runtime / "supervisor.json",
                  "adoption_file": runtime / "adoption.json",
                  "redeploy_file": runtime / "redeploy.json"}
        for name, value in layout.items():
            object.__setattr__(self, name, value)

    def ensure(self) -> Paths:
        """Create every directory, mode 0700. A pre-existing home keeps its mode; the
        directories below it are ours and are tightened to 0700."""
        if not self.home.exists():
            _mkdir_private(self.home)
        for d in (self.keys_dir, self.runtime, self.manifests, self.markers, self.secrets,
                  self.logs, self.state, self.models):
            _mkdir_private(d)
        return self


def _mkdir_private(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask, and skips existing dirs


# --- the supervisor's runtime file ---------------------------------------------------


def write_supervisor_record(path: Path, record: SupervisorRecord) -> None:
    write_json_atomic(path, record.to_dict())


def read_supervisor_record(path: Path) -> SupervisorRecord:
    """The running supervisor as its runtime file names it (`Paths.supervisor_file`, or
    the gateway's configured path); StateFileError, naming the file, if it is missing or
    is not exactly a SupervisorRecord of this version."""
    path = Path(path)
    return SupervisorRecord.from_dict(read_json(path), path=path)


# --- the adoption record (`lockstep up` restarts a supervisor that dies) ------------


def write_adoption_record(path: Path, record: AdoptionRecord) -> None:
    write_json_atomic(path, record.to_dict())


def read_adoption_record(path: Path) -> AdoptionRecord | None:
    """The record, or None if there is none; StateFileError if it is malformed."""
    path = Path(path)
    if not path.exists():
        return None
    return AdoptionRecord.from_dict(read_json(path), path=path)


def live_adoption_record(path: Path) -> AdoptionRecord | None:
    """The adoption record while the `up` that wrote it runs (pid + start time); None
    otherwise, an unreadable record included (it cannot hold anything back)."""
    try:
        rec = read_adoption_record(path)
    except (StateFileError, OSError):
        return None
    return rec if rec is not None and _up_lives(rec.up_pid, rec.up_start_time) else None


def _up_lives(pid: int, start_time: float) -> bool:
    from common.procs import START_TIME_TOLERANCE, identify

    who = identify(pid)
    return who is not None and abs(who.start_time - start_time) <= START_TIME_TOLERANCE


# --- the redeploy record (`lockstep up` is deploying a failed model again) ----------


def write_redeploy_record(path: Path, record: RedeployRecord) -> None:
    write_json_atomic(path, record.to_dict())


def live_redeploy_record(path: Path) -> RedeployRecord | None:
    """The redeploy record while the `up` that wrote it runs; None otherwise (none, an
    unreadable one, or its `up` gone: nothing is coming back)."""
    path = Path(path)
    try:
        if not path.exists():
            return None
        rec = RedeployRecord.from_dict(read_json(path), path=path)
    except (StateFileError, OSError):
        return None
    return rec if _up_lives(rec.up_pid, rec.up_start_time) else None


# --- manifests and markers on disk ---------------------------------------------------


def _check_id(kind: str, value: str) -> str:
    if type(value) is not str or not ID_RE.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: must match {ID_RE.pattern}")
    return value


def manifest_path(paths: Paths, job_id: str) -> Path:
    return paths.manifests / f"{_check_id('job_id', job_id)}.json"


def marker_dir(paths: Paths, deployment_id: str) -> Path:
    return paths.markers / _check_id("deployment_id", deployment_id)


def marker_path(paths: Paths, deployment_id: str, rank: int) -> Path:
    if type(rank) is not int or rank < 0:
        raise ValueError(f"invalid rank {rank!r}")
    return marker_dir(paths, deployment_id) / f"rank-{rank}.json"


@dataclass
class ManifestScan:
    manifests: list[tuple[Path, LaunchManifest]] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


@dataclass
class MarkerScan:
    markers: list[tuple[Path, RankMarker]] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def _entries(d: Path, unreadable: list[tuple[Path, str]]) -> list[os.DirEntry[str]]:
    """Sorted entries of `d`; none if it does not exist. A directory that exists but
    cannot be listed is reported: "no files" would be a guess."""
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        unreadable.append((d, f"cannot list directory: {e.strerror or e}"))
        return []


def write_manifest(paths: Paths, manifest: LaunchManifest) -> Path:
    _mkdir_private(paths.manifests)
    p = manifest_path(paths, manifest.job_id)
    write_json_atomic(p, manifest.to_dict())
    return p


def remove_manifest(paths: Paths, job_id: str) -> bool:
    """Remove a manifest (only after verified teardown); False if it was not there."""
    p = manifest_path(paths, job_id)
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(p.parent)
    return True


def read_manifests(paths: Paths) -> ManifestScan:
    """Every `*.json` in runtime/manifests; dot files (temp files) and other names are
    not manifests. A manifest whose job_id differs from its file name is unreadable."""
    scan = ManifestScan()
    for entry in _entries(paths.manifests, scan.unreadable):
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        p = Path(entry.path)
        try:
            m = LaunchManifest.from_dict(read_json(p), path=p)
            if entry.name != f"{m.job_id}.json":
                raise StateFileError(p, f"file name does not match job_id {m.job_id!r}")
        except StateFileError as e:
            scan.unreadable.append((p, e.reason))
            continue
        scan.manifests.append((p, m))
    return scan


def read_markers(paths: Paths, deployment_id: str | None = None) -> MarkerScan:
    """Every `markers/<deployment>/rank-<r>.json` (of one deployment, or all). Every other
    file is ignored, as are dot directories (markers being retired)."""
    scan = MarkerScan()
    if deployment_id is not None:
        dirs = [marker_dir(paths, deployment_id)]
    else:
        dirs = [Path(e.path) for e in _entries(paths.markers, scan.unreadable)
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    for d in dirs:
        for entry in _entries(d, scan.unreadable):
            match = _MARKER_RE.fullmatch(entry.name)
            if match is None:
                continue
            p = Path(entry.path)
            try:
                m = RankMarker.from_dict(read_json(p), path=p)
                # A marker that disagrees with where it lies is not trusted either way.
                if m.rank != int(match.group(1)) or m.deployment_id != d.name:
                    raise StateFileError(
                        p, f"content (deployment {m.deployment_id!r}, rank {m.rank}) "
                           f"does not match its path")
            except StateFileError as e:
                scan.unreadable.append((p, e.reason))
                continue
            scan.markers.append((p, m))
    return scan


def write_marker(paths: Paths, marker: RankMarker) -> Path:
    d = marker_dir(paths, marker.deployment_id)
    _mkdir_private(d)
    p = marker_path(paths, marker.deployment_id, marker.rank)
    write_json_atomic(p, marker.to_dict())
    return p


def retire_markers(paths: Paths, deployment_id: str) -> bool:
    """Remove a deployment's marker directory; False if there was none. It is first
    renamed to a dot name, so readers see all of its markers or none."""
    d = marker_dir(paths, deployment_id)
    grave = d.with_name(f".{d.name}.retired-{secrets.token_hex(6)}")
    try:
        os.rename(d, grave)
    except FileNotFoundError:
        return False
    shutil.rmtree(grave)
    fsync_dir(d.parent)
    return True
