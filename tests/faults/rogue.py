"""A rogue process for the admission fault tests: `python -m tests.faults.rogue < PLAN.json`.

The plan arrives on stdin (keys never on a command line) as JSON:

    {"seconds": 1.0,                       # per phase
     "phases": ["burn", "garbage", "multipart", "raw_tcp", "wrong_key", "replay", "stale",
                "old_launch", "impersonate", "halfopen", "oversize"],
     "targets": [{"name": "plan", "endpoint": "tcp://...", "type": "router"|"pub",
                  "key": HEX, "old_key": HEX, "deployment_id": ..., "job_id": ...,
                  "old_job_id": ..., "auth_rank": 1, "replay": [HEX, ...],
                  "cap": BYTES, "body": "auth"|"generate"|"admin"}]}

Each phase hits every target at full speed (as fast as the target's socket takes frames)
for `seconds`, then prints one JSON line {"phase", "sent": {target: n}, "received": n}.
Nothing a target sends back to an unauthenticated peer is expected: `received` counts it.
"""

from __future__ import annotations

import json
import random
import resource
import secrets
import socket
import subprocess
import sys
import time

import zmq

from common import messages as m
from common.envelope import Key, Signer

HALF_OPEN = 1000
# Which attack variant comes next: seeded, so every run sends the same mix.
RNG = random.Random(1201)
SILENT = 100


def key(hex_: str) -> Key:
    return Key.from_secret(bytes.fromhex(hex_))


def body_for(t: dict, *, rank: int | None = None, job: str | None = None):
    kind = t.get("body", "auth")
    if kind == "auth":
        return m.AuthHello(t["deployment_id"], job or t["job_id"],
                           t.get("auth_rank", 1) if rank is None else rank,
                           secrets.token_bytes(16))
    if kind == "generate":
        return m.Generate("rogue-" + secrets.token_hex(4), [1, 2, 3], 4)
    return m.AdminRequest("rogue-" + secrets.token_hex(4), "status", {})


def frames_for(phase: str, t: dict, signers: dict) -> list[bytes]:
    """One message (list of frames) for `phase` against target `t`."""
    if phase == "garbage":
        return [RNG.randbytes(1 + RNG.randrange(300))]
    if phase == "multipart":
        return [RNG.randbytes(20), RNG.randbytes(20), RNG.randbytes(20)]
    if phase == "wrong_key":
        return [signers["wrong"].encode(body_for(t))]
    if phase == "replay":
        recorded = t.get("replay") or []
        return [bytes.fromhex(RNG.choice(recorded))] if recorded else []
    if phase == "stale":
        return [signers["right"].encode(body_for(t), ts=time.time() - 120)]
    if phase == "old_launch":
        return [signers["old"].encode(body_for(t, job=t.get("old_job_id")))]
    if phase == "impersonate":
        if t.get("body", "auth") != "auth":
            return []
        pick = RNG.randrange(3)
        if pick == 0:  # an authenticated rank's id from another connection
            return [signers["right"].encode(body_for(t))]
        if pick == 1:  # a rank that does not exist
            return [signers["right"].encode(body_for(t, rank=97))]
        return [signers["right"].encode(t["unauth_body"]())]  # skip the handshake
    return []


def unauth_body(t: dict):
    if t["name"] == "plan":
        return m.Pong(nonce=1, rank=t.get("auth_rank", 1), step=0, phase="serving")
    return m.Telemetry(t["deployment_id"], t["job_id"], t.get("auth_rank", 0), 1, "serving",
                       0, 0, 0)


class Rogue:
    def __init__(self, plan: dict) -> None:
        self.plan = plan
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 8192)
        self.targets = [t for t in plan["targets"] if t.get("type", "router") == "router"]
        self.pubs = [t for t in plan["targets"] if t.get("type") == "pub"]
        self.received = 0
        for t in self.targets:
            t["unauth_body"] = lambda t=t: unauth_body(t)
            t["signers"] = {
                "wrong": Signer(Key.from_secret(secrets.token_bytes(32)), "mallory"),
                "right": Signer(key(t["key"]), "mallory") if t.get("key") else None,
                "old": Signer(key(t["old_key"]), "old-rank") if t.get("old_key") else None}

    def dealer(self, endpoint: str, connected_within: float | None = None) -> zmq.Socket:
        """A DEALER to `endpoint`; with `connected_within`, returned only once its ZMTP
        handshake is done (or that many seconds passed): frames queued on a DEALER still
        connecting die unsent when it closes (LINGER 0), so under load a phase of one
        second could reach a target with none of them, uncounted."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100)
        s.setsockopt(zmq.SNDBUF, 65536)  # a bounded backlog: attacks end when phases do
        s.setsockopt(zmq.IDENTITY, b"rogue-" + secrets.token_hex(6).encode())
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) \
            if connected_within is not None else None
        s.connect(endpoint)
        if mon is not None:
            mon.poll(int(connected_within * 1000))  # the event, or the deadline
            s.disable_monitor()
            mon.close(0)
        return s

    def drain(self, socks) -> None:
        for s in socks:
            while True:
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                    self.received += 1
                except zmq.Again:
                    break

    def flood(self, phase: str, seconds: float) -> dict[str, int]:
        socks = {t["name"]: self.dealer(t["endpoint"], connected_within=10.0)
                 for t in self.targets}
        sent = dict.fromkeys(socks, 0)
        poller = zmq.Poller()
        for s in socks.values():
            poller.register(s, zmq.POLLOUT)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            progressed = False
            for t in self.targets:
                if t["signers"].get("right") is None and phase in ("stale", "impersonate"):
                    continue
                if t["signers"].get("old") is None and phase == "old_launch":
                    continue
                frames = frames_for(phase, t, t["signers"])
                if not frames:
                    continue
                try:
                    socks[t["name"]].send_multipart(frames, zmq.NOBLOCK)
                    sent[t["name"]] += 1
                    progressed = True
                except zmq.Again:
                    pass
            if not progressed:
                poller.poll(5)  # every target pushes back: wait, do not spin
        self.drain(socks.values())
        for s in socks.values():
            s.close(0)
        return sent

    def raw_tcp(self, seconds: float) -> dict[str, int]:
        sent: dict[str, int] = {}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for t in self.targets + self.pubs:
                host, port = t["endpoint"].removeprefix("tcp://").rsplit(":", 1)
                try:
                    with socket.create_connection((host, int(port)), timeout=0.5) as c:
                        c.sendall(RNG.randbytes(64))
                    sent[t["name"]] = sent.get(t["name"], 0) + 1
                except OSError:
                    pass
        return sent

    def halfopen(self, seconds: float) -> dict[str, int]:
        """HALF_OPEN connections per auth target that send one AUTH_HELLO and never
        answer the challenge (half with a wrong key, half with the launch's key and a
        taken rank), plus SILENT connections per socket that never speak at all. One
        child process per auth target: a ZeroMQ socket costs two descriptors, and a
        process that imported mlx_lm hands its children RLIMIT_NOFILE (2048, 4096)."""
        auth = [t for t in self.targets if t.get("body", "auth") == "auth"]
        children = []
        for t in auth:
            c = subprocess.Popen([sys.executable, "-m", "tests.faults.rogue", "--halfopen"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            plain = {k: v for k, v in t.items() if k not in ("signers", "unauth_body")}
            c.stdin.write(json.dumps({"target": plain, "seconds": seconds}))
            c.stdin.close()
            children.append(c)
        socks = [self.dealer(t["endpoint"]) if t in self.targets else self._sub(t["endpoint"])
                 for t in self.targets + self.pubs if t not in auth for _ in range(SILENT)]
        sent: dict[str, int] = {}
        for c in children:
            got = json.loads(c.stdout.read() or "{}")
            c.wait()
            sent.update(got.get("sent", {}))
            self.received += got.get("received", 0)
        self.drain(socks)
        for s in socks:
            s.close(0)
        return sent

    def halfopen_one(self, seconds: float) -> dict:
        """The child: HALF_OPEN handshakes and SILENT connections against one target."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        t = self.targets[0]
        socks = []
        for i in range(HALF_OPEN):
            s = self.dealer(t["endpoint"])
            signer = t["signers"]["right"] if (i % 2 and t["signers"]["right"]) \
                else t["signers"]["wrong"]
            s.send(signer.encode(body_for(t)), zmq.NOBLOCK)
            socks.append(s)
        socks += [self.dealer(t["endpoint"]) for _ in range(SILENT)]
        time.sleep(seconds)
        self.drain(socks)
        for s in socks:
            s.close(0)
        return {"sent": {t["name"]: HALF_OPEN}, "received": self.received}

    def _sub(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.XSUB)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send(b"\x01" + RNG.randbytes(2000))  # an oversized "subscription"
        return s

    def oversize(self) -> dict[str, int]:
        """Per target: frames just above the channel's cap, and one far above it. libzmq
        enforces the cap on listeners (common.bus.configure_listener): each connection
        is dropped at its first such frame, nothing delivered or answered."""
        sent, socks = {}, []
        for t in self.targets:
            s = self.dealer(t["endpoint"])
            for _ in range(3):
                s.send(RNG.randbytes(int(t["cap"]) + 1024))
            socks.append(s)
            sent[t["name"]] = 3
        time.sleep(1.0)  # delivered and counted before anything is dropped
        for t in self.targets:  # its own connection: libzmq drops it, nothing delivered
            s = self.dealer(t["endpoint"])
            s.send(RNG.randbytes(2 * int(t["cap"]) + 4096))
            socks.append(s)
        time.sleep(0.5)
        self.drain(socks)
        for s in socks:
            s.close(0)
        return sent

    def run(self) -> None:
        seconds = float(self.plan.get("seconds", 1.0))
        for phase in self.plan["phases"]:
            t0 = time.time()
            if phase == "quiet":  # nothing: the undisturbed windows between attacks
                time.sleep(seconds)
                sent = {}
            elif phase == "burn":  # no traffic: only the CPU a flood would use (control run)
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    pass
                sent = {}
            elif phase == "raw_tcp":
                sent = self.raw_tcp(seconds)
            elif phase == "halfopen":
                sent = self.halfopen(seconds)
            elif phase == "oversize":
                sent = self.oversize()
            else:
                sent = self.flood(phase, seconds)
            print(json.dumps({"phase": phase, "sent": sent, "received": self.received,
                              "started": t0, "ended": time.time()}), flush=True)
        self.ctx.destroy(0)


def main() -> int:
    if sys.argv[1:] == ["--halfopen"]:  # a child of the halfopen phase
        job = json.load(sys.stdin)
        r = Rogue({"targets": [job["target"]]})
        print(json.dumps(r.halfopen_one(float(job["seconds"]))), flush=True)
        r.ctx.destroy(0)
        return 0
    Rogue(json.load(sys.stdin)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
