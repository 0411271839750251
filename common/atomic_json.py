"""Atomic JSON state files: written whole or not at all (temp file, fsync, os.replace,
fsync of the directory), mode 0600 from the moment they exist, each carrying
`schema_version`; read strictly, reporting what cannot be trusted with its path.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
# A state file is a few KB; anything this large is damage, not state.
MAX_STATE_BYTES = 16 * 1024 * 1024


class StateFileError(Exception):
    """A state file (or record) that cannot be trusted; `reason` says why."""

    def __init__(self, path: Path | str | None, reason: str) -> None:
        super().__init__(path, reason)
        self.path = Path(path) if path is not None else None
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path if self.path is not None else '<record>'}: {self.reason}"


# --- atomic files -------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
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
    fsync_dir(path.parent)


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
