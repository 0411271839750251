"""Bus benchmark: signed envelopes vs a typed unsigned bus vs raw pyzmq, same run.

Three modes:
- `raw`: pre-built bytes (a signed frame), neither serialized nor checked;
- `plain`: the same typed bodies serialized per message (`msgpack.packb(body,
  default=wire_default)`) and decoded on receipt (`msgpack.unpackb` + `decode_into`):
  everything a typed bus does, without the envelope;
- `signed`: `Channel.pack`/`unpack` (header, HMAC-SHA256, replay and timestamp windows,
  typed decode).

Patterns:
- request-reply: DEALER ↔ ROUTER over tcp loopback, one call in flight, the server in
  its own process; a GENERATE with a 64-token prompt → a TOKENS reply. Measured with
  blocking sockets (`rpc`) and with the client on zmq.asyncio sockets (`rpc_async`, as
  the gateway and supervisor run).
- broadcast: PUB → SUB over tcp loopback, the subscriber in its own process. The rate is
  what the subscriber received per second (a PUB drops at its high-water mark when the
  subscriber cannot keep up; drops are reported).

Trials rotate the modes in a balanced order (raw plain signed, signed plain raw, ...) so
all share any drift in machine load; medians are reported, with CPU µs per message on
each side (process time: less sensitive to other load than the rates) and the in-process
codec cost (signed, plain, and the envelope alone = signed − plain).

Target: signing and checking cost under 10% of throughput. `target_met` compares signed
with plain (`signing_overhead_pct`): serialization is needed by any bus. The overhead vs
raw bytes (`overhead_vs_raw_pct`) is reported alongside.
`python -m bench.bus [--trials N] [--seconds S] [--out DIR]`.

Layout: `bench.bus_children` (modes, payloads, the plain codec, the server and
subscriber processes), `bench.bus_rpc` and `bench.bus_broadcast` (the trials), this
module (the comparison, the in-process codec cost, the JSON, `run` and `main`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from bench import RESULTS, write_result
from bench.bus_broadcast import bench_broadcast
from bench.bus_children import (
    BROADCAST,
    MODES,
    REQUEST,
    Trials,
    order,
    plain_pack,
    plain_unpack,
    reply,
)
from bench.bus_rpc import bench_rpc
from common.bus import Channel
from common.envelope import Key
from common.messages import CONTROL, REQUESTS_IN, REQUESTS_OUT, Kind

NAME = "bus"
TARGET_OVERHEAD_PCT = 10.0


def _result(trials: Trials, unit: str, sides: tuple[str, str], cpu_key: str,
            pattern: str, info: dict[str, Any]) -> dict[str, Any]:
    """Rates compared, median CPU µs per message on each side, and what was sent."""
    cpu = {m: {side: round(statistics.median(t[f"{side}_cpu_us"] for t in trials[m]), 2)
               for side in sides} for m in MODES}
    rates = {m: [t["rate"] for t in trials[m]] for m in MODES}
    return _compare(rates, unit=unit) | {cpu_key: cpu, "pattern": pattern} | info


def _compare(rates: dict[str, list[float]], *, unit: str) -> dict[str, Any]:
    raw, plain, signed = (statistics.median(rates[m]) for m in MODES)

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    def added_us(slow: float, fast: float) -> float | None:
        return round((1 / slow - 1 / fast) * 1e6, 2) if slow and fast else None

    signing_pct = (1 - ratio(signed, plain)) * 100
    return {
        "unit": unit,
        **{m: [round(r) for r in rates[m]] for m in MODES},
        **{f"{m}_median": round(v) for m, v in zip(MODES, (raw, plain, signed), strict=True)},
        "signed_over_plain": round(ratio(signed, plain), 4),
        "signed_over_raw": round(ratio(signed, raw), 4),
        "plain_over_raw": round(ratio(plain, raw), 4),
        "signing_overhead_pct": round(signing_pct, 2),
        "overhead_vs_raw_pct": round((1 - ratio(signed, raw)) * 100, 2),
        "added_us_per_message_vs_plain": added_us(signed, plain),
        "added_us_per_message_vs_raw": added_us(signed, raw),
        "target_met": signing_pct < TARGET_OVERHEAD_PCT,
    }


def codec_costs(key: Key) -> dict[str, float]:
    """In-process CPU µs/message: sign + encode and check + decode (signed), encode and
    decode (plain), and the envelope alone (signed − plain). Process time, so other load
    on the machine barely moves it."""
    chan = Channel("bench", "codec", sender="gateway", send_key=key,
                   accept=REQUESTS_IN | REQUESTS_OUT | CONTROL)
    n = 2000

    def best(fn: Callable[[], Any]) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5, timer=time.process_time)) / n * 1e6

    out = {}
    for kind, body in ((Kind.GENERATE, REQUEST), (Kind.TOKENS, reply(REQUEST.request_id)),
                       (Kind.CANCEL, BROADCAST)):
        frames = iter([chan.pack(body) for _ in range(n * 5)])
        plain = plain_pack(body)
        cost = {
            "pack": (best(lambda b=body: chan.pack(b)), best(lambda b=body: plain_pack(b))),
            "unpack": (best(lambda f=frames: chan.unpack(next(f))),
                       best(lambda p=plain, k=kind: plain_unpack(p, k))),
        }
        for op, (signed_us, plain_us) in cost.items():
            out[f"{op}_{kind.value}_us"] = round(signed_us, 2)
            out[f"plain_{op}_{kind.value}_us"] = round(plain_us, 2)
            out[f"envelope_{op}_{kind.value}_us"] = round(signed_us - plain_us, 2)
    return out


def _summary(rpc: dict[str, Any], rpc_async: dict[str, Any], broadcast: dict[str, Any]) -> str:
    parts = []
    for name, r in (("rpc", rpc), ("rpc asyncio", rpc_async), ("broadcast", broadcast)):
        parts.append(
            f"{name} {r['signed_median']}/s signed vs {r['plain_median']}/s plain vs "
            f"{r['raw_median']}/s raw (signing -{r['signing_overhead_pct']}%: "
            f"{'met' if r['target_met'] else 'NOT met'}; vs raw -{r['overhead_vs_raw_pct']}%)")
    return "; ".join(parts) + f" [target: signing < {TARGET_OVERHEAD_PCT:g}% vs plain]"


def run(out_dir: Path | str | None = None, *, trials: int = 5, seconds: float = 2.0) -> dict[str, Any]:
    key = Key.from_secret(secrets.token_bytes(32))
    load_before = os.getloadavg()
    started = time.time()
    sync, async_, sizes = bench_rpc(key, trials, seconds)
    rpc, rpc_async = (
        _result(t, "round_trips_per_s", ("client", "server"), "cpu_us_per_round_trip",
                f"DEALER{client} <-> ROUTER, tcp loopback, 1 in flight, server in its own process",
                sizes)
        for t, client in ((sync, " (blocking pyzmq)"), (async_, " (zmq.asyncio)")))
    detail, info = bench_broadcast(key, trials, seconds)
    broadcast = _result(detail, "messages_per_s", ("publisher", "subscriber"), "cpu_us_per_message",
                        "PUB -> SUB, tcp loopback, subscriber in its own process", info)
    codec = codec_costs(key)
    result = {
        "bench": NAME,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
                 "python": platform.python_version(), "pyzmq": zmq.__version__,
                 "libzmq": zmq.zmq_version(), "loadavg_before": [round(x, 2) for x in load_before],
                 "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "trials": trials,
        "trial_s": seconds,
        "order": " ".join(order(trials)),
        "target": (f"signing and checking cost under {TARGET_OVERHEAD_PCT:g}% of throughput: "
                   "target_met compares signed with plain (typed msgpack bodies serialized "
                   "and decoded per message, no envelope), signing_overhead_pct = "
                   "(1 - signed/plain) * 100. overhead_vs_raw_pct compares signed with raw "
                   "(pre-built bytes, no serialization, no checks) and is reported, not judged."),
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "rpc": rpc,
        "rpc_async": rpc_async,
        "broadcast": broadcast,
        "codec_us": codec,
    }
    result["summary"] = _summary(rpc, rpc_async, broadcast)
    write_result(out_dir if out_dir is not None else RESULTS, NAME, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # older spelling of `python -m bench.bus_children`
        from bench.bus_children import main as child_main

        return child_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.bus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="trials per mode (default 5)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per trial (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = ap.parse_args(argv)
    result = run(args.out, trials=args.trials, seconds=args.seconds)
    print(json.dumps({k: result[k] for k in ("rpc", "rpc_async", "broadcast", "codec_us")},
                     indent=2))
    print(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
