"""`lockstep make-model DIR`: build the embedded default model, once.

The model is built into a temporary directory next to DIR and renamed into place, so a
reader never sees a half-written model. A `lockstep_model.json` stamp, written last,
records what was built; a later call with the same preset and seed does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS, TOOL_TOKENS, write_tokenizer
from .weights import PRESETS, model_config, preset_dict, write_weights

STAMP = "lockstep_model.json"
FORMAT_VERSION = 1  # bump when the generated files change for the same preset and seed


class ModelDirError(Exception):
    """DIR holds something that is not a model we built; we refuse to overwrite it."""


def read_stamp(model_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(model_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_complete(model_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> bool:
    """True if model_dir holds a finished build of exactly this preset and seed."""
    stamp = read_stamp(model_dir)
    if not stamp or (stamp.get("format_version"), stamp.get("preset"), stamp.get("seed")) != (
        FORMAT_VERSION,
        preset,
        seed,
    ):
        return False
    return all((Path(model_dir) / f).is_file() for f in stamp.get("files", []))


def _write_model(out: Path, preset: str, seed: int) -> None:
    p = PRESETS[preset]
    ids = write_tokenizer(out, p.vocab_target)
    eos = [ids[IM_END], ids[ENDOFTEXT]]
    config = model_config(p, ids["vocab_size"], eos, ids[ENDOFTEXT])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": ids[ENDOFTEXT], "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    silent = tuple(ids[t] for t in SPECIAL_TOKENS + TOOL_TOKENS)
    shards = write_weights(out, p, seed, ids["vocab_size"], silent)
    files = sorted(f.name for f in out.iterdir())
    stamp = {
        "format_version": FORMAT_VERSION,
        "preset": preset,
        "seed": seed,
        "dims": preset_dict(p),
        "shards": shards,
        "files": files,
    }
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # last: marks completion


def build_model(
    dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, force: bool = False
) -> Path:
    """Build the model into dir (idempotent) and return its absolute path.

    An existing build with the same preset and seed is kept unless force. An existing
    build of ours with other settings is replaced; any other non-empty dir is refused
    unless force, so a typo cannot wipe someone's files.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    target = Path(dir).expanduser().resolve()
    if not force and is_complete(target, preset, seed):
        return target
    if (
        not force
        and target.exists()
        and read_stamp(target) is None
        and (not target.is_dir() or any(target.iterdir()))
    ):
        raise ModelDirError(
            f"{target} exists and is not a lockstep model; pick another directory "
            "or pass --force to replace it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    old: Path | None = None
    try:
        _write_model(tmp, preset, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the model is not secret
        if not force and is_complete(target, preset, seed):
            return target  # a concurrent builder finished first; leave its copy in place
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "m")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another builder won the race; its result is as good as ours.
            if is_complete(target, preset, seed):
                return target
            raise
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lockstep make-model",
        description="Build the embedded random-weight Qwen2 model (no downloads).",
    )
    ap.add_argument("dir", help="directory to create (its parent is created if missing)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    args = ap.parse_args(argv)
    try:
        path = build_model(args.dir, args.preset, args.seed, force=args.force)
    except ModelDirError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
