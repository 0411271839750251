"""Bus benchmark at step rate: what signing costs at the rate the serving path sends.

Rank 0 sends, per step, one PLAN to each follower (plan channel: rank 0's ROUTER →
a follower's DEALER) and one TOKENS_BATCH to each requester (requests channel: rank 0's
ROUTER → the gateway's DEALER). Steps take ~2-5 ms on the tiny preset and ~90-200 ms on
the bench preset, so a channel carries at most a few hundred messages/s: far below the
saturation rates the rest of `bench.bus` measures.

Here the parent plays rank 0 and a child process (`python -m bench.bus_steprate recv`)
plays follower and gateway at once (two DEALERs, one poller, as the rank's I/O thread
reads). Each step the parent builds a steady-state decode Plan and a TokensBatch of 8
one-token chunks (8 streams decoding), then sends both, paced on an absolute schedule at
a fixed step rate, for a fixed duration; modes alternate per trial:
- `signed`: `Channel.pack` / `Channel.unpack_dealer` (common.bus, the services' path);
- `plain`: the same typed bodies, `msgpack.packb(body, default=wire_default)` and
  `msgpack.unpackb` + `decode_into` (bench.bus_children's plain codec), no envelope.

Per message: latency from the sender's clock read just before packing to the receiver's
clock read just after decode (and verify) returned (CLOCK_MONOTONIC, shared by all
processes on the host); CPU per step (process time: every thread, libzmq's I/O thread
too) on each side, and the thread CPU inside the pack / check+decode calls alone.
Judged: added CPU per step (signed − plain, sender + receiver, median over back-to-back
trial pairs) as a fraction of the step time. The in-process codec cost (best of 5, hot
caches) is reported beside it: at step rate the caches are cold and the same calls cost
about twice as much, which is why the paced measurement is the judged one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import msgpack
import zmq

from bench.bus_children import plain_pack, plain_unpack, spawn, stop
from common.bus import Channel, configure
from common.envelope import Key
from common.messages import PLAN_TO_FOLLOWER, REQUESTS_OUT, Kind, Plan, Tokens, TokensBatch
from common.schema import SchemaError

STEP_MODES = ("signed", "plain")
RATES = (250, 500)  # steps/s: step times of 4 and 2 ms (tiny preset)
STREAMS = 8  # chunks per TOKENS_BATCH: 8 streams decoding, one token each per step
STEP_MS_OF_INTEREST = (2.0, 5.0, 90.0, 200.0)  # tiny preset 2-5 ms, bench preset 90-200 ms
TARGET_PCT = 10.0
PLAN_ID, REQ_ID = b"follower-1", b"gateway-1"
BAD = (SchemaError, ValueError, TypeError, msgpack.UnpackException)


def plan_body(step: int) -> Plan:
    """A steady-state decode step's plan (no inserts or removes: the common case)."""
    return Plan(seq=step, step=step, advance=True)


def batch_body(step: int, now: float) -> TokensBatch:
    """One requester's chunks for a step: STREAMS streams, one token each, as rank 0
    fills them (services.rank.streams._tokens)."""
    return TokensBatch([Tokens(request_id=f"r-{i:016x}", tokens=[1000 + (step + i) % 30000],
                               index=step, prompt_tokens=300, step=step, token_times=[now])
                        for i in range(STREAMS)])


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def latencies_us(sent_ns: list[int], got_ns: list[int]) -> list[float]:
    """Per message index: receive − send in µs; messages never received (0) are left out."""
    return [(g - s) / 1000 for s, g in zip(sent_ns, got_ns, strict=True) if g]


# --- the receiver (child) ---------------------------------------------------------------


def serve_recv(key: Key, plan_ep: str, req_ep: str, ctl_ep: str) -> None:
    """Two DEALERs (follower's plan socket, gateway's requests socket) read on one
    poller. Per trial `start:<mode>:<n>` → `ready`, then it decodes until n of each
    arrived (or 2 s of silence) and answers {plan_ns, batch_ns (per message index: when
    decoded, 0 if never), cpu_s (process), codec_s (thread CPU in check + decode),
    rejected}."""
    ctx = zmq.Context()
    socks = {}
    for name, ep, ident in (("plan", plan_ep, PLAN_ID), ("req", req_ep, REQ_ID)):
        s = configure(ctx.socket(zmq.DEALER))
        s.setsockopt(zmq.IDENTITY, ident)
        s.connect(ep)
        s.send(b"hello")  # so the ROUTER knows the identity before the first trial
        socks[name] = s
    ctl = configure(ctx.socket(zmq.DEALER))
    ctl.connect(ctl_ep)
    pln = Channel("bench", "plan", sender="rank-1", send_key=key, accept=PLAN_TO_FOLLOWER)
    req = Channel("bench", "requests", sender="gateway", send_key=key, accept=REQUESTS_OUT)
    poller = zmq.Poller()
    plan_sock, req_sock = socks["plan"], socks["req"]
    poller.register(plan_sock, zmq.POLLIN)
    poller.register(req_sock, zmq.POLLIN)
    ctl.send(b"joined")
    clock, tclock = time.monotonic_ns, time.thread_time_ns
    while True:
        cmd = ctl.recv().decode().split(":")
        if cmd[0] == "quit":
            break
        mode, n = cmd[1], int(cmd[2])
        plan_ns, batch_ns = [0] * n, [0] * n
        got = rejected = codec_ns = 0
        signed = mode == "signed"
        ctl.send(b"ready")
        cpu0 = time.process_time()
        while got < 2 * n:
            ready = poller.poll(2000)
            if not ready:
                break  # lost messages: reported as missing
            for sock, _ in ready:
                frames = sock.recv_multipart()
                is_plan = sock is plan_sock
                c0 = tclock()
                if signed:
                    msg = (pln if is_plan else req).unpack_dealer(frames)
                    body = None if msg is None else msg.body
                elif len(frames) == 1:
                    try:
                        body = plain_unpack(frames[0], Kind.PLAN if is_plan else Kind.TOKENS_BATCH)
                    except BAD:
                        body = None
                else:
                    body = None
                t = clock()
                codec_ns += tclock() - c0
                if body is None:
                    rejected += 1
                    continue
                i = body.seq if is_plan else body.chunks[0].step
                if 0 <= i < n:
                    (plan_ns if is_plan else batch_ns)[i] = t
                    got += 1
        cpu = time.process_time() - cpu0
        ctl.send(json.dumps({"plan_ns": plan_ns, "batch_ns": batch_ns, "cpu_s": cpu,
                             "codec_s": codec_ns / 1e9, "rejected": rejected}).encode())
    for s in (*socks.values(), ctl):
        s.close(0)
    ctx.term()


# --- the sender (parent) ----------------------------------------------------------------


class StepRate:
    """Rank 0's two ROUTERs and a control ROUTER, bound; the receiver joined."""

    def __init__(self, key: Key) -> None:
        self.ctx = zmq.Context()
        self.plan, self.req, self.ctl = (configure(self.ctx.socket(zmq.ROUTER)) for _ in range(3))
        for s in (self.plan, self.req):
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        for s in (self.plan, self.req, self.ctl):
            s.bind("tcp://127.0.0.1:*")
            s.setsockopt(zmq.RCVTIMEO, 30_000)
        self.pln = Channel("bench", "plan", sender="rank-0", send_key=key, accept=())
        self.rq = Channel("bench", "requests", sender="rank-0", send_key=key, accept=())
        ep = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in (self.plan, self.req, self.ctl)]
        self.child = spawn(key, "recv", "--plan", ep[0], "--req", ep[1], "--ctl", ep[2],
                           module="bench.bus_steprate")
        self.ctl_id = b""
        try:
            for s in (self.plan, self.req):
                s.recv_multipart()  # the hello
            self.ctl_id, joined = self.ctl.recv_multipart()
        except zmq.Again:
            self.close()
            raise RuntimeError("step-rate receiver never joined") from None
        if joined != b"joined":
            self.close()
            raise RuntimeError(f"step-rate receiver said {joined!r}")

    def trial(self, mode: str, rate: float, seconds: float) -> dict[str, Any]:
        n = max(2, round(rate * seconds))
        self.ctl.send_multipart([self.ctl_id, f"start:{mode}:{n}".encode()])
        if self.ctl.recv_multipart()[1] != b"ready":
            raise RuntimeError("step-rate receiver not ready")
        pack_plan, pack_batch = (self.pln.pack, self.rq.pack) if mode == "signed" \
            else (plain_pack, plain_pack)
        sent_plan, sent_batch = [0] * n, [0] * n
        send_plan, send_req = self.plan.send_multipart, self.req.send_multipart
        clock, wall, sleep, tclock = time.monotonic_ns, time.time, time.sleep, time.thread_time_ns
        period = round(1e9 / rate)
        late = codec_ns = 0
        cpu0 = time.process_time()
        t0 = clock() + 1_000_000
        for i in range(n):
            wait = t0 + i * period - clock()
            if wait > 0:
                sleep(wait / 1e9)
            elif wait < -period:
                late += 1  # more than a step behind schedule (the machine is busy)
            plan = plan_body(i)
            sent_plan[i] = clock()
            c0 = tclock()
            data = pack_plan(plan)
            codec_ns += tclock() - c0
            send_plan([PLAN_ID, data], zmq.NOBLOCK)
            batch = batch_body(i, wall())
            sent_batch[i] = clock()
            c0 = tclock()
            data = pack_batch(batch)
            codec_ns += tclock() - c0
            send_req([REQ_ID, data], zmq.NOBLOCK)
        cpu = time.process_time() - cpu0
        span_s = (sent_plan[-1] - sent_plan[0]) / 1e9
        got = json.loads(self.ctl.recv_multipart()[1])
        lat = {ch: latencies_us(sent, got[f"{ch}_ns"])
               for ch, sent in (("plan", sent_plan), ("batch", sent_batch))}
        return {
            "mode": mode, "steps": n, "achieved_steps_per_s": round((n - 1) / span_s, 1),
            "late_steps": late, "rejected": got["rejected"],
            "missing": {ch: n - len(v) for ch, v in lat.items()},
            "sender_cpu_us_per_step": cpu / n * 1e6,
            "receiver_cpu_us_per_step": got["cpu_s"] / n * 1e6,
            # Only the pack (sender) and the check + decode (receiver) calls, thread CPU.
            "sender_codec_us_per_step": codec_ns / n / 1000,
            "receiver_codec_us_per_step": got["codec_s"] / n * 1e6,
            **{f"{ch}_latency_us": {"p50": round(percentile(v, 50), 1),
                                    "p99": round(percentile(v, 99), 1)}
               for ch, v in lat.items() if v},
        }

    def close(self) -> None:
        if self.ctl_id and self.child.poll() is None:
            self.ctl.send_multipart([self.ctl_id, b"quit"])
            stop(self.child)
        elif self.child.poll() is None:
            self.child.kill()
            self.child.wait(5)
        for s in (self.plan, self.req, self.ctl):
            s.close(0)
        self.ctx.term()


def _med(trials: list[dict[str, Any]], get) -> float:
    return statistics.median(get(t) for t in trials)


def _cpu(trial: dict[str, Any], side: str, what: str = "cpu") -> float:
    if side == "total":
        return trial[f"sender_{what}_us_per_step"] + trial[f"receiver_{what}_us_per_step"]
    return trial[f"{side}_{what}_us_per_step"]


def _paired(trials: dict[str, list[dict[str, Any]]], side: str, what: str = "cpu") -> float:
    """Median over pairs of signed − plain: trial i of each ran back to back, sharing load."""
    return round(statistics.median(_cpu(s, side, what) - _cpu(p, side, what) for s, p in
                                   zip(trials["signed"], trials["plain"], strict=True)), 2)


def summarize(rate: float, trials: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One rate's comparison: CPU per step and latency, signed vs plain (medians over
    trials), and the judged fraction of the step time."""
    step_us = 1e6 / rate
    cpu = {m: {side: round(_med(trials[m], lambda t, s=side: _cpu(t, s)), 2)
               for side in ("sender", "receiver", "total")} for m in STEP_MODES}
    added = {side: _paired(trials, side) for side in ("sender", "receiver", "total")}
    in_codec = {side: _paired(trials, side, "codec") for side in ("sender", "receiver", "total")}
    lat = {ch: {m: {q: round(_med(trials[m], lambda t, c=ch, q=q: t[f"{c}_latency_us"][q]), 1)
                    for q in ("p50", "p99")} for m in STEP_MODES} for ch in ("plan", "batch")}
    for v in lat.values():
        v["added_p50_us"] = round(v["signed"]["p50"] - v["plain"]["p50"], 1)
        v["signed_over_plain_p50"] = round(v["signed"]["p50"] / v["plain"]["p50"], 3)
        v["added_p50_pct_of_step"] = round(v["added_p50_us"] / step_us * 100, 3)
    overhead = added["total"] / step_us * 100
    return {
        "steps_per_s": rate, "step_ms": round(step_us / 1000, 3),
        "cpu_us_per_step": cpu, "added_cpu_us_per_step": added,
        "signing_overhead_pct_of_step": round(overhead, 3),
        "rank0_overhead_pct_of_step": round(added["sender"] / step_us * 100, 3),
        # Of the added CPU, what the pack and check+decode calls themselves took (thread
        # CPU around them): the rest is the larger frames' I/O, and noise.
        "added_codec_us_per_step": in_codec,
        "added_codec_pct_of_step": round(in_codec["total"] / step_us * 100, 3),
        "signed_over_plain_cpu_per_step": round(cpu["signed"]["total"] / cpu["plain"]["total"], 3),
        "latency_us": lat,
        "target_met": overhead < TARGET_PCT,
        "trials": {m: [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()
                        if k != "mode"} for t in trials[m]] for m in STEP_MODES},
    }


def codec_us(key: Key) -> dict[str, float]:
    """In-process CPU µs per message, best of 5: pack and unpack, signed and plain."""
    import timeit

    pln = Channel("bench", "plan-codec", sender="rank-0", send_key=key, accept=PLAN_TO_FOLLOWER)
    rq = Channel("bench", "req-codec", sender="rank-0", send_key=key, accept=REQUESTS_OUT)
    n, out = 2000, {}
    for name, chan, kind, body in (("plan", pln, Kind.PLAN, plan_body(7)),
                                   ("tokens_batch", rq, Kind.TOKENS_BATCH, batch_body(7, time.time()))):
        frames = iter([chan.pack(body) for _ in range(n * 5)])
        plain = plain_pack(body)
        for label, fn in (("signed_pack", lambda c=chan, b=body: c.pack(b)),
                          ("plain_pack", lambda b=body: plain_pack(b)),
                          ("signed_unpack", lambda c=chan, f=frames: c.unpack(next(f))),
                          ("plain_unpack", lambda p=plain, k=kind: plain_unpack(p, k))):
            best = min(timeit.repeat(fn, number=n, repeat=5, timer=time.process_time))
            out[f"{name}_{label}_us"] = round(best / n * 1e6, 2)
        out[f"{name}_envelope_us"] = round(
            out[f"{name}_signed_pack_us"] + out[f"{name}_signed_unpack_us"]
            - out[f"{name}_plain_pack_us"] - out[f"{name}_plain_unpack_us"], 2)
    return out


TARGET_TEXT = (
    f"the signed bus within {TARGET_PCT:g}% of the plain typed baseline at step rate: per "
    "step rate, signing_overhead_pct_of_step = (signed CPU per step - plain CPU per step) / "
    "step time * 100, where CPU per step is process time (all threads) of the sender (rank "
    "0: builds, packs and sends 1 PLAN + 1 TOKENS_BATCH of 8 chunks) plus the receiver "
    "(follower + gateway: receives, verifies and decodes both); the difference is the "
    "median over back-to-back (signed, plain) trial pairs at that rate; "
    f"target_met when it is under {TARGET_PCT:g} at every measured rate. Latency p50 "
    "signed vs plain is reported beside it (added µs, ratio, and added µs as % of the "
    "step time); the saturation sections (rpc, rpc_async, broadcast) are reported, not judged.")


def bench_steprate(key: Key, *, rates: tuple[float, ...] = RATES, trials: int = 4,
                   seconds: float = 5.0) -> dict[str, Any]:
    started = time.time()
    bench = StepRate(key)
    per_rate: dict[float, dict[str, list[dict[str, Any]]]] = {r: {m: [] for m in STEP_MODES}
                                                              for r in rates}
    try:
        for mode in STEP_MODES:  # warm up both paths
            bench.trial(mode, rates[0], min(0.3, seconds))
        for i in range(trials):  # rates interleaved, modes alternating: all share drift
            for rate in rates:
                for mode in STEP_MODES if i % 2 == 0 else STEP_MODES[::-1]:
                    per_rate[rate][mode].append(bench.trial(mode, rate, seconds))
    finally:
        bench.close()
    codec = codec_us(key)
    codec_added = codec["plan_envelope_us"] + codec["tokens_batch_envelope_us"]
    results = {f"{r:g}_per_s": summarize(r, per_rate[r]) for r in rates}
    for r in results.values():  # the same cost in-process: no I/O, no scheduler noise
        r["codec_added_us_per_step"] = round(codec_added, 2)
        r["codec_added_pct_of_step"] = round(codec_added / (r["step_ms"] * 1000) * 100, 3)
    worst = max(results.values(), key=lambda r: r["signing_overhead_pct_of_step"])
    added_us = statistics.median(r["added_cpu_us_per_step"]["total"] for r in results.values())
    now = time.time()
    sizes = {"plan": {"signed": len(bench.pln.pack(plan_body(7))),
                      "plain": len(plain_pack(plan_body(7)))},
             "tokens_batch": {"signed": len(bench.rq.pack(batch_body(7, now))),
                              "plain": len(plain_pack(batch_body(7, now)))}}
    return {
        "what": ("per step, rank 0 -> 1 PLAN (steady-state decode, no inserts) on the plan "
                 "channel (ROUTER -> DEALER) + 1 TOKENS_BATCH of 8 one-token chunks on the "
                 "requests channel (ROUTER -> DEALER), tcp loopback, receiver in its own "
                 "process (both DEALERs on one poller), paced on an absolute schedule"),
        "target": TARGET_TEXT,
        "trials": trials, "trial_s": seconds, "rates_steps_per_s": list(rates),
        "order": "trial i: every rate in turn, each signed then plain (i even) or plain "
                 "then signed (i odd), after a 0.3 s warm-up of each mode",
        "message_bytes": sizes,
        **results,
        "judged": {
            "signing_overhead_pct_of_step": worst["signing_overhead_pct_of_step"],
            "at_steps_per_s": worst["steps_per_s"],
            "target_pct": TARGET_PCT,
            "target_met": all(r["target_met"] for r in results.values()),
        },
        "derived_pct_of_step": {
            f"{ms:g}_ms": round(added_us / (ms * 1000) * 100, 3) for ms in STEP_MS_OF_INTEREST},
        "derived_note": ("median added CPU per step (signed - plain, both sides) over the "
                         "measured rates, as % of other step times (tiny preset 2-5 ms, "
                         "bench preset 90-200 ms); a per-message cost, so it scales as 1/step"),
        "codec_us": codec,
        "codec_note": ("in-process CPU µs per message, best of 5 x 2000 (bench.bus.codec_us "
                       "style); <name>_envelope_us = signed pack + unpack - plain pack + "
                       "unpack: what the envelope adds per message, with no I/O; "
                       "codec_added_us_per_step = plan + tokens_batch envelopes"),
        "duration_s": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bus_steprate",
                                 description="step-rate mode of bench.bus (prints, writes nothing)")
    ap.add_argument("role", nargs="?", choices=["recv"])
    ap.add_argument("--plan")
    ap.add_argument("--req")
    ap.add_argument("--ctl")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.role == "recv":
        serve_recv(Key.from_secret(bytes.fromhex(sys.stdin.readline().strip())),
                   args.plan, args.req, args.ctl)
        return 0
    import secrets

    out = bench_steprate(Key.from_secret(secrets.token_bytes(32)), trials=args.trials,
                         seconds=args.seconds)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
