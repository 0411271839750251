"""Bus benchmark: signed envelopes vs raw pyzmq, same run, same payload bytes.

- request-reply: DEALER ↔ ROUTER over tcp loopback, one call in flight, the server in
  its own process. Signed: `Channel.pack`/`unpack` on both sides (a GENERATE with a
  64-token prompt → a TOKENS reply). Raw: the very same bytes, pre-built, neither
  signed nor checked. Measured with blocking sockets (`rpc`) and again with the client
  on zmq.asyncio sockets (`rpc_async`, as the gateway and supervisor run).
- broadcast: PUB → SUB over tcp loopback, the subscriber in its own process. Signed:
  the publisher signs every message and the subscriber verifies and decodes it. Raw:
  the same bytes unchecked. The rate is what the subscriber received per second (a PUB
  drops at its high-water mark when the subscriber cannot keep up; drops are reported).

Trials alternate raw and signed (ABBA order) so both share any drift in machine load;
medians are reported, with CPU µs per message on each side (process time: less
sensitive to other load than the rates) and the in-process codec cost.
Target: signing and checking cost under 10% of raw throughput (`target_met`).
`python -m bench.bus [--trials N] [--seconds S] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from bench import RESULTS, write_result
from common.bus import Channel, configure
from common.envelope import Key
from common.messages import CONTROL, REQUESTS_IN, REQUESTS_OUT, Cancel, Generate, Tokens

NAME = "bus"
REPO = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD_PCT = 10.0
TOPIC = b"ctl:bench-deployment"
PROMPT = list(range(1000, 1064))
REQUEST = Generate(request_id="r-0123456789abcdef", prompt=PROMPT, max_tokens=16, temperature=0.7,
                   seed=1234)
REPLY_TOKENS = [4711, 4712, 4713, 4714]
BROADCAST = Cancel(deployment_id="bench-deployment", epoch=7, scope="requests",
                   request_ids=["r-0123456789abcdef", "r-fedcba9876543210"], reason="bench")


def _reply(request_id: str) -> Tokens:
    return Tokens(request_id=request_id, tokens=REPLY_TOKENS, index=12, step=40)


# --- child processes -------------------------------------------------------------------


def _serve_rpc(key: Key) -> None:
    """ROUTER server. A 3-frame [id, b"MODE", raw|signed|stat] message switches mode
    and answers the calls served and CPU seconds used since the previous one."""
    ctx = zmq.Context()
    sock = configure(ctx.socket(zmq.ROUTER))
    sock.bind("tcp://127.0.0.1:*")
    chan = Channel("bench", "requests", sender="rank-0", send_key=key, accept=REQUESTS_IN)
    raw_reply = chan.pack(_reply(REQUEST.request_id))
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    signed = False
    served, cpu0 = 0, time.process_time()
    while True:
        frames = sock.recv_multipart()
        if len(frames) == 3 and frames[1] == b"MODE":
            if frames[2] == b"quit":
                break
            if frames[2] != b"stat":
                signed = frames[2] == b"signed"
            cpu = time.process_time()
            sock.send_multipart([frames[0], json.dumps({"n": served, "cpu_s": cpu - cpu0}).encode()])
            served, cpu0 = 0, cpu
            continue
        served += 1
        if signed:
            got = chan.unpack_router(frames)
            if got is not None:
                ident, msg = got
                sock.send_multipart([ident, chan.pack(_reply(msg.body.request_id))])
        else:
            sock.send_multipart([frames[0], raw_reply])
    sock.close(0)
    ctx.term()


def _serve_sub(key: Key, pub_endpoint: str, ctl_endpoint: str) -> None:
    """Subscriber: joins (answers a HELLO on its DEALER), then per trial counts what
    arrives until that trial's END and reports {received, rejected, first, last}."""
    ctx = zmq.Context()
    sub = configure(ctx.socket(zmq.SUB))
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(pub_endpoint)
    ctl = configure(ctx.socket(zmq.DEALER))
    ctl.connect(ctl_endpoint)
    chan = Channel("bench", "control", sender="rank-1", send_key=key, accept=CONTROL)
    while sub.recv_multipart()[1] != b"HELLO":
        pass
    ctl.send(b"joined")
    clock = time.perf_counter
    while True:
        cmd = ctl.recv().decode().split(":")
        if cmd[0] == "quit":
            break
        trial, mode = cmd[1], cmd[2]
        end_marker = f"END:{trial}".encode()
        ctl.send(b"ready")
        received = rejected = 0
        first = last = 0.0
        cpu0 = time.process_time()
        if mode == "signed":
            while True:
                frames = sub.recv_multipart()
                payload = frames[1]
                if payload[:4] == b"END:" or payload == b"HELLO":
                    if payload == end_marker:
                        break
                    continue
                if chan.unpack_sub(frames, TOPIC) is None:
                    rejected += 1
                    continue
                last = clock()
                if not received:
                    first = last
                received += 1
        else:
            while True:
                frames = sub.recv_multipart()
                payload = frames[1]
                if payload[:4] == b"END:" or payload == b"HELLO":
                    if payload == end_marker:
                        break
                    continue
                if len(frames) != 2 or frames[0] != TOPIC:
                    rejected += 1
                    continue
                last = clock()
                if not received:
                    first = last
                received += 1
        ctl.send(json.dumps({"received": received, "rejected": rejected, "first": first,
                             "last": last, "cpu_s": time.process_time() - cpu0}).encode())
    sub.close(0)
    ctl.close(0)
    ctx.term()


def _child(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.bus --child")
    ap.add_argument("role", choices=["rpc", "sub"])
    ap.add_argument("--pub")
    ap.add_argument("--ctl")
    args = ap.parse_args(argv)
    key = Key.from_secret(bytes.fromhex(sys.stdin.readline().strip()))
    if args.role == "rpc":
        _serve_rpc(key)
    else:
        _serve_sub(key, args.pub, args.ctl)
    return 0


def _spawn(key: Key, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "bench.bus", "--child", *args], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(key.secret.hex() + "\n")
    proc.stdin.flush()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --- measurements ----------------------------------------------------------------------


def _order(trials: int) -> list[str]:
    """ABBA: raw, signed, signed, raw, raw, signed, ..."""
    pairs = [("raw", "signed") if i % 2 == 0 else ("signed", "raw") for i in range(trials)]
    return [mode for pair in pairs for mode in pair]


def _rpc_control(sock: zmq.Socket, what: str) -> dict[str, Any]:
    sock.send_multipart([b"MODE", what.encode()])
    return json.loads(sock.recv())


def _rpc_trial(sock: zmq.Socket, chan: Channel, mode: str, seconds: float,
               raw_request: bytes) -> dict[str, float]:
    """One trial: round trips/s, and CPU µs per round trip on each side."""
    _rpc_control(sock, mode)
    clock = time.perf_counter
    n = 0
    cpu0 = time.process_time()
    if mode == "signed":
        rid = REQUEST.request_id
        t0 = clock()
        end = t0 + seconds
        while clock() < end:
            sock.send(chan.pack(REQUEST))
            msg = chan.unpack_dealer(sock.recv_multipart())
            if msg is None or msg.body.request_id != rid:
                raise RuntimeError("bad signed reply")
            n += 1
    else:
        t0 = clock()
        end = t0 + seconds
        while clock() < end:
            sock.send(raw_request)
            if len(sock.recv_multipart()) != 1:
                raise RuntimeError("bad raw reply")
            n += 1
    rate = n / (clock() - t0)
    client_cpu = time.process_time() - cpu0
    server = _rpc_control(sock, "stat")
    return {"rate": rate, "client_cpu_us": client_cpu / n * 1e6,
            "server_cpu_us": server["cpu_s"] / max(server["n"], 1) * 1e6}


async def _rpc_async_trial(sock: zmq.asyncio.Socket, chan: Channel, mode: str, seconds: float,
                           raw_request: bytes) -> dict[str, float]:
    """The same trial on asyncio sockets, as the gateway and supervisor run them."""
    await sock.send_multipart([b"MODE", mode.encode()])
    await sock.recv()
    clock = time.perf_counter
    n = 0
    cpu0 = time.process_time()
    t0 = clock()
    end = t0 + seconds
    if mode == "signed":
        rid = REQUEST.request_id
        while clock() < end:
            await sock.send(chan.pack(REQUEST))
            msg = chan.unpack_dealer(await sock.recv_multipart())
            if msg is None or msg.body.request_id != rid:
                raise RuntimeError("bad signed reply")
            n += 1
    else:
        while clock() < end:
            await sock.send(raw_request)
            if len(await sock.recv_multipart()) != 1:
                raise RuntimeError("bad raw reply")
            n += 1
    rate = n / (clock() - t0)
    client_cpu = time.process_time() - cpu0
    await sock.send_multipart([b"MODE", b"stat"])
    server = json.loads(await sock.recv())
    return {"rate": rate, "client_cpu_us": client_cpu / n * 1e6,
            "server_cpu_us": server["cpu_s"] / max(server["n"], 1) * 1e6}


async def _rpc_async_trials(endpoint: str, chan: Channel, trials: int, seconds: float,
                            raw_request: bytes) -> dict[str, list[dict[str, float]]]:
    ctx = zmq.asyncio.Context()
    sock = configure(ctx.socket(zmq.DEALER))
    sock.connect(endpoint)
    try:
        await _rpc_async_trial(sock, chan, "signed", min(0.3, seconds), raw_request)
        await _rpc_async_trial(sock, chan, "raw", min(0.3, seconds), raw_request)
        out: dict[str, list[dict[str, float]]] = {"raw": [], "signed": []}
        for mode in _order(trials):
            out[mode].append(await asyncio.wait_for(
                _rpc_async_trial(sock, chan, mode, seconds, raw_request), seconds + 30))
        return out
    finally:
        sock.close(0)
        ctx.term()


def _rpc_result(trials: dict[str, list[dict[str, float]]], pattern: str) -> dict[str, Any]:
    rates = {mode: [t["rate"] for t in trials[mode]] for mode in trials}
    return _compare(rates, unit="round_trips_per_s") | {
        "cpu_us_per_round_trip": {
            mode: {side: round(statistics.median(t[f"{side}_cpu_us"] for t in trials[mode]), 2)
                   for side in ("client", "server")} for mode in trials},
        "pattern": pattern,
    }


def bench_rpc(key: Key, trials: int, seconds: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(blocking sockets, asyncio sockets): the same server process for both."""
    server = _spawn(key, "rpc")
    ctx = zmq.Context()
    sock = configure(ctx.socket(zmq.DEALER))
    try:
        endpoint = server.stdout.readline().strip()
        if not endpoint.startswith("tcp://"):
            raise RuntimeError(f"rpc server did not start (said {endpoint!r})")
        sock.connect(endpoint)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        chan = Channel("bench", "requests", sender="gateway", send_key=key, accept=REQUESTS_OUT)
        raw_request = chan.pack(REQUEST)
        raw_reply_len = len(chan.pack(_reply(REQUEST.request_id)))
        _rpc_trial(sock, chan, "signed", min(0.3, seconds), raw_request)  # warm up both paths
        _rpc_trial(sock, chan, "raw", min(0.3, seconds), raw_request)
        sync: dict[str, list[dict[str, float]]] = {"raw": [], "signed": []}
        for mode in _order(trials):
            sync[mode].append(_rpc_trial(sock, chan, mode, seconds, raw_request))
        achan = Channel("bench", "requests", sender="gateway-async", send_key=key,
                        accept=REQUESTS_OUT)
        async_ = asyncio.run(_rpc_async_trials(endpoint, achan, trials, seconds,
                                               achan.pack(REQUEST)))
        sock.send_multipart([b"MODE", b"quit"])
    finally:
        sock.close(0)
        ctx.term()
        _stop(server)
    sizes = {"request": f"generate, {len(PROMPT)}-token prompt", "request_bytes": len(raw_request),
             "reply": f"tokens, {len(REPLY_TOKENS)} tokens", "reply_bytes": raw_reply_len}
    return (
        _rpc_result(sync, "DEALER <-> ROUTER, tcp loopback, blocking pyzmq, 1 in flight, "
                          "server in its own process") | sizes,
        _rpc_result(async_, "DEALER (zmq.asyncio) <-> ROUTER, tcp loopback, 1 in flight, "
                            "server in its own process") | sizes,
    )


def _broadcast_trial(pub: zmq.Socket, ctl: zmq.Socket, ident: bytes, chan: Channel, mode: str,
                     trial: int, seconds: float, raw: bytes) -> dict[str, Any]:
    ctl.send_multipart([ident, f"start:{trial}:{mode}".encode()])
    _, answer = ctl.recv_multipart()
    if answer != b"ready":
        raise RuntimeError(f"subscriber answered {answer!r}")
    clock = time.perf_counter
    sent = 0
    cpu0 = time.process_time()
    end = clock() + seconds
    send = pub.send_multipart
    if mode == "signed":
        pack = chan.pack
        while clock() < end:
            for _ in range(50):
                send([TOPIC, pack(BROADCAST)])
            sent += 50
    else:
        while clock() < end:
            for _ in range(50):
                send([TOPIC, raw])
            sent += 50
    pub_cpu = time.process_time() - cpu0
    marker = f"END:{trial}".encode()
    deadline = time.monotonic() + 30
    while not ctl.poll(20):
        if time.monotonic() > deadline:
            raise RuntimeError("subscriber never reported")
        send([TOPIC, marker])
    _, report = ctl.recv_multipart()
    got = json.loads(report)
    span = got["last"] - got["first"]
    got["rate"] = (got["received"] - 1) / span if got["received"] > 1 and span > 0 else 0.0
    got["sent"] = sent
    got["publisher_cpu_us"] = pub_cpu / sent * 1e6
    got["subscriber_cpu_us"] = got["cpu_s"] / max(got["received"], 1) * 1e6
    return got


def bench_broadcast(key: Key, trials: int, seconds: float) -> dict[str, Any]:
    ctx = zmq.Context()
    pub = configure(ctx.socket(zmq.PUB))
    ctl = configure(ctx.socket(zmq.ROUTER))
    pub.bind("tcp://127.0.0.1:*")
    ctl.bind("tcp://127.0.0.1:*")
    ctl.setsockopt(zmq.RCVTIMEO, 30_000)
    chan = Channel("bench", "control", sender="supervisor", send_key=key, accept=())
    raw = chan.pack(BROADCAST)
    sub = _spawn(key, "sub", "--pub", pub.getsockopt(zmq.LAST_ENDPOINT).decode(),
                 "--ctl", ctl.getsockopt(zmq.LAST_ENDPOINT).decode())
    ident = b""
    try:
        # Slow joiner: re-publish a hello until the subscriber confirms it heard one.
        deadline = time.monotonic() + 30
        while not ctl.poll(50):
            if time.monotonic() > deadline or sub.poll() is not None:
                raise RuntimeError("subscriber never joined")
            pub.send_multipart([TOPIC, b"HELLO"])
        ident, joined = ctl.recv_multipart()
        if joined != b"joined":
            raise RuntimeError(f"subscriber said {joined!r}")
        _broadcast_trial(pub, ctl, ident, chan, "signed", 0, min(0.3, seconds), raw)  # warm up
        _broadcast_trial(pub, ctl, ident, chan, "raw", 1, min(0.3, seconds), raw)
        rates: dict[str, list[float]] = {"raw": [], "signed": []}
        detail: dict[str, list[dict[str, Any]]] = {"raw": [], "signed": []}
        for i, mode in enumerate(_order(trials), start=2):
            got = _broadcast_trial(pub, ctl, ident, chan, mode, i, seconds, raw)
            rates[mode].append(got["rate"])
            detail[mode].append(got)
        ctl.send_multipart([ident, b"quit"])
    finally:
        if ident and sub.poll() is None:
            _stop(sub)
        elif sub.poll() is None:
            sub.kill()
            sub.wait(5)
        pub.close(0)
        ctl.close(0)
        ctx.term()
    delivered = {m: [round(d["received"] / d["sent"], 4) for d in detail[m]] for m in detail}
    rejected = sum(d["rejected"] for m in detail for d in detail[m])
    return _compare(rates, unit="messages_per_s") | {
        "pattern": "PUB -> SUB, tcp loopback, subscriber in its own process",
        "message": "cancel (2 request ids)", "message_bytes": len(raw),
        "cpu_us_per_message": {
            mode: {side: round(statistics.median(d[f"{side}_cpu_us"] for d in detail[mode]), 2)
                   for side in ("publisher", "subscriber")} for mode in detail},
        "delivered_fraction": delivered, "rejected": rejected,
        "sent_per_s": {m: [round(d["sent"] / seconds) for d in detail[m]] for m in detail},
    }


def _compare(rates: dict[str, list[float]], *, unit: str) -> dict[str, Any]:
    raw = statistics.median(rates["raw"])
    signed = statistics.median(rates["signed"])
    ratio = signed / raw if raw else 0.0
    return {
        "unit": unit,
        "raw": [round(r) for r in rates["raw"]],
        "signed": [round(r) for r in rates["signed"]],
        "raw_median": round(raw),
        "signed_median": round(signed),
        "signed_over_raw": round(ratio, 4),
        "overhead_pct": round((1 - ratio) * 100, 2),
        "added_us_per_message": round((1 / signed - 1 / raw) * 1e6, 2) if signed and raw else None,
        "target_met": (1 - ratio) * 100 < TARGET_OVERHEAD_PCT,
    }


def codec_costs(key: Key) -> dict[str, float]:
    """In-process CPU cost of signing + encoding and of checking + decoding, µs/message
    (process time, so other load on the machine barely moves it)."""
    chan = Channel("bench", "codec", sender="gateway", send_key=key,
                   accept=REQUESTS_IN | REQUESTS_OUT | CONTROL)
    out = {}
    for name, body in (("generate", REQUEST), ("tokens", _reply(REQUEST.request_id)),
                       ("cancel", BROADCAST)):
        n = 2000
        out[f"pack_{name}_us"] = round(min(timeit.repeat(lambda b=body: chan.pack(b), number=n,
                                                         repeat=5, timer=time.process_time)) / n * 1e6, 2)
        frames = iter([chan.pack(body) for _ in range(n * 5)])
        out[f"unpack_{name}_us"] = round(min(timeit.repeat(lambda f=frames: chan.unpack(next(f)),
                                                           number=n, repeat=5,
                                                           timer=time.process_time)) / n * 1e6, 2)
    return out


def run(out_dir: Path | str | None = None, *, trials: int = 5, seconds: float = 2.0) -> dict[str, Any]:
    key = Key.from_secret(secrets.token_bytes(32))
    load_before = os.getloadavg()
    started = time.time()
    rpc, rpc_async = bench_rpc(key, trials, seconds)
    broadcast = bench_broadcast(key, trials, seconds)
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
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "rpc": rpc,
        "rpc_async": rpc_async,
        "broadcast": broadcast,
        "codec_us": codec,
    }
    result["summary"] = (
        f"rpc {rpc['signed_median']}/s signed vs {rpc['raw_median']}/s raw "
        f"(-{rpc['overhead_pct']}%, target <{TARGET_OVERHEAD_PCT:g}%: "
        f"{'met' if rpc['target_met'] else 'NOT met'}); "
        f"rpc asyncio {rpc_async['signed_median']}/s vs {rpc_async['raw_median']}/s "
        f"(-{rpc_async['overhead_pct']}%: {'met' if rpc_async['target_met'] else 'NOT met'}); "
        f"broadcast {broadcast['signed_median']}/s signed vs {broadcast['raw_median']}/s raw "
        f"(-{broadcast['overhead_pct']}%: {'met' if broadcast['target_met'] else 'NOT met'})"
    )
    write_result(out_dir if out_dir is not None else RESULTS, NAME, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
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
