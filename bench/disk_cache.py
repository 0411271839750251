"""The prefix cache's disk tier (issue 32 item 6), on real ranks (the rank harness: no
gateway, so the numbers are the ranks' own), ratios within one run.

(a) Restart: a deployment serves turn 1 of a `conversation_tokens`-token conversation
    (max_tokens 16) and stops (its writes flushed); a new deployment on the same home
    and cache key serves turn 2 (turn 1 + its reply + 60 new tokens): TTFT from disk.
    Then, on that deployment: another turn 2 sharing the same history (the entry is now
    in memory: TTFT from memory), and a distinct prompt of the same length (a miss:
    TTFT cold). TTFT is rank 0's own (`model_ttft_ms`: GENERATE received → first
    token). `trials` trials, each with its own text and home; ratios of medians.
(b) Decode while writing: `streams` greedy streams of `stream_tokens` tokens decode
    while a 1000-token prompt finishes every `write_every_s` (max_tokens 1), so its KV
    is stored and, with the disk tier on, written through. Aggregate decode tokens/s of
    the streams (rank 0's per-token clock, first to last token) with the disk tier on
    vs off (otherwise identical deployments, both up; runs alternate on/off), and the
    bytes written per second meanwhile.

    python -m bench.disk_cache [--preset bench] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import RESULTS, write_result
from tests.e2e.rank_harness import Deployment
from tests.e2e.rank_harness import words as harness_words

NAME = "disk_cache"
TARGET_DISK_VS_COLD = 0.3
TARGET_DECODE_RATIO = 0.95


def words(seed: int, n: int) -> list[int]:
    return harness_words(seed, n, vocab=1000)  # the prompts bench/results was measured with


def settings(disk_bytes: int) -> dict:
    return {"prompt_cache_disk_bytes": disk_bytes}


def ttft(d: Deployment, prompt: list[int], max_tokens: int = 4) -> tuple[float, Any]:
    r = d.generate(prompt, max_tokens=max_tokens, timeout=900)
    assert r.model_ttft_ms is not None and r.error is None, r
    return r.model_ttft_ms, r


def flushed(d: Deployment, entries: int) -> None:
    """Every rank has written `entries` entries (its telemetry says so)."""
    for r in range(d.world):
        d.wait(lambda r=r: (t := d.telemetry(r)) and t.cache and t.cache.disk_written >= entries,
               120, f"rank {r}'s writes")


def restart_trial(root: Path, preset: str, mode: str, n: int, seed: int) -> dict[str, Any]:
    home, key = root / f"home-{mode}-{seed}", secrets.token_bytes(32)
    p1 = words(seed, n)
    with Deployment(root / f"w-{mode}-{seed}", mode=mode, preset=preset, home=home,
                    cache_key=key, settings=settings(8 << 30)) as d:
        _, r1 = ttft(d, p1, max_tokens=16)
        flushed(d, 1)
        d.shutdown()
    turn2 = p1 + r1.tokens + words(seed + 1, 60)
    with Deployment(root / f"r-{mode}-{seed}", mode=mode, preset=preset, home=home,
                    cache_key=key, settings=settings(8 << 30)) as d:
        t0 = time.perf_counter()
        disk, rd = ttft(d, turn2)
        disk_wall = (time.perf_counter() - t0) * 1000
        mem, rm = ttft(d, p1 + r1.tokens + words(seed + 2, 60))
        cold, rc = ttft(d, words(seed + 3, len(turn2)))
        cached = [c.chunks[0].cached_tokens for c in (rd, rm, rc)]
    return {"seed": seed, "prompt_tokens": len(turn2), "cached_tokens": cached,
            "ttft_ms": {"disk": disk, "memory": mem, "cold": cold},
            "disk_client_wall_ms": disk_wall}


def decode_run(d: Deployment, streams: int, stream_tokens: int, write_every_s: float,
               seed: int) -> dict[str, Any]:
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        i = 0
        while not stop.is_set():
            d.generate(words(seed * 100 + i, 1000), max_tokens=1, timeout=900)
            writes[0] += 1
            i += 1
            stop.wait(write_every_s)

    before = d.fresh_telemetry(0).cache
    th = threading.Thread(target=writer, daemon=True)
    rids = [d.submit(words(seed * 1000 + s, 32), stream_tokens) for s in range(streams)]
    th.start()
    res = [d.result(r, timeout=1800) for r in rids]
    stop.set()
    th.join(timeout=900)
    t_first = min(r.token_times[0] for r in res)
    t_last = max(r.token_times[-1] for r in res)
    n = sum(len(r.tokens) - 1 for r in res)
    after = d.fresh_telemetry(0).cache
    return {"decode_tps": n / (t_last - t_first), "seconds": t_last - t_first,
            "write_requests": writes[0],
            "disk_written": after.disk_written - before.disk_written,
            "entry_bytes": after.disk_bytes / max(1, after.disk_entries)}


def run(out_dir: Path | str | None = None, *, preset: str = "bench", quick: bool = False,
        modes: tuple[str, ...] = ("single", "tp")) -> dict[str, Any]:
    n = 1000 if quick else 4000
    trials = 1 if quick else 3
    runs = 1 if quick else 3
    out: dict[str, Any] = {
        "name": NAME, "preset": preset, "conversation_tokens": n, "trials": trials,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_start": os.getloadavg()},
        "settings": {"prompt_cache_entries": 32, "prompt_cache_bytes": "1 GiB (rank default)",
                     "prompt_cache_disk_bytes": 8 << 30},
        "restart": {}, "decode": {}}
    with tempfile.TemporaryDirectory(prefix="bench-disk-") as tmp:
        root = Path(tmp)
        for mode in modes:
            rows = [restart_trial(root, preset, mode, n, 11 + 7 * t) for t in range(trials)]
            med = {k: statistics.median(r["ttft_ms"][k] for r in rows)
                   for k in ("disk", "memory", "cold")}
            out["restart"][mode] = {
                "rows": rows, "median_ttft_ms": med,
                "disk_vs_cold": med["disk"] / med["cold"],
                "disk_vs_memory": med["disk"] / med["memory"],
                "target_disk_vs_cold": TARGET_DISK_VS_COLD,
                "met": med["disk"] / med["cold"] <= TARGET_DISK_VS_COLD}
            print(f"restart {mode}: {med}", flush=True)
        streams, stream_tokens, every = 4, 64 if quick else 200, 0.5
        with Deployment(root / "on", preset=preset, home=root / "home-on",
                        cache_key=secrets.token_bytes(32), settings=settings(8 << 30)) as on, \
                Deployment(root / "off", preset=preset, settings=settings(0)) as off:
            rows = []
            for i in range(runs):
                order = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))
                for which, d in order:
                    r = decode_run(d, streams, stream_tokens, every, 500 + i)
                    r.update(which=which, run=i, load_avg=os.getloadavg())
                    rows.append(r)
                    print(f"decode {which} run {i}: {r['decode_tps']:.1f} tok/s", flush=True)
        tps = {w: statistics.median(r["decode_tps"] for r in rows if r["which"] == w)
               for w in ("on", "off")}
        on_rows = [r for r in rows if r["which"] == "on"]
        out["decode"] = {
            "streams": streams, "stream_tokens": stream_tokens, "write_every_s": every,
            "write_prompt_tokens": 1000, "rows": rows, "median_tps": tps,
            "on_vs_off": tps["on"] / tps["off"], "target_on_vs_off": TARGET_DECODE_RATIO,
            "met": tps["on"] / tps["off"] >= TARGET_DECODE_RATIO,
            "bytes_written_per_s": statistics.median(
                r["entry_bytes"] * r["disk_written"] / r["seconds"] for r in on_rows)}
    out["machine"]["load_avg_end"] = os.getloadavg()
    write_result(out_dir, NAME, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="single,tp")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    r = run(a.out, preset=a.preset, quick=a.quick, modes=tuple(a.modes.split(",")))
    print({k: r["restart"][k]["disk_vs_cold"] for k in r["restart"]},
          r["decode"]["on_vs_off"])


if __name__ == "__main__":
    main()
