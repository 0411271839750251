"""Start and stop the servers the serving benchmarks compare, under the same settings.

- `lockstep(...)`: `lockstep up` (gateway + supervisor + reaper + ranks) on free ports,
  its prefix cache off (`--prompt-cache-entries 0`) or at its defaults.
- `mlx_lm(...)`: `python -m mlx_lm server` on the same model directory, with the
  environment a rank gets (`rank_environment`: the same OpenBLAS preload, thread count
  and MLX buffer limits) and the batch/prefill flags equal to RankSettings
  (max_batch → --decode-concurrency, prefill_batch → --prompt-concurrency,
  prefill_step → --prefill-step-size); its prompt cache off (`--prompt-cache-size 0`:
  LRUPromptCache evicts each entry as soon as it is inserted) or at its default size.
  Started through bench/mlx_lm_serve.py, which only raises its listen backlog from
  socketserver's 5 to the gateway's (uvicorn's 2048): with 5, a burst of 32 connections
  gets some reset.

Each started server records what it really ran with, read from the serving processes
themselves (psutil): the BLAS-related environment and whether an OpenBLAS library is
mapped; `check_blas` raises unless every one matches the rank environment — a comparison
with different BLAS is not one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import psutil

from bench.cpu_breakdown import tree_roles
from common import ports

ROOT = Path(__file__).resolve().parents[1]
ENV_KEYS = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "MLX_MAX_OPS_PER_BUFFER",
            "MLX_MAX_MB_PER_BUFFER", "LOCKSTEP_OPENBLAS", "LOCKSTEP_OPENBLAS_LIB")
BLAS_KEYS = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
MLX_LM_DEFAULT_CACHE_SIZE = 10  # mlx_lm 0.32 server --prompt-cache-size default


class ServerError(RuntimeError):
    """A server did not start, or did not run with the settings the benchmark asked for."""


def free_port() -> int:
    return ports.free_ports(1)[0]  # outside the ephemeral range (common/ports.py)


def rank_settings():
    from common.rankspec import RankSettings

    return RankSettings()


def batch_settings() -> dict[str, int]:
    """The batch/prefill settings both servers run with (RankSettings defaults)."""
    rs = rank_settings()
    out = {"max_batch": rs.max_batch, "prefill_batch": rs.prefill_batch,
           "prefill_step": rs.prefill_step}
    if hasattr(rs, "prefill_step_decoding"):
        # Lockstep only: mlx_lm.server has no such knob (it prefills prefill_step always).
        out["lockstep_only_prefill_step_decoding"] = rs.prefill_step_decoding
    if hasattr(rs, "prefill_stall_ratio"):  # 0: fixed chunks (services/rank/prefill_policy.py)
        out["lockstep_only_prefill_stall_ratio"] = rs.prefill_stall_ratio
    if hasattr(rs, "prefill_long_prompt"):  # longer prompts are steered while streams decode
        out["lockstep_only_prefill_long_prompt"] = rs.prefill_long_prompt
    return out


def rank_env() -> dict[str, str]:
    from common.rank_env import rank_environment

    return rank_environment(rank_settings(), os.environ)


def process_evidence(pid: int) -> dict:
    """What a serving process really runs with: its BLAS environment, OpenBLAS mapped."""
    proc = psutil.Process(pid)
    env = proc.environ()
    maps = [m.path for m in proc.memory_maps()]
    out = {k: env.get(k) for k in ENV_KEYS}
    out["openblas_mapped"] = sorted({p for p in maps if "openblas" in os.path.basename(p)})
    out["pid"] = pid
    out["cmdline"] = " ".join(proc.cmdline()[:6])
    return out


@dataclass
class Server:
    name: str  # e.g. lockstep-tp1-cache-off, mlx_lm-cache-on
    url: str
    model: str  # the model id requests name
    proc: subprocess.Popen
    log: Path
    settings: dict = field(default_factory=dict)  # exactly how it was started
    evidence: list[dict] = field(default_factory=list)  # process_evidence of its model processes
    exit_code: int | None = None

    def processes(self) -> dict[str, int]:
        """role -> pid of every process serving it now (roles: bench/cpu_breakdown.py)."""
        root = None if self.name.startswith("lockstep") else "mlx_lm_server"
        return tree_roles(self.proc.pid, root)

    def record(self) -> dict:
        return {"name": self.name, "settings": self.settings, "processes": self.evidence,
                "exit_code": self.exit_code}


def check_blas(srv: Server) -> None:
    """Every model process of `srv` runs with the rank environment's BLAS settings and,
    when that preloads OpenBLAS, has it mapped; otherwise the comparison is void."""
    want = {k: rank_env().get(k) for k in BLAS_KEYS}
    preload = want.get("LD_PRELOAD") or ""
    for ev in srv.evidence:
        diff = {k: (want[k], ev.get(k)) for k in BLAS_KEYS if ev.get(k) != want[k]}
        if diff:
            raise ServerError(f"{srv.name} pid {ev['pid']}: BLAS environment differs from "
                              f"the rank environment (wanted, got): {diff}")
        if "openblas" in preload and not ev["openblas_mapped"]:
            raise ServerError(f"{srv.name} pid {ev['pid']}: LD_PRELOAD={preload} but no "
                              "OpenBLAS library is mapped")


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _wait_ready(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with {proc.returncode} before it was ready; "
                              f"its log ({log}):\n{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerError(f"{what} not ready within {timeout}s; its log ({log}):\n{_tail(log)}")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def lockstep(model: Path, work: Path, tp: int, cache: bool, timeout: float = 900,
             extra: tuple[str, ...] = (), tag: str = "") -> Server:
    """`lockstep up --tp N` serving `model`; cache False passes --prompt-cache-entries 0.
    The prefix cache's disk tier is off in every run (--prompt-cache-disk-bytes 0): these
    runs compare with mlx_lm.server, which has none, and its writer thread would spend
    CPU (about 150 MB written per turn of the agent session) while the other server is
    measured. bench/disk_cache.py measures the disk tier on its own."""
    name = f"lockstep-tp{tp}-cache-{'on' if cache else 'off'}{tag}"
    home, log = work / f"home-{name}", work / f"{name}.log"
    port = free_port()
    cache_flags = ([] if cache else ["--prompt-cache-entries", "0"]) + [
        "--prompt-cache-disk-bytes", "0"]
    cmd = [sys.executable, "-m", "services", "up", "--home", str(home), "--port", str(port),
           "--tp", str(tp), "--model", str(model), "--admin-port", "0", "--events-port", "0",
           "--control-port", "0", "--report-port", "0", "--reaper-events-port", "0",
           *cache_flags, *extra]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    settings = {"cmd": ["lockstep", *cmd[3:]], "tp": tp, "prefix_cache": cache,
                "cache_flags": cache_flags, **batch_settings()}
    rs = rank_settings()
    for f in fields(rs):  # the disk tier's rank default is moot: the flag above decides
        if f.name.startswith("prompt_cache") and f.name != "prompt_cache_disk_bytes":
            settings[f"rank_default_{f.name}"] = getattr(rs, f.name)
    settings["prompt_cache_disk"] = False
    srv = Server(name, url, "", proc, log, settings)
    try:
        _wait_ready(url + "/ready", proc, f"lockstep up ({name})", log, timeout)
        srv.model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        kids = _descendants(proc.pid)
        ranks = [p for p in kids if "services.rank" in " ".join(p.cmdline())]
        if len(ranks) != tp:
            raise ServerError(f"{name}: expected {tp} rank processes, found "
                              f"{[' '.join(p.cmdline()[:4]) for p in ranks]}")
        srv.evidence = [process_evidence(p.pid) for p in ranks]
        check_blas(srv)
    except BaseException:
        stop(srv)
        raise
    return srv


def mlx_lm(model: Path, work: Path, cache: bool, timeout: float = 600) -> Server:
    """`python -m mlx_lm server` with a rank's environment and RankSettings' batch sizes."""
    name = f"mlx_lm-cache-{'on' if cache else 'off'}"
    log = work / f"{name}.log"
    port = free_port()
    b = batch_settings()
    flags = ["--decode-concurrency", str(b["max_batch"]), "--prompt-concurrency",
             str(b["prefill_batch"]), "--prefill-step-size", str(b["prefill_step"]),
             "--prompt-cache-size", str(MLX_LM_DEFAULT_CACHE_SIZE if cache else 0)]
    b = {k: v for k, v in b.items() if not k.startswith("lockstep_only")}
    # bench.mlx_lm_serve: `python -m mlx_lm server`, with the gateway's listen backlog.
    cmd = [sys.executable, "-m", "bench.mlx_lm_serve", "--model", str(model), "--port", str(port),
           "--log-level", "WARNING", *flags]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import mlx_lm as _m

    from bench.mlx_lm_serve import listen_backlog

    settings = {"cmd": ["python", *cmd[1:]], "prefix_cache": cache,
                "mlx_lm_version": getattr(_m, "__version__", "?"),
                "listen_backlog": listen_backlog(), **b}
    srv = Server(name, url, str(model), proc, log, settings)
    try:
        _wait_ready(url + "/v1/models", proc, f"mlx_lm server ({name})", log, timeout)
        srv.evidence = [process_evidence(proc.pid)]
        check_blas(srv)
    except BaseException:
        stop(srv)
        raise
    return srv


def stop(srv: Server) -> int | None:
    """Lockstep: SIGINT (verified teardown); mlx_lm: SIGTERM; then the group is killed."""
    proc = srv.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT if srv.name.startswith("lockstep") else signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything it left in its group
    srv.exit_code = proc.returncode
    return srv.exit_code


def source_record() -> dict:
    """Which code ran: the checkout's commit and whether it had local changes, or (a
    snapshot without .git, e.g. `git archive`) what LOCKSTEP_BENCH_SOURCE says."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "common", "services"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()
        return {"commit": head, "uncommitted_changes_in_common_services": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"snapshot": os.environ.get("LOCKSTEP_BENCH_SOURCE", "unknown")}


def environment_record() -> dict:
    """The code, the host, the BLAS switches and the rank environment both servers get."""
    env = rank_env()
    return {"source": source_record(), "rank_environment": {k: env.get(k) for k in ENV_KEYS},
            "batch": batch_settings(), "loadavg": os.getloadavg(), "cpus": os.cpu_count()}
