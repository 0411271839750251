"""Bus benchmark, shared part: the modes and their order, the payloads, the `plain`
codec, and the child processes (the ROUTER server and the SUB subscriber) that
`bench.bus_rpc` and `bench.bus_broadcast` measure against.

Three modes, switched per trial by the parent:
- `raw`: pre-built bytes (a signed frame), neither serialized nor checked;
- `plain`: the typed body serialized per message (`msgpack.packb(body,
  default=wire_default)`) and decoded on receipt (`msgpack.unpackb` with the verifier's
  body limits + `decode_into(BODY[kind], ...)`): a typed bus without the envelope;
- `signed`: `Channel.pack` / `Channel.unpack_*` (header, HMAC-SHA256, replay window,
  timestamp window, typed decode).

Run as `python -m bench.bus_children {rpc|sub} [--pub EP --ctl EP]`, the key's secret
in hex on stdin (`spawn` does this).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.bus import Channel, configure
from common.envelope import DEFAULT_MAX_SIZE, Key
from common.messages import BODY, CONTROL, REQUESTS_IN, Cancel, Generate, Kind, Sampling, Tokens
from common.schema import SchemaError, decode_into, wire_default

REPO = Path(__file__).resolve().parents[1]
MODES = ("raw", "plain", "signed")
TOPIC = b"ctl:bench-deployment"
PROMPT = list(range(1000, 1064))
REQUEST = Generate(request_id="r-0123456789abcdef", prompt=PROMPT, max_tokens=16,
                   sampling=Sampling(temperature=0.7, seed=1234))
REPLY_TOKENS = [4711, 4712, 4713, 4714]
BROADCAST = Cancel(deployment_id="bench-deployment", epoch=7, scope="requests",
                   request_ids=["r-0123456789abcdef", "r-fedcba9876543210"], reason="bench")
# The limits common.envelope.Verifier applies to a body before decode_into.
UNPACK_LIMITS: dict[str, Any] = dict(
    raw=False, strict_map_key=True, max_str_len=DEFAULT_MAX_SIZE, max_bin_len=DEFAULT_MAX_SIZE,
    max_array_len=DEFAULT_MAX_SIZE, max_map_len=65536, max_ext_len=0)


Trials = dict[str, list[dict[str, Any]]]  # mode -> one dict per trial


def order(trials: int) -> list[str]:
    """Balanced, so all modes share drift: raw plain signed, signed plain raw, ..."""
    return [m for i in range(trials) for m in (MODES if i % 2 == 0 else MODES[::-1])]


def reply(request_id: str) -> Tokens:
    return Tokens(request_id=request_id, tokens=REPLY_TOKENS, index=12, step=40)


def plain_pack(body: Any) -> bytes:
    """Serialize a typed body, no envelope."""
    return msgpack.packb(body, default=wire_default)


def plain_unpack(data: bytes, kind: Kind) -> Any:
    """Decode and type-check a body of a known kind, no envelope (raises SchemaError,
    ValueError, TypeError or a msgpack error on bad input)."""
    return decode_into(BODY[kind], msgpack.unpackb(data, **UNPACK_LIMITS))


# --- children --------------------------------------------------------------------------


def serve_rpc(key: Key) -> None:
    """ROUTER server. A 3-frame [id, b"MODE", raw|plain|signed|stat|quit] message switches
    mode and answers the calls served and CPU seconds used since the previous one."""
    ctx = zmq.Context()
    sock = configure(ctx.socket(zmq.ROUTER))
    sock.bind("tcp://127.0.0.1:*")
    chan = Channel("bench", "requests", sender="rank-0", send_key=key, accept=REQUESTS_IN)
    raw_reply = chan.pack(reply(REQUEST.request_id))
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    mode = "raw"
    served, cpu0 = 0, time.process_time()
    generate = Kind.GENERATE
    while True:
        frames = sock.recv_multipart()
        if len(frames) == 3 and frames[1] == b"MODE":
            if frames[2] == b"quit":
                break
            if frames[2] != b"stat":
                mode = frames[2].decode()
            cpu = time.process_time()
            sock.send_multipart([frames[0], json.dumps({"n": served, "cpu_s": cpu - cpu0}).encode()])
            served, cpu0 = 0, cpu
            continue
        served += 1
        if mode == "signed":
            got = chan.unpack_router(frames)
            if got is not None:
                ident, msg = got
                sock.send_multipart([ident, chan.pack(reply(msg.body.request_id))])
        elif mode == "plain":
            if len(frames) != 2:
                continue
            try:
                body = plain_unpack(frames[1], generate)
            except (SchemaError, ValueError, TypeError, msgpack.UnpackException):
                continue
            sock.send_multipart([frames[0], plain_pack(reply(body.request_id))])
        else:
            sock.send_multipart([frames[0], raw_reply])
    sock.close(0)
    ctx.term()


def _count(sub: zmq.Socket, end_marker: bytes, accept: Any) -> dict[str, Any]:
    """Receive until `end_marker`; `accept(frames)` is true for a good message."""
    clock = time.perf_counter
    received = rejected = 0
    first = last = 0.0
    cpu0 = time.process_time()
    recv = sub.recv_multipart
    while True:
        frames = recv()
        payload = frames[1]
        if payload[:4] == b"END:" or payload == b"HELLO":
            if payload == end_marker:
                break
            continue
        if not accept(frames):
            rejected += 1
            continue
        last = clock()
        if not received:
            first = last
        received += 1
    return {"received": received, "rejected": rejected, "first": first, "last": last,
            "cpu_s": time.process_time() - cpu0}


def serve_sub(key: Key, pub_endpoint: str, ctl_endpoint: str) -> None:
    """Subscriber: joins (answers a HELLO on its DEALER), then per trial counts what
    arrives until that trial's END and reports {received, rejected, first, last, cpu_s}."""
    ctx = zmq.Context()
    sub = configure(ctx.socket(zmq.SUB))
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(pub_endpoint)
    ctl = configure(ctx.socket(zmq.DEALER))
    ctl.connect(ctl_endpoint)
    chan = Channel("bench", "control", sender="rank-1", send_key=key, accept=CONTROL)
    cancel = Kind.CANCEL

    def accept_signed(frames: list[bytes]) -> bool:
        return chan.unpack_sub(frames, TOPIC) is not None

    def accept_plain(frames: list[bytes]) -> bool:
        if len(frames) != 2 or frames[0] != TOPIC:
            return False
        try:
            plain_unpack(frames[1], cancel)
        except (SchemaError, ValueError, TypeError, msgpack.UnpackException):
            return False
        return True

    def accept_raw(frames: list[bytes]) -> bool:
        return len(frames) == 2 and frames[0] == TOPIC

    accept = {"raw": accept_raw, "plain": accept_plain, "signed": accept_signed}
    while sub.recv_multipart()[1] != b"HELLO":
        pass
    ctl.send(b"joined")
    while True:
        cmd = ctl.recv().decode().split(":")
        if cmd[0] == "quit":
            break
        trial, mode = cmd[1], cmd[2]
        ctl.send(b"ready")
        got = _count(sub, f"END:{trial}".encode(), accept[mode])
        ctl.send(json.dumps(got).encode())
    sub.close(0)
    ctl.close(0)
    ctx.term()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bus_children")
    ap.add_argument("role", choices=["rpc", "sub"])
    ap.add_argument("--pub")
    ap.add_argument("--ctl")
    args = ap.parse_args(argv)
    key = Key.from_secret(bytes.fromhex(sys.stdin.readline().strip()))
    if args.role == "rpc":
        serve_rpc(key)
    else:
        serve_sub(key, args.pub, args.ctl)
    return 0


# --- in the parent ---------------------------------------------------------------------


def spawn(key: Key, *args: str, module: str = "bench.bus_children") -> subprocess.Popen:
    """Start a child (`python -m <module> <args>`: `rpc` or `sub ...` here) in its own
    process, handing it the key."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(key.secret.hex() + "\n")
    proc.stdin.flush()
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
