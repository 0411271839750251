"""Bus benchmark, request-reply: DEALER ↔ ROUTER over tcp loopback, one call in flight,
the server (`bench.bus_children.serve_rpc`) in its own process. Each trial measures
round trips/s and CPU µs per round trip on both sides, in one mode (raw, plain, signed);
blocking sockets (`rpc`) and zmq.asyncio on the client (`rpc_async`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from bench.bus_children import (
    MODES,
    PROMPT,
    REPLY_TOKENS,
    REQUEST,
    Trials,
    order,
    plain_pack,
    plain_unpack,
    reply,
    spawn,
    stop,
)
from common.bus import Channel, configure
from common.envelope import Key
from common.messages import REQUESTS_OUT, Kind


def _exchange(chan: Channel, mode: str, raw_request: bytes) -> tuple[Callable[[], bytes],
                                                                     Callable[[list[bytes]], bool]]:
    """(make the request, check the reply frames) for one mode."""
    rid = REQUEST.request_id
    tokens = Kind.TOKENS
    if mode == "signed":
        def check_signed(frames: list[bytes]) -> bool:
            msg = chan.unpack_dealer(frames)
            return msg is not None and msg.body.request_id == rid
        return (lambda: chan.pack(REQUEST)), check_signed
    if mode == "plain":
        def check_plain(frames: list[bytes]) -> bool:
            return len(frames) == 1 and plain_unpack(frames[0], tokens).request_id == rid
        return (lambda: plain_pack(REQUEST)), check_plain
    return (lambda: raw_request), (lambda frames: len(frames) == 1)


def _per_call(n: int, client_cpu: float, server: dict[str, Any], rate: float) -> dict[str, float]:
    return {"rate": rate, "client_cpu_us": client_cpu / n * 1e6,
            "server_cpu_us": server["cpu_s"] / max(server["n"], 1) * 1e6}


def _rpc_trial(sock: zmq.Socket, chan: Channel, mode: str, seconds: float,
               raw_request: bytes) -> dict[str, float]:
    """One trial: round trips/s, and CPU µs per round trip on each side."""
    sock.send_multipart([b"MODE", mode.encode()])
    sock.recv()
    make, check = _exchange(chan, mode, raw_request)
    send, recv, clock = sock.send, sock.recv_multipart, time.perf_counter
    n = 0
    cpu0 = time.process_time()
    t0 = clock()
    end = t0 + seconds
    while clock() < end:
        send(make())
        if not check(recv()):
            raise RuntimeError(f"bad {mode} reply")
        n += 1
    rate = n / (clock() - t0)
    client_cpu = time.process_time() - cpu0
    sock.send_multipart([b"MODE", b"stat"])
    return _per_call(n, client_cpu, json.loads(sock.recv()), rate)


async def _rpc_async_trial(sock: zmq.asyncio.Socket, chan: Channel, mode: str, seconds: float,
                           raw_request: bytes) -> dict[str, float]:
    """The same trial on asyncio sockets, as the gateway and supervisor run them."""
    await sock.send_multipart([b"MODE", mode.encode()])
    await sock.recv()
    make, check = _exchange(chan, mode, raw_request)
    clock = time.perf_counter
    n = 0
    cpu0 = time.process_time()
    t0 = clock()
    end = t0 + seconds
    while clock() < end:
        await sock.send(make())
        if not check(await sock.recv_multipart()):
            raise RuntimeError(f"bad {mode} reply")
        n += 1
    rate = n / (clock() - t0)
    client_cpu = time.process_time() - cpu0
    await sock.send_multipart([b"MODE", b"stat"])
    return _per_call(n, client_cpu, json.loads(await sock.recv()), rate)


async def _rpc_async_trials(endpoint: str, chan: Channel, trials: int, seconds: float,
                            raw_request: bytes) -> Trials:
    ctx = zmq.asyncio.Context()
    sock = configure(ctx.socket(zmq.DEALER))
    sock.connect(endpoint)
    try:
        for mode in MODES:  # warm up every path
            await _rpc_async_trial(sock, chan, mode, min(0.3, seconds), raw_request)
        out: Trials = {m: [] for m in MODES}
        for mode in order(trials):
            out[mode].append(await asyncio.wait_for(
                _rpc_async_trial(sock, chan, mode, seconds, raw_request), seconds + 30))
        return out
    finally:
        sock.close(0)
        ctx.term()


def bench_rpc(key: Key, trials: int, seconds: float) -> tuple[Trials, Trials, dict[str, Any]]:
    """(blocking trials, asyncio trials, what was sent): one server process for both.
    A trial is {rate, client_cpu_us, server_cpu_us}."""
    server = spawn(key, "rpc")
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
        for mode in MODES:  # warm up every path
            _rpc_trial(sock, chan, mode, min(0.3, seconds), raw_request)
        sync: Trials = {m: [] for m in MODES}
        for mode in order(trials):
            sync[mode].append(_rpc_trial(sock, chan, mode, seconds, raw_request))
        achan = Channel("bench", "requests", sender="gateway-async", send_key=key,
                        accept=REQUESTS_OUT)
        async_ = asyncio.run(_rpc_async_trials(endpoint, achan, trials, seconds,
                                               achan.pack(REQUEST)))
        sock.send_multipart([b"MODE", b"quit"])
    finally:
        sock.close(0)
        ctx.term()
        stop(server)
    the_reply = reply(REQUEST.request_id)
    sizes = {"request": f"generate, {len(PROMPT)}-token prompt",
             "request_bytes": {"signed": len(raw_request), "plain": len(plain_pack(REQUEST))},
             "reply": f"tokens, {len(REPLY_TOKENS)} tokens",
             "reply_bytes": {"signed": len(chan.pack(the_reply)), "plain": len(plain_pack(the_reply))}}
    return sync, async_, sizes

