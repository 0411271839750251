"""Build a model directory once, atomically: the one way both builders write a model.

The files are written into a temporary directory next to DIR and renamed into place, so a
reader never sees a half-written model. A `lockstep_model.json` stamp, written last,
records what was built; a later call that wants the same does nothing. A DIR that holds
something else is refused unless forced, so a typo cannot wipe someone's files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

STAMP = "lockstep_model.json"


class ModelDirError(Exception):
    """DIR holds something that is not a model we built; we refuse to overwrite it."""


def read_stamp(model_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(model_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_complete(model_dir: str | os.PathLike, wanted: dict) -> bool:
    """True if model_dir holds a finished build whose stamp has every item of wanted."""
    stamp = read_stamp(model_dir)
    if not stamp or any(stamp.get(k) != v for k, v in wanted.items()):
        return False
    return all((Path(model_dir) / f).is_file() for f in stamp.get("files", []))


def build_once(target: Path, wanted: dict, write: Callable[[Path], dict], force: bool) -> Path:
    """Build into target (absolute) unless it already holds what wanted names; return it.

    write(tmp) writes the model's files into tmp and returns what the stamp records
    besides wanted; it is called only when something must be built. An existing build of
    ours with other settings is replaced; any other non-empty target is refused unless
    force.
    """
    if not force and is_complete(target, wanted):
        return target
    if (not force and target.exists() and read_stamp(target) is None
            and (not target.is_dir() or any(target.iterdir()))):
        raise ModelDirError(f"{target} exists and is not a lockstep model; pick another "
                            "directory or pass --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    old: Path | None = None
    try:
        summary = write(tmp)
        files = sorted(f.name for f in tmp.iterdir())
        stamp = {**wanted, **summary, "files": files}
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # last: marks completion
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the model is not secret
        if not force and is_complete(target, wanted):
            return target  # a concurrent builder finished first; leave its copy in place
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "m")
        try:
            os.rename(tmp, target)
        except OSError:
            if is_complete(target, wanted):  # another builder won the race; as good as ours
                return target
            raise
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target
