"""`lockstep make-model DIR`: build the embedded default model, once.

Built atomically by models/atomic_build.py: a `lockstep_model.json` stamp, written last,
records what was built; a later call with the same preset and seed does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from models.atomic_build import ModelDirError, build_once
from models.atomic_build import is_complete as _stamp_matches

from .tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS, TOOL_TOKENS, write_tokenizer
from .weights import PRESETS, model_config, preset_dict, write_weights

FORMAT_VERSION = 1  # bump when the generated files change for the same preset and seed


def _wanted(preset: str, seed: int) -> dict:
    return {"format_version": FORMAT_VERSION, "preset": preset, "seed": seed}


def is_complete(model_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> bool:
    """True if model_dir holds a finished build of exactly this preset and seed."""
    return _stamp_matches(model_dir, _wanted(preset, seed))


def _write_model(out: Path, preset: str, seed: int) -> dict:
    p = PRESETS[preset]
    ids = write_tokenizer(out, p.vocab_target)
    eos = [ids[IM_END], ids[ENDOFTEXT]]
    config = model_config(p, ids["vocab_size"], eos, ids[ENDOFTEXT])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": ids[ENDOFTEXT], "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    silent = tuple(ids[t] for t in SPECIAL_TOKENS + TOOL_TOKENS)
    shards = write_weights(out, p, seed, ids["vocab_size"], silent)
    return {"dims": preset_dict(p), "shards": shards}  # the stamp's record of them


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
    return build_once(target, _wanted(preset, seed),
                      lambda tmp: _write_model(tmp, preset, seed), force)


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
