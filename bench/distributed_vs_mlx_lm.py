"""Lockstep TP=2 vs mlx_lm.server's own distributed mode (`mlx.launch -n 2 ... mlx_lm.server`,
tensor parallel over the ring backend), side by side in one run, on one model directory.

Systems (bench preset, built into the run's work directory; the tiny default cannot run TP=2):
- lockstep_tp2: `lockstep up --tp 2 --prompt-cache-entries 0` (bench/servers.py).
- mlx_lm_launch: `mlx.launch -n 2 --backend ring --starting-port P --cwd REPO --env K=V ...
  -- python -m bench.mlx_lm_serve --model DIR --decode-concurrency 16 --prompt-concurrency 8
  --prefill-step-size 512 --prompt-cache-size 0`; the `--env`s are the rank environment
  (common/rank_env.py: the same OpenBLAS LD_PRELOAD, OPENBLAS_NUM_THREADS=1, MLX buffer
  limits), checked on both running ranks (bench.servers.check_blas; the run fails
  otherwise). bench.mlx_lm_serve is `mlx_lm server` with the gateway's listen backlog.
- mlx_lm_ranks: the same two mlx_lm.server ranks started by the bench the way mlx.launch
  starts them (MLX_RANK, MLX_HOSTFILE), without the launcher: mlx.launch relays each
  rank's stdio in a thread whose select() includes the rank's always-writable stdin pipe,
  so it never blocks; its CPU (`launcher` in cpu_us_per_token) is taken from the 2 cores.
  Throughput only: this row says what mlx_lm's serving costs apart from its launcher.

Batch/prefill: RankSettings max_batch / prefill_batch / prefill_step = the flags above;
prefix caches off on both. Workload: per concurrency (1, 8) N distinct prompts
(bench/workload.py, log-uniform 300-2000 tokens by the model's tokenizer), the same for
every system; greedy, max_tokens fixed, completion tokens counted from `usage` (neither
server has ignore_eos). Reported: tokens/s, TTFT p50/p99, ITL p50, CPU per token per
process; ratios against mlx_lm_launch from the same run. Then the fault on lockstep_tp2
and mlx_lm_launch (bench/distributed_fault.py): SIGKILL rank 1 mid-stream of 4 streams.

    python -m bench.distributed_vs_mlx_lm [--quick] [--out DIR]
        → bench/results/distributed_vs_mlx_lm.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from bench import RESULTS, write_result
from bench import cpu_breakdown as cb
from bench import distributed_fault as df
from bench import servers as sv
from bench.chat_client import CLIENT, ms, pct, run_concurrent, summarize
from bench.workload import chat_prompt_tokens, load_tokenizer, log_uniform_lengths, prose
from common import ports

ROOT = Path(__file__).resolve().parents[1]
MLX_LAUNCH = Path(sys.executable).with_name("mlx.launch")
BASELINE = "mlx_lm_launch"


@dataclass
class Config:
    concurrencies: tuple[int, ...] = (1, 8)
    requests: dict[int, int] = field(default_factory=lambda: {1: 6, 8: 16})
    prompt_tokens: tuple[int, int] = (300, 2000)
    max_tokens: int = 64
    systems: tuple[str, ...] = ("lockstep_tp2", "mlx_lm_launch", "mlx_lm_ranks")
    fault_systems: tuple[str, ...] = ("lockstep_tp2", "mlx_lm_launch")
    fault_prompt_tokens: int = 400
    fault: df.FaultConfig = field(default_factory=df.FaultConfig)
    seed: str = "dist-1"


def quick() -> Config:
    return Config(requests={1: 2, 8: 8}, prompt_tokens=(200, 600), max_tokens=16,
                  systems=("lockstep_tp2", "mlx_lm_launch"),
                  fault=df.FaultConfig(max_tokens=600, kill_after_chunks=3, client_bound_s=30,
                                       survey_after_s=30, recover_bound_s=120))


def _ring_ports() -> int:
    """A port P with P and P+1 free (mlx.launch's ring listens on P + rank)."""
    for _ in range(50):
        p = ports.free_ports(1)[0]
        with contextlib.suppress(OSError), socket.create_server(("127.0.0.1", p + 1)):
            return p
    raise sv.ServerError("no two consecutive free ports")


def mlx_lm_tp2(model: Path, work: Path, launcher: bool, timeout: float = 900) -> sv.Server:
    """Two mlx_lm.server ranks (TP over ring), by mlx.launch or started directly."""
    name = "mlx_lm_launch" if launcher else "mlx_lm_ranks"
    log, port, ring = work / f"{name}.log", sv.free_port(), _ring_ports()
    b = sv.batch_settings()
    flags = ["--decode-concurrency", str(b["max_batch"]), "--prompt-concurrency",
             str(b["prefill_batch"]), "--prefill-step-size", str(b["prefill_step"]),
             "--prompt-cache-size", "0"]
    serve = [sys.executable, "-m", "bench.mlx_lm_serve", "--model", str(model), "--port",
             str(port), "--log-level", "WARNING", *flags]
    renv = sv.rank_env()
    added = {k: v for k, v in renv.items() if os.environ.get(k) != v}  # what a rank gets
    base = {k: v for k, v in renv.items() if k not in added}
    base["PYTHONPATH"] = str(ROOT)
    extra: list[subprocess.Popen] = []
    with open(log, "ab") as out:
        if launcher:
            envs = [a for k, v in sorted(added.items()) for a in ("--env", f"{k}={v}")]
            cmd = [str(MLX_LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring),
                   "--cwd", str(ROOT), *envs, "--", *serve]
            # stdin: a pipe held open (mlx.launch reads and relays it; /dev/null would spin).
            proc = subprocess.Popen(cmd, cwd=ROOT, env=base, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        else:
            hosts = work / f"{name}-hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
            env = {**base, **added, "MLX_HOSTFILE": str(hosts)}
            cmd = serve
            proc = subprocess.Popen(serve, cwd=ROOT, env={**env, "MLX_RANK": "0"}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            extra.append(subprocess.Popen(serve, cwd=ROOT, env={**env, "MLX_RANK": "1"},
                                          stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # stop() kills it
    import mlx_lm as _m

    settings = {"cmd": [Path(c).name if c == sys.executable else c for c in cmd],
                "rank_env_added": added, "ring_ports": [ring, ring + 1], "prefix_cache": False,
                "mlx_lm_version": getattr(_m, "__version__", "?"),
                **{k: v for k, v in b.items() if not k.startswith("lockstep_only")}}
    srv = sv.Server(name, f"http://127.0.0.1:{port}", str(model), proc, log, settings)
    srv.extra = extra  # type: ignore[attr-defined]
    try:
        sv._wait_ready(srv.url + "/v1/models", proc, name, log, timeout)
        pids = [df.rank_pid(proc.pid, (str(model),), r) for r in (0, 1)]
        if None in pids:
            raise sv.ServerError(f"{name}: rank processes not found: {pids}")
        srv.evidence = [sv.process_evidence(p) for p in pids]
        sv.check_blas(srv)
    except BaseException:
        stop(srv, work)
        raise
    return srv


def start(name: str, model: Path, work: Path) -> sv.Server:
    if name == "lockstep_tp2":
        return sv.lockstep(model, work, 2, cache=False)
    return mlx_lm_tp2(model, work, launcher=name == "mlx_lm_launch")


def stop(srv: sv.Server, work: Path) -> None:
    """The server's own stop, then SIGKILL to anything of this run still alive (by pid:
    processes of the tree, or naming the run's work directory, which only this run has)."""
    sv.stop(srv)
    for p in getattr(srv, "extra", []):
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(30)
    for p in df.processes(srv.proc.pid, (str(work),)):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def roles(srv: sv.Server, work: Path) -> dict[str, int]:
    """role -> pid of every process serving `srv` (ranks by MLX_RANK, mlx.launch as launcher)."""
    out = {}
    for p in df.processes(srv.proc.pid, (str(work),)):
        role = df._role(p, srv.proc.pid)
        out[f"{role}_{p.pid}" if role in out else role] = p.pid
    return out


def measure(srv: sv.Server, work: Path, convs: list[list[dict]], max_tokens: int,
            conc: int) -> dict:
    me = os.getpid()

    def find() -> dict[str, int]:
        return {**roles(srv, work), "bench_client": me}

    cpu0 = cb.snapshot(find)
    replies, secs = asyncio.run(run_concurrent(srv.url, srv.model, convs, max_tokens, conc))
    cpu1 = cb.snapshot(find)
    row = summarize(replies, secs)
    row["ttft_p99_ms"] = ms(pct([r.ttft_s for r in replies if r.ttft_s is not None], 99))
    row["cpu_us_per_token"] = cb.compact(cb.breakdown(cpu0, cpu1, row["completion_tokens"]))
    row["loadavg"] = os.getloadavg()
    row["per_request"] = [r.record() for r in replies]
    return row


def workload(cfg: Config, tok, conc: int) -> list[list[dict]]:
    key = f"{cfg.seed}/c{conc}"
    lengths = log_uniform_lengths(cfg.requests[conc], *cfg.prompt_tokens, key)
    return [[{"role": "user", "content": prose(tok, n, f"{key}/r{i}")}]
            for i, n in enumerate(lengths)]


def ratios(rows: dict[str, dict[int, dict]]) -> dict:
    out: dict = {}
    base = rows.get(BASELINE, {})
    for name, by_c in rows.items():
        if name == BASELINE:
            continue
        for c, r in by_c.items():
            b = base.get(c)
            if not b or not b.get("tok_s") or not r.get("tok_s"):
                continue
            out[f"c{c}_tok_s_{name}_vs_{BASELINE}"] = round(r["tok_s"] / b["tok_s"], 3)
            for k in ("ttft_p50_ms", "ttft_p99_ms"):
                if r.get(k) and b.get(k):
                    out[f"c{c}_{k[:-3]}_{name}_vs_{BASELINE}"] = round(r[k] / b[k], 3)
    return out


def summary_line(result: dict) -> str:
    parts = []
    for c in result["config"]["concurrencies"]:
        vals = [f"{n} {result['throughput'].get(n, {}).get(c, {}).get('tok_s')}"
                for n in result["config"]["systems"]]
        parts.append(f"c{c} tok/s: " + ", ".join(vals))
    for n, f in result["fault"].items():
        rec = (f.get("recovery") or {}).get("served_after_kill_s")
        parts.append(f"fault {n}: {f.get('client_outcomes')}, served again after {rec} s")
    return "; ".join(parts)


def run(out_dir: Path | str | None = None, cfg: Config | None = None) -> dict:
    cfg = cfg or Config()
    out = out_dir if out_dir is not None else RESULTS
    result: dict = {
        "benchmark": "distributed_vs_mlx_lm", "host": platform.node(),
        "python": platform.python_version(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime()),
        "shared_machine": "a 2-core machine other engineers used at the same time (their "
                          "builds and tests ran during this run): absolute numbers move with "
                          "their load; loadavg is recorded per measurement; compare ratios",
        "config": asdict(cfg), "client": CLIENT, "environment": sv.environment_record(),
        "loadavg_before": os.getloadavg(), "servers": [], "throughput": {}, "fault": {},
        "errors": {}, "complete": False}
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="lockstep-benchdist-"))
    from models.tinymodel import build_model

    def save() -> None:
        result["ratios"] = ratios(result["throughput"])
        result["summary"] = summary_line(result)
        write_result(out, "distributed_vs_mlx_lm", result)

    try:
        model = build_model(work / "models" / "bench", preset="bench")
        tok = load_tokenizer(model)
        loads = {c: workload(cfg, tok, c) for c in cfg.concurrencies}
        ptoks = [len(chat_prompt_tokens(tok, m)) for w in loads.values() for m in w]
        result["model"] = {"dir": "<work>/models/bench", "preset": "bench",
                           "prompt_tokens": {"min": min(ptoks), "max": max(ptoks),
                                             "mean": round(sum(ptoks) / len(ptoks), 1)}}
        warm = [[{"role": "user", "content": prose(tok, 300, f"warm/{i}")}] for i in range(2)]
        fault_prompts = [[{"role": "user", "content": prose(tok, cfg.fault_prompt_tokens,
                                                            f"{cfg.seed}/fault/{i}")}]
                         for i in range(cfg.fault.streams)]
        for name in cfg.systems:
            print(f"== {name}", flush=True)
            try:
                srv = start(name, model, work)
            except Exception as exc:  # noqa: BLE001 - recorded; the other systems still run
                result["errors"][name] = f"start: {exc}"[:2000]
                save()
                continue
            try:
                asyncio.run(run_concurrent(srv.url, srv.model, warm, 8, 2))  # unmeasured
                for c in cfg.concurrencies:
                    r = measure(srv, work, loads[c], cfg.max_tokens, c)
                    result["throughput"].setdefault(name, {})[c] = r
                    print(f"  c{c}: {r['tok_s']} tok/s, ttft p50 {r['ttft_p50_ms']} p99 "
                          f"{r['ttft_p99_ms']} ms, load {r['loadavg'][0]:.2f}", flush=True)
                    save()
                if name in cfg.fault_systems:
                    result["fault"][name] = df.run_fault(
                        srv.url, srv.model, fault_prompts, cfg.fault, srv.proc.pid,
                        (str(work),), log=lambda s: print(s, flush=True))
                    f = result["fault"][name]
                    f["server_log_tail"] = [ln for ln in sv._tail(srv.log, 40).splitlines()
                                            if "warn" not in ln.lower()][-12:]
                    print(f"  fault: {f.get('client_outcomes')}; recovery "
                          f"{f.get('recovery', {}).get('served_after_kill_s')}; left "
                          f"{f.get('left_running')}", flush=True)
            except Exception as exc:  # noqa: BLE001
                result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            finally:
                stop(srv, work)
                result["servers"].append(srv.record())
                save()
        result["complete"] = not result["errors"]
    finally:
        result["loadavg_after"] = os.getloadavg()
        result["seconds"] = round(time.time() - t_start, 1)
        save()
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.distributed_vs_mlx_lm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small settings (a smoke, not a result)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    out = a.out
    if a.quick and out is None:  # a smoke never overwrites the committed result
        out = Path(tempfile.gettempdir()) / "lockstep-bench-quick"
    for sig in (signal.SIGTERM, signal.SIGHUP):  # leave through the finally blocks
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    res = run(out, quick() if a.quick else Config())
    print(f"wrote {out or RESULTS}/distributed_vs_mlx_lm.json")
    print(res["summary"])
    return 0 if res["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
