"""Bus benchmark, broadcast: PUB → SUB over tcp loopback, the subscriber
(`bench.bus_children.serve_sub`) in its own process. The rate is what the subscriber
received per second (a PUB drops at its high-water mark when the subscriber cannot keep
up; the delivered fraction is reported), with CPU µs per message on both sides."""

from __future__ import annotations

import json
import time
from typing import Any

import zmq

from bench.bus_children import BROADCAST, MODES, TOPIC, Trials, order, plain_pack, spawn, stop
from common.bus import Channel, configure
from common.envelope import Key


def _publish(pub: zmq.Socket, chan: Channel, mode: str, seconds: float, raw: bytes) -> int:
    clock = time.perf_counter
    send = pub.send_multipart
    sent = 0
    end = clock() + seconds
    if mode == "signed":
        pack = chan.pack
        while clock() < end:
            for _ in range(50):
                send([TOPIC, pack(BROADCAST)])
            sent += 50
    elif mode == "plain":
        while clock() < end:
            for _ in range(50):
                send([TOPIC, plain_pack(BROADCAST)])
            sent += 50
    else:
        while clock() < end:
            for _ in range(50):
                send([TOPIC, raw])
            sent += 50
    return sent


def _broadcast_trial(pub: zmq.Socket, ctl: zmq.Socket, ident: bytes, chan: Channel, mode: str,
                     trial: int, seconds: float, raw: bytes) -> dict[str, Any]:
    ctl.send_multipart([ident, f"start:{trial}:{mode}".encode()])
    _, answer = ctl.recv_multipart()
    if answer != b"ready":
        raise RuntimeError(f"subscriber answered {answer!r}")
    cpu0 = time.process_time()
    sent = _publish(pub, chan, mode, seconds, raw)
    pub_cpu = time.process_time() - cpu0
    marker = f"END:{trial}".encode()
    deadline = time.monotonic() + 30
    while not ctl.poll(20):
        if time.monotonic() > deadline:
            raise RuntimeError("subscriber never reported")
        pub.send_multipart([TOPIC, marker])
    _, report = ctl.recv_multipart()
    got = json.loads(report)
    span = got["last"] - got["first"]
    got["rate"] = (got["received"] - 1) / span if got["received"] > 1 and span > 0 else 0.0
    got["sent"] = sent
    got["publisher_cpu_us"] = pub_cpu / sent * 1e6
    got["subscriber_cpu_us"] = got["cpu_s"] / max(got["received"], 1) * 1e6
    return got


def bench_broadcast(key: Key, trials: int, seconds: float) -> tuple[Trials, dict[str, Any]]:
    """(trials, what was sent and delivered). A trial is {rate, received, sent, rejected,
    publisher_cpu_us, subscriber_cpu_us, ...}."""
    ctx = zmq.Context()
    pub = configure(ctx.socket(zmq.PUB))
    ctl = configure(ctx.socket(zmq.ROUTER))
    pub.bind("tcp://127.0.0.1:*")
    ctl.bind("tcp://127.0.0.1:*")
    ctl.setsockopt(zmq.RCVTIMEO, 30_000)
    chan = Channel("bench", "control", sender="supervisor", send_key=key, accept=())
    raw = chan.pack(BROADCAST)
    sub = spawn(key, "sub", "--pub", pub.getsockopt(zmq.LAST_ENDPOINT).decode(),
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
        for i, mode in enumerate(MODES):  # warm up every path
            _broadcast_trial(pub, ctl, ident, chan, mode, i, min(0.3, seconds), raw)
        detail: Trials = {m: [] for m in MODES}
        for i, mode in enumerate(order(trials), start=len(MODES)):
            detail[mode].append(_broadcast_trial(pub, ctl, ident, chan, mode, i, seconds, raw))
        ctl.send_multipart([ident, b"quit"])
    finally:
        if ident and sub.poll() is None:
            stop(sub)
        elif sub.poll() is None:
            sub.kill()
            sub.wait(5)
        pub.close(0)
        ctl.close(0)
        ctx.term()
    return detail, {
        "message": "cancel (2 request ids)",
        "message_bytes": {"signed": len(raw), "plain": len(plain_pack(BROADCAST))},
        "delivered_fraction": {m: [round(d["received"] / d["sent"], 4) for d in detail[m]]
                               for m in MODES},
        "rejected": sum(d["rejected"] for m in MODES for d in detail[m]),
        "sent_per_s": {m: [round(d["sent"] / seconds) for d in detail[m]] for m in MODES},
    }

