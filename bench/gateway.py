"""Gateway benchmark: generated tokens/s end to end through `lockstep up` (gateway +
supervisor + one rank) vs rank 0's batch loop driven in-process on the same model and
batch, and vs `python -m mlx_lm server` on the same model directory; same prompts,
same run, concurrency 1 and 8; throughput and TTFT side by side.

- in-process: `services.rank.engine.Engine` (rank 0's BatchGenerator wrapper, the same
  `RankSettings`) fed the same token ids, stepped until done, in a subprocess started
  with the rank environment (OpenBLAS preload, MLX buffer limits) — what a rank runs.
- lockstep: `lockstep up --tp 1 --model DIR`; streaming /v1/completions with usage.
- mlx_lm: `python -m mlx_lm server` with the same batch sizes and environment.

Workload per measurement: concurrency 1 = 4 requests one after another; concurrency
8 = 8 requests at once. Greedy, fixed max_tokens. TTFT for HTTP is client-side (first
non-empty text chunk); lockstep also reports rank 0's model TTFT. Trials rotate the
order of the three systems; medians are reported.

    python -m bench.gateway [--presets tiny,bench] [--trials 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the cat reads a long letter", "a farmer builds the map in the kitchen",
           "our team answers every message", "the old server restarts the broken clock",
           "a curious child paints the garden gate", "the night shift counts two tickets",
           "a tired engineer repairs the bright lamp", "the orchestra plays the quiet song"]
MAX_TOKENS = {"tiny": 128, "bench": 64}
RANK_BATCH = ["--decode-concurrency", "16", "--prompt-concurrency", "8",
              "--prefill-step-size", "512"]  # = RankSettings max_batch/prefill_batch/prefill_step


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env() -> dict[str, str]:
    from common.rankspec import RankSettings
    from services.rank.env import rank_environment

    return rank_environment(RankSettings(), os.environ)


def workload(conc: int) -> list[str]:
    return PROMPTS[:4] if conc == 1 else PROMPTS[:8]


# --- in-process: rank 0's engine ---------------------------------------------------------


def inproc_main(model_dir: str, conc: int, max_tokens: int) -> dict:
    from mlx_lm import load

    from common.messages import PlanInsert
    from common.rankspec import RankSettings
    from services.rank.engine import Engine

    model, tok = load(model_dir)
    eng = Engine(model, sorted(tok.eos_token_ids), RankSettings())
    ids = [tok.encode(p) for p in workload(conc)]

    def run(batch: list[list[int]], tag: str) -> tuple[int, list[float]]:
        t0 = time.monotonic()
        ins = [PlanInsert(f"{tag}-{i}", p, max_tokens, 0.0, 1.0, 0) for i, p in enumerate(batch)]
        eng.apply([], ins)
        first: dict[str, float] = {}
        n = 0
        while eng.has_work():
            emitted, _ = eng.next()
            now = time.monotonic()
            for e in emitted:
                if e.token is not None:
                    n += 1
                    first.setdefault(e.active.request_id, (now - t0) * 1000)
        return n, list(first.values())

    groups = [[p] for p in ids] if conc == 1 else [ids]
    for gi, g in enumerate(groups):  # warm: the very same shapes, unmeasured
        run(g, f"warm{gi}")
    t0 = time.monotonic()
    n, ttft = 0, []
    for gi, g in enumerate(groups):
        k, f = run(g, f"g{gi}")
        n, ttft = n + k, ttft + f
    secs = time.monotonic() - t0
    return {"tokens": n, "seconds": secs, "tok_s": n / secs, "ttft_ms": statistics.median(ttft)}


def inproc(model_dir: Path, conc: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.gateway", "--inproc", str(model_dir),
                          "--conc", str(conc), "--max-tokens", str(max_tokens)], cwd=ROOT,
                         env=_rank_env(), capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- HTTP clients ------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
               max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft, n_chunks, usage, model_ttft, vis = None, 0, None, None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices") and d["choices"][0].get("text"):
                n_chunks += 1
                if ttft is None:
                    ttft = (time.monotonic() - t0) * 1000
            if d.get("usage"):
                usage = d["usage"]
            if isinstance(d.get("lockstep"), dict):
                model_ttft = d["lockstep"].get("ttft_model_ms")
                vis = d["lockstep"].get("ttft_visible_ms")
    return {"tokens": usage["completion_tokens"] if usage else n_chunks, "ttft_ms": ttft,
            "model_ttft_ms": model_ttft, "server_visible_ttft_ms": vis}


async def _http_run(url: str, model: str, conc: int, max_tokens: int, warm: bool = True) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        if warm:
            await _one(client, url, model, PROMPTS[0], 8)
        t0 = time.monotonic()
        if conc == 1:
            res = [await _one(client, url, model, p, max_tokens) for p in workload(1)]
        else:
            res = await asyncio.gather(*[_one(client, url, model, p, max_tokens)
                                         for p in workload(conc)])
        secs = time.monotonic() - t0
    n = sum(r["tokens"] for r in res)
    out = {"tokens": n, "seconds": secs, "tok_s": n / secs,
           "ttft_ms": statistics.median(r["ttft_ms"] for r in res if r["ttft_ms"] is not None)}
    for key in ("model_ttft_ms", "server_visible_ttft_ms"):
        vals = [r[key] for r in res if r[key] is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def http(url: str, model: str, conc: int, max_tokens: int, warm: bool = True) -> dict:
    return asyncio.run(_http_run(url, model, conc, max_tokens, warm))


def _token_latency(url: str) -> tuple[float, float]:
    """(sum, count) of lockstep_token_latency_seconds: rank 0's own inter-token times."""
    tot = cnt = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lockstep_token_latency_seconds_sum"):
            tot += float(line.split()[-1])
        elif line.startswith("lockstep_token_latency_seconds_count"):
            cnt += float(line.split()[-1])
    return tot, cnt


def lockstep_http(url: str, model: str, conc: int, max_tokens: int, gw_pid: int | None) -> dict:
    """As `http`, plus rank 0's inter-token time and the gateway's CPU per token."""
    import psutil

    http(url, model, 1, 8, warm=False)  # warm outside the measured window
    s0, c0 = _token_latency(url)
    cpu0 = sum(psutil.Process(gw_pid).cpu_times()[:2]) if gw_pid else 0.0
    out = http(url, model, conc, max_tokens, warm=False)
    s1, c1 = _token_latency(url)
    if c1 > c0:
        out["rank_token_interval_ms"] = (s1 - s0) / (c1 - c0) * 1000
    if gw_pid:
        cpu = sum(psutil.Process(gw_pid).cpu_times()[:2]) - cpu0
        out["gateway_cpu_us_per_token"] = cpu / max(1, out["tokens"]) * 1e6
    return out


def _gateway_pid(up: subprocess.Popen) -> int | None:
    import psutil

    for c in psutil.Process(up.pid).children(recursive=True):
        if "gateway" in " ".join(c.cmdline()):
            return c.pid
    return None


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready within {timeout}s")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# --- the benchmark ---------------------------------------------------------------------


def bench_preset(preset: str, trials: int, work: Path) -> dict:
    from common.tinymodel import build_model

    model = build_model(work / "models" / preset, preset=preset)
    max_tokens = MAX_TOKENS[preset]
    lp, mp = _free_port(), _free_port()
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--home", str(work / f"home-{preset}"),
                           "--port", str(lp), "--tp", "1", "--model", str(model), "--admin-port", "0",
                           "--events-port", "0", "--control-port", "0", "--report-port", "0",
                           "--reaper-events-port", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    mlx = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                            "--port", str(mp), "--log-level", "WARNING", *RANK_BATCH], cwd=ROOT,
                           env=_rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    runs: dict[str, dict[int, list[dict]]] = {k: {1: [], 8: []} for k in ("inproc", "lockstep", "mlx_lm")}
    try:
        _wait(f"http://127.0.0.1:{lp}/ready", up, "lockstep up")
        _wait(f"http://127.0.0.1:{mp}/v1/models", mlx, "mlx_lm server")
        gw_pid = _gateway_pid(up)
        systems = {
            "inproc": lambda c: inproc(model, c, max_tokens),
            "lockstep": lambda c: lockstep_http(f"http://127.0.0.1:{lp}", model.name, c,
                                                max_tokens, gw_pid),
            "mlx_lm": lambda c: http(f"http://127.0.0.1:{mp}", str(model), c, max_tokens),
        }
        order = list(systems)
        for conc in (1, 8):  # warm the servers with the very same workload, unmeasured
            http(f"http://127.0.0.1:{lp}", model.name, conc, max_tokens)
            http(f"http://127.0.0.1:{mp}", str(model), conc, max_tokens)
        for t in range(trials):
            for conc in (1, 8):
                for name in order[t % 3:] + order[:t % 3]:
                    r = systems[name](conc)
                    runs[name][conc].append(r)
                    print(f"  {preset} trial {t} conc {conc} {name:8s} {r['tok_s']:8.1f} tok/s "
                          f"ttft {r['ttft_ms']:7.1f} ms", flush=True)
    finally:
        up_code = _stop(up)
        _stop(mlx, signal.SIGTERM)

    def med(name: str, conc: int, key: str) -> float | None:
        vals = [r[key] for r in runs[name][conc] if r.get(key) is not None]
        return round(statistics.median(vals), 2) if vals else None

    out: dict = {"model": str(model), "max_tokens": max_tokens, "trials": runs,
                 "lockstep_up_exit": up_code, "summary": {}}
    for conc in (1, 8):
        keys = ("tok_s", "ttft_ms", "model_ttft_ms", "server_visible_ttft_ms", "tokens",
                "rank_token_interval_ms", "gateway_cpu_us_per_token")
        s = {name: {k: v for k in keys if (v := med(name, conc, k)) is not None}
             for name in systems}
        s["ratio_lockstep_vs_inproc"] = round(s["lockstep"]["tok_s"] / s["inproc"]["tok_s"], 3)
        s["ratio_lockstep_vs_mlx_lm"] = round(s["lockstep"]["tok_s"] / s["mlx_lm"]["tok_s"], 3)
        out["summary"][f"concurrency_{conc}"] = s
    return out


def run(out_dir: Path | str | None = None, presets: tuple[str, ...] = ("tiny", "bench"),
        trials: int = 3) -> dict:
    result = {"benchmark": "gateway", "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "started": time.time(),
              "targets": {"ratio_lockstep_vs_inproc": ">= 0.9",
                          "ratio_lockstep_vs_mlx_lm_at_8": ">= 1.0"},
              "presets": {}, "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-gw-") as tmp:
        for preset in presets:
            result["presets"][preset] = bench_preset(preset, trials, Path(tmp))
    result["seconds"] = round(time.time() - result["started"], 1)
    # Other work on the machine moves these numbers a lot on 2 cores: recorded with them.
    result["loadavg_end"] = os.getloadavg()
    write_result(out_dir if out_dir is not None else RESULTS, "gateway", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,bench")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--inproc", help=argparse.SUPPRESS)
    ap.add_argument("--conc", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=128, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.inproc:
        print(json.dumps(inproc_main(a.inproc, a.conc, a.max_tokens)))
        return 0
    res = run(a.out, tuple(p for p in a.presets.split(",") if p), a.trials)
    print(json.dumps({p: r["summary"] for p, r in res["presets"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
