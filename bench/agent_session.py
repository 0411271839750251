"""Agent-session benchmark (issue 29 item 5): what a coding agent's turns cost, Lockstep
vs `mlx_lm.server` on the same model directory, in the same run, with the same BLAS and
batch settings (bench/servers.py).

A session: a ~`system_tokens`-token system prompt and `tools` function tools (both sent
every turn, as agents do), then `turns` turns; each appends a reply and a new user
message carrying a tool result of ~`tool_result_tokens` tokens, and resends the whole
conversation. The reply (`replies`): "fixed" (the default) a canned `max_tokens`-token
text, the same for every server, so both see exactly the same prompts and compute the
same tokens; "own" the server's own greedy reply (on a random-weight preset the two
servers' replies differ, and each re-tokenized reply matches its cache to a different
depth, so they do unlike work). TTFT of every turn, client side (send → first visible
content; bench/chat_client.py).

Fairness: both servers are up at once and take turns request by request (the order
flips every turn and every session), so machine noise lands on both alike; each
session's text is its own (no hit on an earlier session's cache entries). The CPU each
server's processes burn while the other is measured is recorded (`idle_cpu_s`). Phases:
prompt cache on for both (Lockstep's defaults, mlx_lm.server's default size), off for
both (`--prompt-cache-entries 0` / `--prompt-cache-size 0`). Lockstep is also measured
through `/v1/messages` (the same conversation as Anthropic blocks) against a second
mlx_lm.server chat session, cache on. Ratios are of per-turn medians over sessions.

The preset's 4096-token context is too short for the session, so both servers load a
copy of the model directory whose config.json says `context` (weights symlinked; RoPE
has no table, nothing else changes).

Where Lockstep's time goes, per turn: `ttft_model_ms` (rank 0: request received → first
token: prefix-cache lookup and prefill of the new suffix) and the rest of the client's
TTFT (gateway: parse, chat template, tokenization, admission, the bus both ways, SSE),
plus each process's CPU seconds during the request (bench/cpu_breakdown.py roles) and
rank 0's wall seconds per loop phase over the whole turn (`rank_phases_s`, read from
/metrics before and after the turn: `step` is the model, `plan`/`drain`/`emit`/`sign_send_*`
Lockstep's own loop; services/rank/phase_clock.py).

    python -m bench.agent_session [--quick] [--preset P] [--sessions N] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import RESULTS, write_result
from bench import servers as sv
from bench.agent_turns import Session, cpu_by_role, messages_turn, tools_for
from bench.chat_client import CLIENT, chat
from bench.cpu_breakdown import snapshot
from bench.gateway import MODEL_CACHE
from bench.rank_metrics import rank_phases
from bench.workload import load_tokenizer


@dataclass
class Config:
    preset: str = "bench"
    context: int = 16384
    system_tokens: int = 3000
    tools: int = 20
    turns: int = 8
    tool_result_tokens: int = 300
    max_tokens: int = 24
    sessions_on: int = 3  # per server, prompt cache on
    sessions_off: int = 1  # per server, prompt cache off
    messages_sessions: int = 1  # Lockstep /v1/messages vs mlx_lm chat, cache on
    seed: str = "as-1"
    # "fixed": every server's session appends the same canned reply each turn, so both
    # compute the same tokens (like with like); "own": each appends its own reply
    replies: str = "fixed"


QUICK = Config(preset="tiny", system_tokens=600, turns=4, tool_result_tokens=150,
               sessions_on=1, sessions_off=1, messages_sessions=1)


def long_context_copy(model: Path, context: int) -> Path:
    """`model` with max_position_embeddings = `context`: the same files, weights linked."""
    dest = model.parent / f"{model.name}-ctx{context}"
    cfg = json.loads((model / "config.json").read_text())
    if (dest / "config.json").exists() and json.loads(
            (dest / "config.json").read_text()).get("max_position_embeddings") == context:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.name == "config.json":
            continue
        (dest / f.name).symlink_to(f.resolve())
    cfg["max_position_embeddings"] = context
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


async def one_turn(srv: sv.Server, s: Session, form: str, others: list[sv.Server]) -> dict:
    """Send session `s`'s conversation to `srv`; append its reply; the turn's record."""
    roles = {srv.name: srv.processes(), **{o.name: o.processes() for o in others}}
    lock = srv.name.startswith("lockstep")
    phases0 = await asyncio.to_thread(rank_phases, srv) if lock else None
    before = {n: snapshot(lambda r=r: r) for n, r in roles.items()}
    if form == "chat":
        r = await chat(srv.url, srv.model, s.chat_messages(), s.cfg_max_tokens, tools=s.tools)
    else:
        r = await messages_turn(srv.url, srv.model, s)
    after = {n: snapshot(lambda r=r: r) for n, r in roles.items()}
    s.reply(r.text)
    rec = r.record()
    if rec["ttft_ms"] is None:  # no visible content (EOS first): prefill ends with it
        rec["ttft_ms"], rec["no_content"] = rec["total_ms"], True
    rec["cpu_s"] = cpu_by_role(before[srv.name], after[srv.name])
    rec["idle_cpu_s"] = {o.name: round(sum(cpu_by_role(before[o.name], after[o.name]).values()), 3)
                         for o in others}
    if r.lockstep and r.lockstep.get("ttft_model_ms") is not None:
        rec["gateway_and_bus_ms"] = round(rec["ttft_ms"] - r.lockstep["ttft_model_ms"], 2)
    if lock:
        phases1 = await asyncio.to_thread(rank_phases, srv)
        if phases0 and phases1:
            rec["rank_phases_s"] = {p: round(v - phases0.get("0", {}).get(p, 0.0), 4)
                                    for p, v in sorted(phases1.get("0", {}).items())}
    return rec


async def interleaved(pair: list[tuple[sv.Server, str]], tok, cfg: Config, key: str,
                      flip: bool) -> dict[str, list[dict]]:
    """One session per (server, form), the same text, turn by turn, order flipped each turn."""
    sessions = [Session(tok, cfg, key, tools_for(tok, cfg, key)) for _ in pair]
    out: dict[str, list[dict]] = {f"{srv.name}/{form}": [] for srv, form in pair}
    for t in range(cfg.turns):
        order = list(range(len(pair)))
        if (t % 2 == 1) != flip:
            order.reverse()
        for i in order:
            srv, form = pair[i]
            others = [p[0] for j, p in enumerate(pair) if p[0] is not srv]
            out[f"{srv.name}/{form}"].append(await one_turn(srv, sessions[i], form, others))
    return out


def warm(srv: sv.Server, tok, cfg: Config) -> None:
    s = Session(tok, Config(**{**asdict(cfg), "system_tokens": 100, "turns": 1}), "warm", [])
    asyncio.run(chat(srv.url, srv.model, s.chat_messages(), 4))


def medians(runs: list[list[dict]], field: str) -> list[float | None]:
    out = []
    for t in range(len(runs[0])):
        vals = [r[t][field] for r in runs if r[t].get(field) is not None]
        out.append(round(statistics.median(vals), 2) if vals else None)
    return out


def phase(name: str, pair_forms: list[str], servers: list[sv.Server], tok, cfg: Config,
          sessions: int) -> dict:
    """`sessions` interleaved sessions of the servers (each with its form)."""
    for srv in servers:
        warm(srv, tok, cfg)
    pair = list(zip(servers, pair_forms, strict=True))
    runs: dict[str, list[list[dict]]] = {f"{s.name}/{f}": [] for s, f in pair}
    for k in range(sessions):
        got = asyncio.run(interleaved(pair, tok, cfg, f"{cfg.seed}/{name}/s{k}", k % 2 == 1))
        for n, turns in got.items():
            runs[n].append(turns)
            print(f"  {name} {n:36s} session {k}: ttft ms {[t['ttft_ms'] for t in turns]}",
                  flush=True)
    for r in runs.values():  # CPU of every process of the server, per turn
        for t in (t for s in r for t in s):
            t["cpu_total_s"] = round(sum(t["cpu_s"].values()), 3)
    per = {n: {"ttft_median_ms": medians(r, "ttft_ms"),
               "cpu_median_s": medians(r, "cpu_total_s"),
               "ttft_model_median_ms": medians([[t.get("lockstep") or {} for t in s] for s in r],
                                               "ttft_model_ms"),
               "gateway_and_bus_median_ms": medians(r, "gateway_and_bus_ms"),
               "prompt_tokens_run0": [t["prompt_tokens"] for t in r[0]],
               "cached_tokens_run0": [t["cached_tokens"] for t in r[0]],
               "runs": r} for n, r in runs.items()}
    lock, ref = (f"{s.name}/{f}" for s, f in pair)
    ratios = [round(a / b, 3) for a, b in zip(per[lock]["ttft_median_ms"],
                                              per[ref]["ttft_median_ms"], strict=True)]
    cpu = [round(a / b, 3) for a, b in zip(per[lock]["cpu_median_s"], per[ref]["cpu_median_s"],
                                           strict=True)]
    return {"sessions": sessions, "servers": per, "lockstep_vs_mlx_lm_per_turn": ratios,
            "lockstep_vs_mlx_lm_cpu_per_turn": cpu,
            "turns_2_on_worst": max(ratios[1:]) if len(ratios) > 1 else None,
            "loadavg": os.getloadavg()}


def run(out_dir: Path | str | None = None, cfg: Config | None = None) -> dict:
    from models.tinymodel import build_model

    cfg = cfg or Config()
    base = build_model(MODEL_CACHE / cfg.preset, preset=cfg.preset)
    model = long_context_copy(base, cfg.context)
    tok = load_tokenizer(model)
    out = out_dir if out_dir is not None else RESULTS
    result: dict = {"benchmark": "agent_session", "host": platform.node(),
                    "python": platform.python_version(), "started": time.time(),
                    "config": asdict(cfg), "model": str(model), "model_from": str(base),
                    "client": CLIENT, "environment": sv.environment_record(),
                    "servers": [], "phases": {}}
    plan = [("cache_on_chat", True, ["chat", "chat"], cfg.sessions_on),
            ("cache_off_chat", False, ["chat", "chat"], cfg.sessions_off),
            ("cache_on_messages", True, ["messages", "chat"], cfg.messages_sessions)]
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-agent-") as tmp:
        work = Path(tmp)
        for name, cache, forms, sessions in plan:
            if sessions <= 0:
                continue
            servers = []
            try:
                servers.append(sv.lockstep(model, work, 1, cache))
                servers.append(sv.mlx_lm(model, work, cache))
                result["phases"][name] = phase(name, forms, servers, tok, cfg, sessions)
            finally:
                for srv in servers:
                    sv.stop(srv)
                    result["servers"].append({**srv.record(), "phase": name})
            write_result(out, "agent_session", {**result, "complete": False})
    on = result["phases"].get("cache_on_chat")
    if on is not None:
        vs = on["lockstep_vs_mlx_lm_per_turn"][1:]
        result["target"] = {"what": "Lockstep TTFT <= mlx_lm.server's on every turn from the "
                                    "2nd, cache on for both (ratio of per-turn medians)",
                            "value": vs, "worst": max(vs) if vs else None,
                            "met": all(v <= 1.0 for v in vs)}
    result["summary"] = {n: {"lockstep_vs_mlx_lm_per_turn": p["lockstep_vs_mlx_lm_per_turn"],
                             "lockstep_vs_mlx_lm_cpu_per_turn": p["lockstep_vs_mlx_lm_cpu_per_turn"],
                             **{s: p["servers"][s]["ttft_median_ms"] for s in p["servers"]}}
                         for n, p in result["phases"].items()}
    result["complete"] = True
    result["seconds"] = round(time.time() - result["started"], 1)
    result["loadavg_end"] = os.getloadavg()
    write_result(out, "agent_session", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_session", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke on the tiny preset")
    ap.add_argument("--sessions", type=int, help="sessions per server with the cache on")
    ap.add_argument("--preset", help="model preset (default: bench; --quick: tiny)")
    ap.add_argument("--replies", choices=("fixed", "own"),
                    help="each turn's reply: the same canned text for both (default), or "
                         "each server's own")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else Config()
    if a.replies:
        cfg.replies = a.replies
    if a.sessions:
        cfg.sessions_on = a.sessions
    if a.preset:
        cfg.preset = a.preset
    out = a.out
    if a.quick and out is None:  # a smoke never overwrites the committed result
        out = Path(tempfile.gettempdir()) / "lockstep-bench-quick"
    res = run(out, cfg)
    print(json.dumps(res["summary"], indent=1))
    print(json.dumps(res.get("target"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
