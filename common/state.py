"""Atomic state files under $LOCKSTEP_HOME, and the readers for launch manifests and
rank markers (DESIGN section 4).

Every file is written whole or not at all (temp file, fsync, os.replace, fsync of the
directory), mode 0600 from the moment it exists, and carries `schema_version`. Readers
report what they cannot read, with its path; they never guess.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import json
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

SCHEMA_VERSION = 1
# A state file is a few KB; anything this large is damage, not state.
MAX_STATE_BYTES = 16 * 1024 * 1024
# Ids become file and directory names: no separators, no leading dot, bounded length.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Exactly what write_marker writes; [0-9] not \d, which also matches non-ASCII digits.
_MARKER_RE = re.compile(r"rank-(0|[1-9][0-9]{0,5})\.json")


class StateFileError(Exception):
    """A state file (or record) that cannot be trusted; `reason` says why."""

    def __init__(self, path: Path | str | None, reason: str) -> None:
        super().__init__(path, reason)
        self.path = Path(path) if path is not None else None
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path if self.path is not None else '<record>'}: {self.reason}"


# --- atomic files -------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    # Without this the rename itself may not survive a power loss.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path | str, obj: dict[str, Any], *, mode: int = 0o600) -> None:
    """Replace `path` with `obj` as JSON, atomically. `obj` must carry schema_version."""
    path = Path(path)
    if not isinstance(obj, dict) or "schema_version" not in obj:
        raise ValueError(f"{path}: state object must be a dict carrying schema_version")
    # Serialise first, so a bad object never leaves a temp file behind.
    data = (json.dumps(obj, allow_nan=False, sort_keys=True, indent=1) + "\n").encode()
    # Dot prefix and .tmp suffix: no reader ever takes a temp file for a state file.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never reuse or follow someone else's file; 0600 from creation, so the
    # content is never readable by others, not even before a chmod.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exact mode, whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_json(path: Path | str, *, versions: Collection[int] = (SCHEMA_VERSION,)) -> dict[str, Any]:
    """Read a state file; StateFileError if missing, unparseable or of another version."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO under that name must not hang the reader; fstat rejects it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StateFileError(path, "missing") from None
    except OSError as e:
        raise StateFileError(path, f"cannot open: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StateFileError(path, "not a regular file")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except OSError as e:
        raise StateFileError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_STATE_BYTES:
        raise StateFileError(path, f"larger than {MAX_STATE_BYTES} bytes")
    try:
        obj = json.loads(
            raw.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates
        )
    except (UnicodeDecodeError, ValueError) as e:
        raise StateFileError(path, f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise StateFileError(path, f"top level is {type(obj).__name__}, not an object")
    if "schema_version" not in obj:
        raise StateFileError(path, "no schema_version")
    version = obj["schema_version"]
    if type(version) is not int or version not in versions:
        raise StateFileError(path, f"unsupported schema_version {version!r}")
    return obj


# --- layout ---------------------------------------------------------------------------


def default_home() -> Path:
    env = os.environ.get("LOCKSTEP_HOME")
    return Path(env) if env else Path.home() / ".lockstep"


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

    def __post_init__(self) -> None:
        home = Path(self.home).expanduser().absolute()  # a later chdir cannot move it
        runtime = home / "runtime"
        layout = {"home": home, "keys_dir": home / "keys",
                  "cluster_key": home / "keys" / "cluster.key",
                  "admin_token": home / "admin.token", "runtime": runtime,
                  "manifests": runtime / "manifests", "markers": runtime / "markers",
                  "secrets": runtime / "secrets", "logs": runtime / "logs",
                  "state": runtime / "state", "models": home / "models"}
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


# --- records --------------------------------------------------------------------------


class Phase(str, enum.Enum):
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    SERVING = "serving"
    DRAINING = "draining"
    EXITING = "exiting"
    PEER_LOST = "peer_lost"
    LAUNCHER_LOST = "launcher_lost"
    FAILED = "failed"

    def __str__(self) -> str:  # "ready", not "Phase.READY", in f-strings and logs
        return self.value


# Each check returns None when the value is acceptable, else what is wrong with it.
_Check = Callable[[Any], "str | None"]


def _typed(name: str, ok: Callable[[Any], bool]) -> _Check:
    return lambda v: None if ok(v) else f"expected {name}, got {type(v).__name__} {v!r:.60}"


_INT = _typed("int", lambda v: type(v) is int)  # `type is`: a bool is not an int here
_NAT = _typed("int >= 0", lambda v: type(v) is int and v >= 0)
_PID = _typed("int >= 1", lambda v: type(v) is int and v >= 1)  # kill(0|-1) hits groups
_FLOAT = _typed("finite number", lambda v: type(v) in (int, float) and math.isfinite(v))
_STR = _typed("str", lambda v: type(v) is str)
_OPT_STR = _typed("str or null", lambda v: v is None or type(v) is str)
_BOOL = _typed("bool", lambda v: type(v) is bool)
_STR_LIST = _typed("list of str", lambda v: type(v) is list and all(type(s) is str for s in v))
_ID = _typed("id [A-Za-z0-9._-]", lambda v: type(v) is str and _ID_RE.fullmatch(v) is not None)
_VERSION = _typed(f"version {SCHEMA_VERSION}", lambda v: type(v) is int and v == SCHEMA_VERSION)
_PHASES = frozenset(p.value for p in Phase)
_PHASE = _typed("phase", lambda v: type(v) is str and v in _PHASES)
_LIST = _typed("list", lambda v: type(v) is list)


def _is_json(v: Any) -> bool:
    if v is None or type(v) in (bool, int, str):
        return True
    if type(v) is float:
        return math.isfinite(v)
    if type(v) is list:
        return all(_is_json(x) for x in v)
    if type(v) is dict:
        return all(type(k) is str and _is_json(x) for k, x in v.items())
    return False


_JSON_OBJ = _typed("JSON object", lambda v: type(v) is dict and _is_json(v))


def _checked(cls: type[_Record], d: Any, path: Path | str | None) -> dict[str, Any]:
    """Validate `d` strictly: no unknown field, none missing but the optional ones;
    returns a deep copy with numbers for float fields made floats."""
    if type(d) is not dict:
        raise StateFileError(path, f"{cls.__name__} is {type(d).__name__}, not an object")
    spec = cls._SPEC
    unknown = sorted(set(d) - set(spec))
    if unknown:
        raise StateFileError(path, f"{cls.__name__}: unknown field(s) {unknown}")
    for name, check in spec.items():
        if name not in d:
            if name in cls._OPTIONAL:
                continue
            raise StateFileError(path, f"{cls.__name__}: field {name!r}: missing")
        problem = check(d[name])
        if problem:
            raise StateFileError(path, f"{cls.__name__}: field {name!r}: {problem}")
    v = copy.deepcopy(d)
    v.update({k: float(x) for k, x in v.items() if spec[k] is _FLOAT})
    return v


_R = TypeVar("_R", bound="_Record")


class _Record:
    _SPEC: ClassVar[dict[str, _Check]]
    _OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # type: ignore[call-overload]
        if isinstance(d.get("phase"), Phase):
            d["phase"] = d["phase"].value
        type(self).from_dict(d)  # never write what we could not read back
        return d

    @classmethod
    def from_dict(cls: type[_R], d: Any, *, path: Path | str | None = None) -> _R:
        return cls(**_checked(cls, d, path))


@dataclass(frozen=True, kw_only=True)
class RankRecord(_Record):
    rank: int
    host: str
    pid: int
    pgid: int
    start_time: float
    cmdline: list[str]
    marker_dir: str
    remote: bool
    ssh: str | None = None
    # Remote ranks: how to reach the host agent there (interpreter, ssh client config)
    # and that host's $LOCKSTEP_HOME, so a reaper can stop them with no other state.
    python: str | None = None
    ssh_config: str | None = None
    home: str | None = None

    _SPEC = {"rank": _NAT, "host": _STR, "pid": _PID, "pgid": _PID, "start_time": _FLOAT,
             "cmdline": _STR_LIST, "marker_dir": _STR, "remote": _BOOL, "ssh": _OPT_STR,
             "python": _OPT_STR, "ssh_config": _OPT_STR, "home": _OPT_STR}
    _OPTIONAL = ("python", "ssh_config", "home")


@dataclass(frozen=True, kw_only=True)
class LaunchManifest(_Record):
    job_id: str
    deployment_id: str
    supervisor_pid: int
    supervisor_start_time: float
    supervisor_boot_id: str
    created_at: float
    ranks: list[RankRecord]
    secret_path: str
    teardown_failures: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    _SPEC = {"schema_version": _VERSION, "job_id": _ID, "deployment_id": _ID,
             "supervisor_pid": _PID, "supervisor_start_time": _FLOAT,
             "supervisor_boot_id": _STR, "created_at": _FLOAT, "ranks": _LIST,
             "secret_path": _STR, "teardown_failures": _STR_LIST}
    _OPTIONAL = ("teardown_failures",)

    @classmethod
    def from_dict(cls, d: Any, *, path: Path | str | None = None) -> LaunchManifest:
        v = _checked(cls, d, path)
        ranks = []
        for i, r in enumerate(v["ranks"]):
            try:
                ranks.append(RankRecord.from_dict(r, path=path))
            except StateFileError as e:
                raise StateFileError(path, f"ranks[{i}]: {e.reason}") from None
        v["ranks"] = ranks
        return cls(**v)


@dataclass(frozen=True, kw_only=True)
class RankMarker(_Record):
    deployment_id: str
    job_id: str
    rank: int
    host: str
    pid: int
    start_time: float
    phase: Phase
    updated_at: float
    step: int = 0
    active: int = 0
    cancel_epoch: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # telemetry; JSON values only
    schema_version: int = SCHEMA_VERSION

    _SPEC = {"schema_version": _VERSION, "deployment_id": _ID, "job_id": _ID, "rank": _NAT,
             "host": _STR, "pid": _PID, "start_time": _FLOAT, "phase": _PHASE,
             "updated_at": _FLOAT, "step": _NAT, "active": _NAT, "cancel_epoch": _INT,
             "error": _OPT_STR, "extra": _JSON_OBJ}
    _OPTIONAL = ("extra",)

    @classmethod
    def from_dict(cls, d: Any, *, path: Path | str | None = None) -> RankMarker:
        v = _checked(cls, d, path)
        v["phase"] = Phase(v["phase"])
        return cls(**v)


# --- manifests and markers on disk ---------------------------------------------------


def _check_id(kind: str, value: str) -> str:
    if type(value) is not str or not _ID_RE.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: must match {_ID_RE.pattern}")
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
    _fsync_dir(p.parent)
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
    _fsync_dir(d.parent)
    return True
