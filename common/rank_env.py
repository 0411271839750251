"""The environment a rank process starts with, applied by whoever launches ranks (the
supervisor's local launcher, a host agent's `spawn --rank-env`, the test and bench
harnesses) — launcher-side rules, kept here so no launcher imports the rank service.

    rank_environment(settings, base_env) -> dict

- MLX buffer limits and JACCL timeouts (DESIGN 5.3), each only if not already set, so
  an operator's value wins: MLX_MAX_OPS_PER_BUFFER=16, MLX_MAX_MB_PER_BUFFER=512,
  JACCL_PROGRESS_TIMEOUT_MS=30000, JACCL_TIMEOUT_ACTION=teardown-exit.
- OpenBLAS: the Linux mlx-cpu wheel bundles a reference BLAS (~3-6 GFLOP/s fp32 matmul
  here); preloading Debian's OpenBLAS (package libopenblas0-pthread) makes matmuls an
  order of magnitude faster. On by default on Linux when the library exists; off with
  `RankSettings.openblas = False` or `LOCKSTEP_OPENBLAS=0` in the base environment.
  `LOCKSTEP_OPENBLAS_LIB=/path/libopenblas.so.0` picks another library (both parsed by
  common.config, `HostBlasSettings`). LD_PRELOAD must
  be set before the process starts, which is why this lives with the launcher. With it,
  OPENBLAS_NUM_THREADS=1 unless set: OpenBLAS's own threads fight MLX's for the cores
  (measured on 2 cores, bench preset: batch-8 decode 56 tok/s with 2 BLAS threads vs 96
  with 1; TP=2 collapses to 10 tok/s with 2 threads per rank vs 100 with 1).
  And on x86-64 with AVX, OPENBLAS_CORETYPE=SandyBridge unless set: OpenBLAS otherwise
  picks its kernels by CPU (SkylakeX, Haswell/Zen, ...), and each reduces a row in an
  order that depends on how many rows the call has, differently per kernel — the
  deterministic mode (services/rank/determinism.py) would hold on one CPU and not on the
  next, and two hosts of one cluster would disagree in the last bits. The SandyBridge
  sgemm kernel gives every row the same bits at any row count, on every x86-64 CPU with
  AVX (measured on an AMD EPYC, Zen 3: Haswell's kernel differs for every row count
  under 64, SandyBridge's for none), at 0-28% more time on large prefill products and
  none on decode's (bench preset shapes, 1 thread).
- Never `TEMP`: MLX's compiler uses it as its temp directory.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from common.config import load_settings
from common.rankspec import RankSettings

DEFAULTS = {
    "MLX_MAX_OPS_PER_BUFFER": "16",
    "MLX_MAX_MB_PER_BUFFER": "512",
    "JACCL_PROGRESS_TIMEOUT_MS": "30000",
    "JACCL_TIMEOUT_ACTION": "teardown-exit",
}
OPENBLAS_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class HostBlasSettings:
    """This host's OpenBLAS switches, from the launching process's environment (the
    supervisor's, or a remote host agent's): LOCKSTEP_OPENBLAS, LOCKSTEP_OPENBLAS_LIB."""

    openblas: bool = True
    openblas_lib: str = ""  # empty: the first of OPENBLAS_CANDIDATES that exists

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> HostBlasSettings:
        # An empty variable is an unset one (as it always was here).
        return load_settings(cls, env=env, blank_is_unset=True)


def find_openblas(env: Mapping[str, str] | None = None) -> str | None:
    """The OpenBLAS shared library to preload on this host, or None."""
    explicit = HostBlasSettings.load(env).openblas_lib
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    for pattern in OPENBLAS_CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return os.path.realpath(path)
    return None


def openblas_enabled(settings: RankSettings, env: Mapping[str, str]) -> bool:
    if not settings.openblas or not sys.platform.startswith("linux"):
        return False
    return HostBlasSettings.load(env).openblas


def rank_environment(settings: RankSettings, base_env: Mapping[str, str]) -> dict[str, str]:
    env = dict(base_env)
    env.pop("TEMP", None)
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    if openblas_enabled(settings, env):
        lib = find_openblas(env)
        if lib is not None:
            preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
            if lib not in preload:
                env["LD_PRELOAD"] = " ".join([lib, *preload])
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            if has_avx():
                env.setdefault("OPENBLAS_CORETYPE", "SandyBridge")
    return env


def has_avx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """An x86-64 CPU with AVX (what OpenBLAS's SandyBridge kernels need)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx" in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False
