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
  And on x86-64, OPENBLAS_CORETYPE unless set (`coretype`): OpenBLAS otherwise picks
  its kernels by CPU, and each reduces a row in an order that depends on how many rows
  the call has, differently per kernel; the deterministic mode
  (services/rank/determinism.py) holds only for a kernel it knows. With AVX-512 that is
  SkylakeX, the kernel OpenBLAS picks there itself (its small-matrix rule is the one
  determinism.py's row floor covers); without AVX-512 but with AVX it is SandyBridge,
  whose sgemm gives every row the same bits at any row count (measured on an AMD EPYC,
  Zen 3: Haswell's kernel, OpenBLAS's pick there, differs for every row count under 64,
  SandyBridge's for none; 0-28% more time on large prefill products, none on decode's).
  SandyBridge is not forced on AVX-512 CPUs: there it decodes at about half the speed
  (SmolLM2-135M with mlx-lm on an Intel Xeon: 5.3 vs 9.7 tokens/s). Hosts whose CPUs
  differ may then differ in the last bits from each other; each is still batch
  invariant, and an operator who wants them equal sets OPENBLAS_CORETYPE=SandyBridge.
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
            kernel = coretype()
            if kernel is not None:
                env.setdefault("OPENBLAS_CORETYPE", kernel)
    return env


SKYLAKEX_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's flags (empty off x86-64 Linux, or unreadable)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def coretype(flags: frozenset[str] | None = None) -> str | None:
    """The OpenBLAS kernel deterministic mode holds with on this CPU: SkylakeX with
    AVX-512, SandyBridge with AVX, None (OpenBLAS's own choice) otherwise."""
    flags = cpu_flags() if flags is None else flags
    if SKYLAKEX_FLAGS <= flags:
        return "SkylakeX"
    return "SandyBridge" if "avx" in flags else None
