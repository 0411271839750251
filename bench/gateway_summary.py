"""The gateway benchmark's summary (bench/gateway.py): medians over trials per system
and concurrency, the ratios between systems in the same run, the per-process CPU
breakdown, and the issue-16 targets computed from them (never asserted).
"""

from __future__ import annotations

import statistics

from bench import cpu_breakdown as cb


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


KEYS = ("tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "completion_tokens",
        "prompt_tokens_mean", "chunks_per_token", "cached_tokens_total",
        "lockstep_model_ttft_p50_ms", "rank_token_interval_ms", "gateway_cpu_us_per_token")


def _per_trial(a: list[dict], b: list[dict]) -> list[float | None]:
    """tok/s ratio per trial: trial i of both systems ran the same prompts, so the pairs
    show how much of a median ratio is drift of the machine between the two runs."""
    return [_ratio(x.get("tok_s"), y.get("tok_s")) for x, y in zip(a, b, strict=False)]


def _median_tree(trees: list):
    """Leaf-wise median of same-shaped dicts of numbers; null where any trial was null
    (the raw trials say why)."""
    if any(t is None for t in trees):
        return None
    if isinstance(trees[0], dict):
        return {k: _median_tree([t.get(k) for t in trees]) for k in trees[0]}
    return round(statistics.median(trees), 3)


def breakdown_summary(rows: list[dict]) -> dict:
    """Per system and concurrency: wall ms and per-process CPU µs per completion token,
    medians over trials (bench/cpu_breakdown.compact)."""
    rows = [r for r in rows if "cpu_us_per_token" in r]
    if not rows:
        return {}
    wall = [r["wall_ms_per_token"] for r in rows if r.get("wall_ms_per_token") is not None]
    cpu = [cb.compact(r["cpu_us_per_token"]) for r in rows]
    # Same roles in every trial, or the median would mix processes: keep the common ones.
    common = set.intersection(*(set(c) for c in cpu))
    return {"wall_ms_per_token": round(statistics.median(wall), 3) if wall else None,
            "cpus": rows[0]["cpus"],
            "cpu_us_per_token": {k: _median_tree([c[k] for c in cpu])
                                 for k in cpu[0] if k in common}}


def summarize_rows(rows: dict[str, dict[int, list[dict]]], concs: tuple[int, ...]) -> dict:
    out = {}
    for c in concs:
        s = {name: {k: v for k in KEYS if (v := _median(by_c.get(c, []), k)) is not None}
             for name, by_c in rows.items()}
        for name, by_c in rows.items():  # nested: leaf-wise medians (null: a trial lacked it)
            ph = [r["rank_phase_us_per_token"] for r in by_c.get(c, [])
                  if r.get("rank_phase_us_per_token")]
            if ph:
                s[name]["rank_phase_us_per_token"] = _median_tree(ph)
        tok = {name: s[name].get("tok_s") for name in s}
        ttft = {name: s[name].get("ttft_p50_ms") for name in s}
        for name in list(s):
            if name.startswith("lockstep"):
                s[f"tok_s_{name}_vs_mlx_lm"] = _ratio(tok[name], tok.get("mlx_lm"))
                s[f"ttft_p50_{name}_vs_mlx_lm"] = _ratio(ttft[name], ttft.get("mlx_lm"))
                for base in ("mlx_lm", "inproc"):
                    if base in s and base in rows:
                        s[f"tok_s_{name}_vs_{base}_per_trial"] = _per_trial(
                            rows[name].get(c, []), rows[base].get(c, []))
                if "inproc" in s:
                    s[f"tok_s_{name}_vs_inproc"] = _ratio(tok[name], tok.get("inproc"))
        if "lockstep_tp2" in s and "lockstep_tp1" in s:
            s["tok_s_tp2_vs_tp1"] = _ratio(tok["lockstep_tp2"], tok["lockstep_tp1"])
        s["breakdown"] = {name: breakdown_summary(by_c.get(c, [])) for name, by_c in rows.items()
                          if by_c.get(c)}
        out[f"concurrency_{c}"] = s
    return out


def _target(desc: str, value: float | None, ok, trials: list | None = None) -> dict:
    out = {"target": desc, "value": value, "met": None if value is None else bool(ok(value))}
    if trials:  # the same ratio trial by trial (value is the ratio of the medians)
        out["per_trial"] = trials
    return out


def targets(presets: dict) -> dict:
    """Issue 16 item 4, computed from this run's summary (None: not measured here)."""
    def get(preset: str, c: int, key: str) -> float | None:
        return (presets.get(preset, {}).get("summary", {}).get("cache_off", {})
                .get(f"concurrency_{c}", {}).get(key))

    return {
        "bench_c8_tok_s_vs_mlx_lm": _target(">= 1.1 (bench preset, conc 8, caches off, TP=1)",
                                            get("bench", 8, "tok_s_lockstep_tp1_vs_mlx_lm"),
                                            lambda v: v >= 1.1,
                                            get("bench", 8, "tok_s_lockstep_tp1_vs_mlx_lm_per_trial")),
        "bench_c8_ttft_p50_vs_mlx_lm": _target("<= 1.0", get("bench", 8,
                                               "ttft_p50_lockstep_tp1_vs_mlx_lm"),
                                               lambda v: v <= 1.0),
        "tiny_c1_vs_inproc": _target(">= 0.9", get("tiny", 1, "tok_s_lockstep_tp1_vs_inproc"),
                                     lambda v: v >= 0.9,
                                     get("tiny", 1, "tok_s_lockstep_tp1_vs_inproc_per_trial")),
        "tiny_c8_vs_inproc": _target(">= 0.9", get("tiny", 8, "tok_s_lockstep_tp1_vs_inproc"),
                                     lambda v: v >= 0.9,
                                     get("tiny", 8, "tok_s_lockstep_tp1_vs_inproc_per_trial")),
        "bench_c8_tp2_vs_tp1": _target(">= 1.3", get("bench", 8, "tok_s_tp2_vs_tp1"),
                                       lambda v: v >= 1.3),
    }
