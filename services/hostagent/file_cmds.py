"""File and port commands of the host agent: read-markers, write-file, remove-files,
free-ports."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from common import ports
from common.home import Paths, read_markers
from common.schema import to_wire
from services.hostagent.base import AgentError, read_stdin
from services.hostagent.replies import MarkerFile, Markers, UnreadableFile

MAX_PORTS = 64


def markers_under(home: str, deployment: str | None) -> Markers:
    """The rank markers under `home` (one deployment's, or all): read-markers and probe."""
    try:
        scan = read_markers(Paths(home=Path(home)), deployment)
    except ValueError as e:  # an invalid deployment id
        raise AgentError(str(e)) from None
    return Markers([MarkerFile(str(p), m.to_dict()) for p, m in scan.markers],
                   [UnreadableFile(str(p), r) for p, r in scan.unreadable])


def cmd_read_markers(args: argparse.Namespace) -> Any:
    return to_wire(markers_under(args.home, args.deployment))


def cmd_write_file(args: argparse.Namespace) -> Any:
    try:
        mode = int(args.mode, 8)
    except ValueError:
        raise AgentError(f"--mode {args.mode!r}: expected octal, e.g. 600") from None
    if not 0 <= mode <= 0o777:
        raise AgentError(f"--mode {args.mode!r}: permission bits only (0..777)")
    path = Path(args.path).absolute()
    data = read_stdin()
    if args.parents:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never reuse or follow someone else's file; created with at most the
    # final mode, so the content is never more visible than asked, not even briefly.
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o600)
    except OSError as e:
        raise AgentError(f"write-file {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)  # exact mode, whatever the umask
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise AgentError(f"write-file {path}: {e.strerror or e}") from None
        raise
    return {"path": str(path), "bytes": len(data), "mode": f"{mode:03o}"}


def _inside_runtime(runtime: Path, text: str) -> Path:
    """`text` as a path strictly below runtime/<area>/ (e.g. runtime/secrets/J.key,
    runtime/jobs/J): its directory is resolved (no symlink escapes), its last part is
    taken as it is (a symlink there is removed, never followed)."""
    p = Path(text)
    if not p.is_absolute() or p.name in ("", ".", ".."):
        raise AgentError(f"remove-files: {text!r}: expected an absolute path to a file")
    real = Path(os.path.realpath(p.parent)) / p.name
    try:
        rel = real.relative_to(runtime)
    except ValueError:
        raise AgentError(f"remove-files: {text} is not under {runtime}") from None
    if len(rel.parts) < 2:
        raise AgentError(f"remove-files: {text}: only what lies inside runtime/<area>/ "
                         "may be removed")
    return real


def cmd_remove_files(args: argparse.Namespace) -> Any:
    """Remove files (and directories, with what they hold) below HOME/runtime/<area>/:
    launch secrets, job directories, a deployment's marker directory. Every path is
    checked before anything is removed."""
    runtime = Path(os.path.realpath(Path(args.home).absolute())) / "runtime"
    targets = [_inside_runtime(runtime, t) for t in args.paths]
    removed, missing = [], []
    for path in targets:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            missing.append(str(path))
            continue
        except OSError as e:
            raise AgentError(f"remove-files {path}: {e.strerror or e}") from None
        removed.append(str(path))
    return {"removed": removed, "missing": missing}


def cmd_free_ports(args: argparse.Namespace) -> Any:
    """N distinct TCP ports free on this host's address, outside its ephemeral range
    (common/ports.py: another process may still take one first; the rank then fails to
    bind and says so)."""
    if not 1 <= args.count <= MAX_PORTS:
        raise AgentError(f"free-ports: count must be within 1..{MAX_PORTS}")
    try:
        return {"host": args.host, "ports": ports.free_ports(args.count, args.host)}
    except OSError as e:
        raise AgentError(f"free-ports: cannot bind {args.host}: {e.strerror or e}") from None
