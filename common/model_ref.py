"""What `--model` (and a deploy's `model_path`) may name, and the id a served model has.

A model is a local directory, or a Hugging Face repo id (`org/name`) already in the local
HF cache: resolved offline, as `mlx_lm.load` resolves one
(`snapshot_download(..., local_files_only=True)`: `$HF_HOME/hub/models--org--name/
snapshots/<rev>/`). Nothing is downloaded. A served model's id is its repo id when its
directory is such a snapshot, else the directory's name: what clients send as `model`
and what `GET /v1/models` lists.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
CACHE_PREFIX = "models--"


class ModelNotFound(ValueError):
    """Neither a directory nor a repo id in the local Hugging Face cache."""


def resolve(ref: str) -> Path:
    """The model directory `ref` names (a path, or a repo id in the local HF cache)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return p.resolve()
    if not REPO_ID.fullmatch(ref) or "/" not in ref:
        raise ModelNotFound(f"{ref}: not a directory (nor a Hugging Face repo id 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(ref, local_files_only=True)).resolve()
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ModelNotFound(f"{ref}: not a directory, and not in the local Hugging Face cache "
                            f"(nothing is downloaded; {type(exc).__name__})") from None


def model_id(path: str | Path) -> str:
    """The id clients use: `org/name` for a HF cache snapshot, else the directory name."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name == "snapshots" and repo.startswith(CACHE_PREFIX) and "--" in repo[len(CACHE_PREFIX):]:
        return repo[len(CACHE_PREFIX):].replace("--", "/", 1)
    return p.name


def owner(model: str) -> str:
    """`owned_by` in /v1/models: a repo id's organisation, else this server."""
    return model.split("/", 1)[0] if "/" in model else "lockstep"
