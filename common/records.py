"""The typed records kept on disk: launch manifests (with one RankRecord per rank), rank
markers (DESIGN section 4) and the supervisor's runtime file, validated strictly in both
directions. Each has one reader in common.home; every process reads it through that.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from common.atomic_json import SCHEMA_VERSION, StateFileError
from common.messages.vocab import Phase

# Ids become file and directory names: no separators, no leading dot, bounded length.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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
_OPT_FLOAT = _typed("finite number or null", lambda v: v is None or (
    type(v) in (int, float) and math.isfinite(v)))
_BOOL = _typed("bool", lambda v: type(v) is bool)
_STR_LIST = _typed("list of str", lambda v: type(v) is list and all(type(s) is str for s in v))
_ID = _typed("id [A-Za-z0-9._-]", lambda v: type(v) is str and ID_RE.fullmatch(v) is not None)
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


@dataclass(frozen=True, kw_only=True)
class SupervisorRecord(_Record):
    """`runtime/supervisor.json`: who the running supervisor is and where its sockets are.
    Written by the supervisor once its sockets are bound; read by `lockstep up`, its
    preflight, `lockstep admin`, the home lock's message and the gateway."""

    pid: int
    boot_id: str
    start_time: float
    admin: str
    events: str
    control: str
    report: str
    schema_version: int = SCHEMA_VERSION

    _SPEC = {"schema_version": _VERSION, "pid": _PID, "boot_id": _STR, "start_time": _FLOAT,
             "admin": _STR, "events": _STR, "control": _STR, "report": _STR}


@dataclass(frozen=True, kw_only=True)
class AdoptionRecord(_Record):
    """`runtime/adoption.json`: the `lockstep up` that restarts a supervisor which dies,
    and so may adopt its launches (docs/supervisor.md "Adoption"). Written by `up` at
    start (`restarting_until` null) and again when its supervisor died (`restarting_until`:
    the wall-clock end of the adoption window). Read by the reaper: while this `up` lives
    (pid + start time), a launch whose supervisor is dead is left alone for `window_s`
    (from when the reaper first saw it orphaned, or until `restarting_until`)."""

    up_pid: int
    up_start_time: float
    window_s: float
    restarting_until: float | None = None
    reason: str = ""
    # the restart policy (shown by `admin status`): at most `supervisor_restarts` within
    # any `restart_window_s`; `restarts`: how many this `up` has made
    supervisor_restarts: int = 0
    restart_window_s: float = 0.0
    restarts: int = 0
    schema_version: int = SCHEMA_VERSION

    _SPEC = {"schema_version": _VERSION, "up_pid": _PID, "up_start_time": _FLOAT,
             "window_s": _FLOAT, "restarting_until": _OPT_FLOAT, "reason": _STR,
             "supervisor_restarts": _INT, "restart_window_s": _FLOAT, "restarts": _INT}
    _OPTIONAL = ("supervisor_restarts", "restart_window_s", "restarts")

    @classmethod
    def from_dict(cls, d: Any, *, path: Path | str | None = None) -> AdoptionRecord:
        v = _checked(cls, d, path)
        if v["restarting_until"] is not None:
            v["restarting_until"] = float(v["restarting_until"])
        return cls(**v)


@dataclass(frozen=True, kw_only=True)
class RedeployRecord(_Record):
    """`runtime/redeploy.json`: the `lockstep up` that redeploys `model` when its
    deployment fails (a rank died, a peer was lost, not adopted) — written once it serves,
    kept through a redeploy, removed when the redeploy rate is spent, when an operator
    stops the deployment, and when `up` stops. Read by the gateway: while this `up`
    lives (pid + start time), a request for `model` that finds nothing serving waits for
    the new deployment (at most its `admit_wait`) instead of a 503 (docs/gateway.md
    "Admission through a redeploy"). `reason`: the last failure, if one is being redeployed."""

    up_pid: int
    up_start_time: float
    model: str
    reason: str = ""
    schema_version: int = SCHEMA_VERSION

    _SPEC = {"schema_version": _VERSION, "up_pid": _PID, "up_start_time": _FLOAT,
             "model": _STR, "reason": _STR}

