"""The first request after `/ready` against the next two (issue 30 item 4).

`lockstep up` with no --model (the default model, SmolLM2-135M served PP=2, as `make up`
serves it), started fresh several times in one home (the model is built once): COLD
starts each with an empty TMPDIR (MLX's CPU backend compiles fused kernels with the C++
compiler on first use and keeps the libraries in $TMPDIR/mlx: empty is a fresh machine
or a cleared /tmp), then WARM starts sharing one TMPDIR a start already filled. In each
start, right after `/ready` turns 200, the banner's request three times in a row
(non-streaming, as the banner's curl sends it, temperature 0 so every start generates the
same tokens). Rows: COLD greedy starts; one cold start that samples (temperature 0.7,
top_p 0.9, seed 1: a first request sampling with top_p builds mlx-lm's compiled top_p
kernels unless something did before); WARM greedy starts; one warm start with the prefix
cache off (--prompt-cache-entries 0). With the cache on, the second and third requests
reuse 36 of the 37 prompt tokens from rank 0's prefix cache (one forward pass instead of
a prefill and a pass): that part of first/second is the cache's, not a warm-up's; the
cache-off row shows the warm-up's part alone. Per request: model TTFT and visible TTFT
(the x-lockstep-ttft-* headers; non-streaming, visible is when the body is sent) and the
client's wall time; per start: seconds from spawning `lockstep up` to `/ready`, and the
warm-up's own lines (each rank's "warmed: ...", the gateway's tokenizer line). Ratios are
first / second within one start; the target is <= 1.5 for both TTFTs.

    python -m bench.first_request [--cold 2] [--warm 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import write_result
from bench.servers import ROOT, Server, _wait_ready, environment_record, free_port, stop

COLD = 2
WARM = 2
REQUESTS = 3
TARGET = 1.5
BODY = {"model": "smollm2", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 1}
WARMED = re.compile(r"warmed: .*")


def _request(url: str, sampling: dict) -> dict:
    body = {**BODY, **sampling}
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    wall = (time.monotonic() - t0) * 1000
    r.raise_for_status()
    usage = r.json()["usage"]
    return {"model_ttft_ms": float(r.headers["x-lockstep-ttft-model-ms"]),
            "visible_ttft_ms": float(r.headers["x-lockstep-ttft-visible-ms"]),
            "wall_ms": round(wall, 1), "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def _warm_lines(home: Path) -> dict:
    """Each rank's "warmed: ..." line from this start's rank logs (newest job, by mtime),
    its seconds, and the gateway's tokenizer line."""
    logs = home / "runtime" / "logs"
    ranks = sorted(logs.glob("j-*-rank*.log"), key=lambda p: p.stat().st_mtime)
    out: dict = {"ranks": {}, "seconds": {}}
    if ranks:
        job = ranks[-1].name.rsplit("-rank", 1)[0]
        for p in sorted(x for x in ranks if x.name.startswith(job + "-rank")):
            name = p.name.rsplit("-", 1)[1][:-4]
            m = WARMED.search(p.read_text(errors="replace"))
            out["ranks"][name] = m.group(0) if m else None
            if m and (s := re.search(r"in ([0-9.]+)s$", m.group(0))):
                out["seconds"][name] = float(s.group(1))
    gw = logs / "gateway.log"
    lines = gw.read_text(errors="replace").splitlines() if gw.exists() else []
    out["gateway"] = next((ln.split(": ", 1)[-1] for ln in reversed(lines)
                           if "lockstep.gateway.tokenizers" in ln), None)
    return out


def one_start(home: Path, work: Path, i: int, tmp: Path, kind: str,
              sampling: dict | None = None, cache: bool = True) -> dict:
    sampling = sampling or {}
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    log = work / f"up-{i}.log"
    cmd = [sys.executable, "-m", "services", "up", "--home", str(home), "--port", str(port),
           "--admin-port", "0", "--events-port", "0", "--control-port", "0",
           "--report-port", "0", "--reaper-events-port", "0",
           *([] if cache else ["--prompt-cache-entries", "0"])]
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server(f"lockstep-default-{i}", f"http://127.0.0.1:{port}", "smollm2", proc, log)
    try:
        _wait_ready(srv.url + "/ready", proc, "lockstep up", log, 900)
        ready_s = time.monotonic() - t0
        reqs = [_request(srv.url, sampling) for _ in range(REQUESTS)]
    finally:
        stop(srv)
    first, second = reqs[0], reqs[1]
    return {"start": i, "mlx_kernel_cache": kind, "sampling": sampling or "greedy",
            "prefix_cache": cache, "spawn_to_ready_s": round(ready_s, 2), "requests": reqs,
            "first_over_second_model": round(first["model_ttft_ms"] / second["model_ttft_ms"], 2),
            "first_over_second_visible": round(first["visible_ttft_ms"]
                                               / second["visible_ttft_ms"], 2),
            "warm_up": _warm_lines(home), "exit_code": srv.exit_code}


def run(out_dir=None, cold: int = COLD, warm: int = WARM) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-first-") as td:
        work = Path(td)
        home = work / "home"
        one_start(home, work, 0, work / "tmp-warm", "warm")  # builds the model; not counted
        rows = [one_start(home, work, i + 1, work / f"tmp-cold-{i}", "cold")
                for i in range(cold)]
        rows.append(one_start(home, work, cold + 1, work / "tmp-cold-sampled", "cold",
                              SAMPLED))
        rows += [one_start(home, work, cold + i + 2, work / "tmp-warm", "warm")
                 for i in range(warm)]
        rows.append(one_start(home, work, cold + warm + 2, work / "tmp-warm", "warm",
                              cache=False))
    worst_m = max(r["first_over_second_model"] for r in rows)
    worst_v = max(r["first_over_second_visible"] for r in rows)
    off = [r["first_over_second_model"] for r in rows if not r["prefix_cache"]]
    warm_s = [max(r["warm_up"]["seconds"].values(), default=0.0) for r in rows]
    result = {
        "bench": "first_request", "model": "smollm2 (lockstep up default: tp=1, pp=2)",
        "request": BODY, "sampled_start": SAMPLED, "starts": rows,
        "median_spawn_to_ready_s": round(statistics.median(r["spawn_to_ready_s"]
                                                           for r in rows), 2),
        "worst_first_over_second_model": worst_m, "worst_first_over_second_visible": worst_v,
        "first_over_second_model_prefix_cache_off": off,
        "rank_warm_up_s": {"cold": [w for w, r in zip(warm_s, rows, strict=True)
                                    if r["mlx_kernel_cache"] == "cold"],
                           "warm": [w for w, r in zip(warm_s, rows, strict=True)
                                    if r["mlx_kernel_cache"] == "warm"]},
        "target": f"first request's model and visible TTFT <= {TARGET}x the second's, "
                  "every start (issue 30 item 4)",
        "met": worst_m <= TARGET and worst_v <= TARGET,
        "summary": f"first/second worst: model {worst_m}x, visible {worst_v}x; prefix cache "
                   f"off: model {off}; "
                   f"spawn to /ready median {statistics.median(r['spawn_to_ready_s'] for r in rows):.1f}s",
        "environment": environment_record(),
    }
    write_result(out_dir, "first_request", result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", type=int, default=COLD)
    ap.add_argument("--warm", type=int, default=WARM)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(json.dumps(run(a.out, a.cold, a.warm), indent=2))


if __name__ == "__main__":
    main()
