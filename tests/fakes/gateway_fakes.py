"""In-process fakes for gateway tests: a rank 0 (real signed ROUTER streaming TOKENS)
and a supervisor (real signed admin ROUTER + events PUB) that lists it as serving.

FakeRank0 answers GENERATE with one TOKENS message per "step" (`step_s`), ABORT with a
final `abort` chunk at the next step, STATS with its active ids. What it generates is
`script(gen) -> list[int]` (default: the prompt echoed). Switches: `prefill_s` (delay
before the first token; `release_held()` makes every waiting request due now),
`ignore_abort`, `drop_final` (never send the final chunk of an aborted request), `silent`
(accept requests, never answer), `max_open` (refuse a GENERATE while that many are open,
as rank 0's bound does: error_code overloaded), `refuse(gen) -> (ErrorCode, text) | None`
(end it at once with that error, as rank 0 does), `cached(gen) -> int` (the prompt tokens
its first chunk says the prefix cache served, as rank 0's `cached_tokens`).
FakeSupervisor lists `rank_cache` (a CacheStats or None) as rank 0's prefix cache and
answers `cache_clear` with a step, unless `replies` cans another answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from common.bus import Channel, configure
from common.deployment_info import DeploymentInfo, RankInfo
from common.envelope import Key
from common.keys import seal_key
from common.messages import (
    ADMIN_IN,
    REQUESTS_IN,
    Abort,
    AdminReply,
    AdminRequest,
    CacheStats,
    DeploymentState,
    ErrorCode,
    Event,
    EventName,
    EventTopic,
    FinishReason,
    Generate,
    Stats,
    StatsRequest,
    Tokens,
)
from common.schema import to_wire


@dataclass
class _Req:
    ident: bytes
    gen: Generate
    out: list[int]
    sent: int = 0
    next_at: float = 0.0
    received_at: float = 0.0
    aborted: str | None = None
    beat_at: float = 0.0  # the next "still waiting" heartbeat (heartbeat_s)


@dataclass
class FakeRank0:
    key: Key
    step_s: float = 0.01
    prefill_s: float = 0.0
    script: Callable[[Generate], list[int]] | None = None
    ignore_abort: bool = False
    drop_final: bool = False
    silent: bool = False
    heartbeat_s: float = 0.0  # > 0: "still waiting" chunks until the first token, as rank 0
    max_open: int = 0
    refuse: Callable[[Generate], tuple[ErrorCode, str] | None] | None = None
    cached: Callable[[Generate], int] | None = None
    endpoint: str = ""
    generates: list[Generate] = field(default_factory=list)
    aborts: list[tuple[str, str, float]] = field(default_factory=list)  # (rid, reason, at)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    step: int = 0

    def start(self, endpoint: str | None = None) -> FakeRank0:
        """Serve on a free port, or on `endpoint` (a rank 0 back where it was)."""
        self._ctx = zmq.Context()
        self._sock = configure(self._ctx.socket(zmq.ROUTER))
        if endpoint:
            self._sock.bind(endpoint)
            self.endpoint = endpoint
        else:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._ch = Channel("fake-rank", "requests", sender="rank0", send_key=self.key,
                           accept=REQUESTS_IN)
        self._reqs: dict[str, _Req] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-rank0")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()

    @property
    def active_ids(self) -> list[str]:
        with self._lock:
            return list(self._reqs)

    def release_held(self) -> None:
        """Every request still waiting for its first token gets it at the next tick."""
        with self._lock:
            for r in self._reqs.values():
                r.next_at = min(r.next_at, time.monotonic())

    def abort_all(self, reason: str = "cancel") -> None:
        with self._lock:
            for r in self._reqs.values():
                r.aborted = r.aborted or reason

    def _send(self, ident: bytes, body) -> None:
        self._sock.send_multipart([ident, self._ch.pack(body)])

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [r.next_at for r in self._reqs.values()]
            wait = max(0.0, min(due) - now) if due else 0.05
            if self._sock.poll(int(min(wait, 0.05) * 1000) + 1):
                got = self._ch.unpack_router(self._sock.recv_multipart())
                if got is not None:
                    self._on(*got)
            self._tick()
            self._beat()

    def _beat(self) -> None:
        """Rank 0's "still waiting" heartbeat (Tokens.waiting) for each request before its
        first token, every `heartbeat_s`."""
        if not self.heartbeat_s:
            return
        now = time.monotonic()
        with self._lock:
            quiet = [r for r in self._reqs.values() if r.sent == 0 and now >= r.beat_at]
        for r in quiet:
            r.beat_at = now + self.heartbeat_s
            self._send(r.ident, Tokens(request_id=r.gen.request_id, tokens=[], index=0,
                                       step=self.step, waiting=True))

    def _on(self, ident: bytes, msg) -> None:
        b = msg.body
        now = time.monotonic()
        if isinstance(b, Generate):
            self.generates.append(b)
            if self.silent:
                return
            with self._lock:
                full = self.max_open and len(self._reqs) >= self.max_open
            refusal = (ErrorCode.OVERLOADED, "rank 0 is full") if full \
                else self.refuse(b) if self.refuse else None
            if refusal is not None:
                self._send(ident, Tokens(request_id=b.request_id, tokens=[], index=0,
                                         finish_reason=FinishReason.ERROR, error=refusal[1],
                                         error_code=refusal[0]))
                return
            out = (self.script or (lambda g: list(g.prompt)))(b)[: b.max_tokens]
            with self._lock:
                self._reqs[b.request_id] = _Req(ident, b, out, next_at=now + self.prefill_s + self.step_s,
                                                received_at=now)
        elif isinstance(b, Abort):
            self.aborts.append((b.request_id, b.reason, time.time()))
            with self._lock:
                r = self._reqs.get(b.request_id)
                if r is not None and not self.ignore_abort:
                    r.aborted = r.aborted or b.reason
        elif isinstance(b, StatsRequest):
            with self._lock:
                ids = list(self._reqs)
            self._send(ident, Stats(request_id=b.request_id, phase="serving", step=self.step,
                                    active=len(ids), active_ids=ids, cancel_epoch=0))

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._reqs.values() if r.next_at <= now]
        if not due:
            return
        self.step += 1
        for r in due:
            rid = r.gen.request_id
            if r.aborted:
                with self._lock:
                    self._reqs.pop(rid, None)
                self.finished[rid] = FinishReason.ABORT
                if not self.drop_final:
                    self._send(r.ident, Tokens(request_id=rid, tokens=[], index=r.sent,
                                               finish_reason=FinishReason.ABORT, step=self.step))
                continue
            tok = r.out[r.sent] if r.sent < len(r.out) else None
            finish = None
            if r.sent + 1 >= len(r.out):
                finish = FinishReason.LENGTH if len(r.out) >= r.gen.max_tokens \
                    else FinishReason.STOP
            ttft = (now - r.received_at) * 1000 if r.sent == 0 else None
            toks = [tok] if tok is not None else []
            cached = self.cached(r.gen) if self.cached is not None and r.sent == 0 else 0
            self._send(r.ident, Tokens(request_id=rid, tokens=toks, index=r.sent,
                                       finish_reason=finish, prompt_tokens=len(r.gen.prompt),
                                       model_ttft_ms=ttft, step=self.step,
                                       token_times=[time.time()] * len(toks),
                                       cached_tokens=cached))
            r.sent += 1
            r.next_at = now + self.step_s
            if finish:
                with self._lock:
                    self._reqs.pop(rid, None)
                self.finished[rid] = finish


@dataclass
class FakeSupervisor:
    """Admin ROUTER + events PUB; one deployment, served by `rank`."""

    key: Key
    rank: FakeRank0
    model_path: str
    deployment_id: str = "dep-fake"
    state: str = "serving"
    canary_at: float | None = field(default_factory=time.time)
    commands: list[AdminRequest] = field(default_factory=list)
    replies: dict[str, AdminReply] = field(default_factory=dict)  # command → canned reply
    silent: set[str] = field(default_factory=set)  # commands never answered (a slow one)
    rank_cache: CacheStats | None = None  # rank 0's prefix cache, as its telemetry says

    def start(self) -> FakeSupervisor:
        self._ctx = zmq.Context()
        self._admin = configure(self._ctx.socket(zmq.ROUTER))
        self.admin_endpoint = f"tcp://127.0.0.1:{self._admin.bind_to_random_port('tcp://127.0.0.1')}"
        self._pub = configure(self._ctx.socket(zmq.PUB))
        self.events_endpoint = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._ch = Channel("fake-supervisor", "admin", sender="supervisor", send_key=self.key,
                           accept=ADMIN_IN)
        self._ev = Channel("fake-supervisor", "events", sender="supervisor", send_key=self.key)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-supervisor")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._admin.close(0)
        self._pub.close(0)
        self._ctx.term()

    def info(self) -> dict:
        """A DeploymentInfo as the supervisor sends it: the requests key (here the fake's
        one key, which the fake rank also uses) sealed under the cluster key."""
        return to_wire(DeploymentInfo(
            deployment_id=self.deployment_id, job_id="job-1", state=self.state,
            model=self.model_path.rstrip("/").rsplit("/", 1)[-1],
            model_path=self.model_path, tp=1, pp=1, backend="none", world_size=1,
            requests_endpoint=self.rank.endpoint,
            requests_key_sealed=seal_key(self.key, self.key,
                                         context=f"{self.deployment_id}/job-1"),
            canary_at=self.canary_at, error=None, teardown=None,
            ranks=[RankInfo(rank=0, host="127.0.0.1", remote=False, pid=1, phase="serving",
                            step=self.rank.step, active=len(self.rank.active_ids),
                            cancel_epoch=0, acked_epoch=0, mem_active=0,
                            last_seen=time.time(), cache=self.rank_cache)]))

    def publish(self, name: EventName = EventName.STATE,
                topic: EventTopic = EventTopic.DEPLOYMENT) -> None:
        """An event; topic deployment, name state is a state change, as the supervisor's."""
        ev = Event(topic=topic, name=name, deployment_id=self.deployment_id,
                   state=DeploymentState(self.state), at=time.time(), data={"job_id": "job-1"})
        self._pub.send_multipart([b"events", self._ev.pack(ev)])

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._admin.poll(50):
                continue
            got = self._ch.unpack_router(self._admin.recv_multipart())
            if got is None:
                continue
            ident, msg = got
            req: AdminRequest = msg.body
            self.commands.append(req)
            if req.command in self.silent:
                continue
            reply = self._answer(req)
            self._admin.send_multipart([ident, self._ch.pack(reply)])

    def _answer(self, req: AdminRequest) -> AdminReply:
        ok = lambda data: AdminReply(request_id=req.request_id, ok=True, code="ok", data=data)  # noqa: E731
        canned = self.replies.get(req.command)
        if canned is not None:
            return AdminReply(request_id=req.request_id, ok=canned.ok, code=canned.code,
                              message=canned.message, data=canned.data)
        deps = [self.info()] if self.state != "gone" else []
        if req.command == "status":  # each reply as its command's Reply declares it
            eps = {"admin": self.admin_endpoint, "events": self.events_endpoint,
                   "control": "tcp://127.0.0.1:1", "report": "tcp://127.0.0.1:2"}
            return ok({"supervisor": {"pid": 1, "boot_id": "fake", "uptime_s": 1.0,
                                      "home": "/fake", "endpoints": eps},
                       "deployments": deps, "cancel_epoch": 3, "rejections": [],
                       "reaper": None, "events": []})
        if req.command == "deployments":
            return ok({"deployments": deps})
        if req.command == "abort_all":
            self.rank.abort_all("cancel")
            deadline = time.monotonic() + 5
            while self.rank.active_ids and time.monotonic() < deadline:
                time.sleep(0.01)
            left = len(self.rank.active_ids)
            return ok({"epoch": 4, "zero_active": left == 0, "ranks": {"0": left},
                       "acked": {"0": {"step_applied": self.rank.step}}, "missing": [],
                       "deployments": {}, "waited_s": 0.0})
        if req.command == "stop":
            self.state = "gone"
            return ok({"deployment_id": req.args.get("deployment_id"),
                       "outcome": {"proven": True, "path": ["graceful"], "survivors": []}})
        if req.command == "cache_clear":
            if req.args.get("deployment_id") != self.deployment_id:
                return AdminReply(request_id=req.request_id, ok=False, code="not_found",
                                  message=f"no deployment {req.args.get('deployment_id')!r}")
            return ok({"deployment_id": self.deployment_id, "clear_id": 1,
                       "step": self.rank.step, "enabled": True, "sends": 1, "waited_s": 0.0})
        if req.command == "ping":
            return ok({"pid": 1, "boot_id": "fake", "version": "fake"})
        return AdminReply(request_id=req.request_id, ok=False, code="unknown_command",
                          message=f"fake supervisor: {req.command}")
