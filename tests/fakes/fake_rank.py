"""A fake rank: the rank's control/report/requests protocol (docs/protocol.md) without
MLX. Tokens are an echo of the prompt, one per step. Started by the supervisor exactly
like the real rank (`python -m tests.fakes.fake_rank --spec FILE`).

Misbehaviours, switched on by environment. Each value is "all" or a comma list of ranks
("1", "0,1"); unset or empty means off:

  LOCKSTEP_FAKE_IGNORE_SIGTERM   ignore SIGTERM and the control `shutdown`
  LOCKSTEP_FAKE_NEVER_READY      stay `loading` forever
  LOCKSTEP_FAKE_CRASH_ON_LOAD    write a `failed` marker with an error, exit 3 during load
  LOCKSTEP_FAKE_EXIT_LATE_S      "SECONDS" or "SECONDS@RANKS": linger that long before
                                 exiting on SIGTERM/shutdown
  LOCKSTEP_FAKE_STEP_S           seconds per decode step (default 0.01)
  LOCKSTEP_FAKE_DROP_CACHE_CLEARS  rank 0 drops this many CACHE_CLEAR copies before it
                                 answers one (a large number: it never answers)

A toy prefix cache (rank 0, settings.prompt_cache_entries > 0): a finished request's
prompt + echo is stored (LRU, that many entries); a GENERATE sharing a prefix with one
reports it as `cached_tokens` on its first chunk (capped at len(prompt) - 1, as the real
rank); CACHE_CLEAR empties it and answers CACHE_CLEARED; its CacheStats ride on rank
0's telemetry (a follower's stay empty: it never sees a request).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass

import zmq

from common.bus import Channel, configure
from common.home import Paths, write_marker
from common.keys import LaunchKeys, read_secret_file
from common.messages import (
    CONTROL,
    REPORT_TO_RANK,
    REQUESTS_IN,
    Abort,
    CacheClear,
    CacheCleared,
    CacheStats,
    Cancel,
    CancelAck,
    FinishReason,
    Generate,
    Lease,
    RankReady,
    Serve,
    Shutdown,
    Stats,
    StatsRequest,
    Telemetry,
    Tokens,
)
from common.procs import identify
from common.rankspec import RankSpec
from common.records import Phase, RankMarker
from services.rank.auth import InitiatorLink, new_identity


def switched(name: str, rank: int) -> bool:
    value = os.environ.get(name, "").strip()
    if not value:
        return False
    if value == "all":
        return True
    return str(rank) in {v.strip() for v in value.split(",")}


def exit_late_s(rank: int) -> float:
    value = os.environ.get("LOCKSTEP_FAKE_EXIT_LATE_S", "").strip()
    if not value:
        return 0.0
    secs, _, ranks = value.partition("@")
    if ranks and str(rank) not in ranks.split(","):
        return 0.0
    return float(secs)


@dataclass
class Request:
    ident: bytes
    body: Generate
    produced: int = 0
    cached_tokens: int = 0
    fed: list[int] | None = None


FAKE_BYTES_PER_TOKEN = 1024


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ToyCache:
    """LRU of token sequences; its figures in the real rank's CacheStats shape."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: list[list[int]] = []  # LRU first
        self.stats = CacheStats()

    def match(self, prompt: list[int]) -> int:
        best, at = 0, None
        for i, e in enumerate(self.entries):
            n = min(shared_prefix(e, prompt), len(prompt) - 1)
            if n > best:
                best, at = n, i
        if at is None:
            self.stats.misses += 1
            return 0
        self.entries.append(self.entries.pop(at))
        self.stats.hits += 1
        self.stats.hit_tokens += best
        return best

    def store(self, tokens: list[int]) -> None:
        self.entries.append(list(tokens))
        self.stats.stored += 1
        while len(self.entries) > self.max_entries:
            self.entries.pop(0)
            self.stats.evicted += 1
        self._figures()

    def clear(self) -> None:
        self.entries.clear()
        self._figures()

    def _figures(self) -> None:
        self.stats.entries = len(self.entries)
        self.stats.tokens = sum(map(len, self.entries))
        self.stats.bytes = self.stats.tokens * FAKE_BYTES_PER_TOKEN


class FakeRank:
    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        keys = LaunchKeys(read_secret_file(spec.secret_path), spec.deployment_id, spec.job_id)
        self.paths = Paths(spec.home)
        me = identify(os.getpid())
        self.pid, self.start_time = os.getpid(), me.start_time
        # As the real rank (services/rank/runtime.py): a remote rank's parent is the host
        # agent that spawned it and exits at once by design; only a local one watches it.
        self.ppid = os.getppid() if spec.watch_parent else None
        self.ignore_term = switched("LOCKSTEP_FAKE_IGNORE_SIGTERM", self.rank)
        self.step_s = float(os.environ.get("LOCKSTEP_FAKE_STEP_S", "0.01"))
        sender = f"rank{self.rank}:{self.pid}"
        self.control_ch = Channel("fake_rank", "control", sender=sender,
                                  send_key=keys.control, accept=CONTROL)
        self.report_ch = Channel("fake_rank", "report", sender=sender, send_key=keys.report,
                                 accept=REPORT_TO_RANK)
        self.req_ch = Channel("fake_rank", "requests", sender=sender, send_key=keys.requests,
                              accept=REQUESTS_IN)
        self.ctx = zmq.Context()
        self.control = configure(self.ctx.socket(zmq.SUB))
        self.control.setsockopt(zmq.SUBSCRIBE, b"ctl:" + spec.deployment_id.encode())
        self.control.connect(spec.control_endpoint)
        self.report = configure(self.ctx.socket(zmq.DEALER))
        ident = new_identity(self.rank)
        self.report.setsockopt(zmq.IDENTITY, ident)
        self.report.connect(spec.report_endpoint)
        # Like the real rank: the session handshake with the supervisor comes first; reports
        # wait for it, control is not believed before it.
        self.link = InitiatorLink("report", spec, keys, self.report_ch, ident,
                                  lambda b: self.report.send(self.report_ch.pack(b), zmq.NOBLOCK))
        self.held: list[object] = []
        self.requests: zmq.Socket | None = None
        self.phase = Phase.STARTING
        self.step = 0
        self.cancel_epoch = spec.cancel_epoch_floor
        self.active: dict[str, Request] = {}
        self.last_lease = 0.0
        self.stop_flag = False
        self.error: str | None = None
        self.next_telemetry = 0.0
        self.next_step = 0.0
        entries = spec.settings.prompt_cache_entries
        self.cache = ToyCache(entries) if entries > 0 else None  # followers: stays empty
        self.drop_clears = int(os.environ.get("LOCKSTEP_FAKE_DROP_CACHE_CLEARS", "0") or 0)
        self.clears_done: dict[int, CacheCleared] = {}
        signal.signal(signal.SIGTERM, signal.SIG_IGN if self.ignore_term else self._on_term)

    def _on_term(self, *_: object) -> None:
        self.stop_flag = True  # only a flag: the loop does the work

    # --- reporting -----------------------------------------------------------------

    def marker(self, phase: Phase, error: str | None = None) -> None:
        self.phase = phase
        write_marker(self.paths, RankMarker(
            deployment_id=self.spec.deployment_id, job_id=self.spec.job_id, rank=self.rank,
            host=self.spec.host, pid=self.pid, start_time=self.start_time, phase=phase,
            updated_at=time.time(), step=self.step, active=len(self.active),
            cancel_epoch=self.cancel_epoch, error=error))

    def send_report(self, body: object) -> None:
        if not self.link.accepted:
            self.held = [*self.held[-63:], body]
            return
        self.report.send(self.report_ch.pack(body), flags=zmq.NOBLOCK)

    def on_report(self) -> None:
        msg = self.report_ch.unpack_dealer(self.report.recv_multipart())
        if msg is not None:
            self.link.on_message(msg)
        if self.link.accepted and self.held:
            held, self.held = self.held, []
            for body in held:
                self.send_report(body)

    def telemetry(self) -> None:
        self.send_report(Telemetry(
            deployment_id=self.spec.deployment_id, job_id=self.spec.job_id, rank=self.rank,
            pid=self.pid, phase=self.phase.value, step=self.step, active=len(self.active),
            cancel_epoch=self.cancel_epoch, at=time.time(), error=self.error,
            cache=self.cache.stats if self.cache is not None else None))
        self.marker(self.phase, self.error)

    # --- control -------------------------------------------------------------------

    def on_control(self) -> None:
        msg = self.control_ch.unpack_sub(self.control.recv_multipart(),
                                         b"ctl:" + self.spec.deployment_id.encode())
        if msg is None or not self.link.peer_verified:
            return
        body = msg.body
        if isinstance(body, Lease):
            self.last_lease = time.monotonic()
        elif isinstance(body, Serve) and self.phase == Phase.READY:
            self.marker(Phase.SERVING)
            self.next_telemetry = 0.0
        elif isinstance(body, Shutdown) and not self.ignore_term:
            self.stop_flag = True
        elif isinstance(body, Cancel):
            self.on_cancel(body)
        elif isinstance(body, CacheClear) and self.rank == 0:
            self.on_cache_clear(body)

    def on_cache_clear(self, c: CacheClear) -> None:
        if self.drop_clears > 0:
            self.drop_clears -= 1
            return
        done = self.clears_done.get(c.clear_id)
        if done is None:  # each clear once; a re-send gets the same answer
            if self.cache is not None:
                self.cache.clear()
            done = self.clears_done[c.clear_id] = CacheCleared(
                deployment_id=c.deployment_id, clear_id=c.clear_id, rank=0, step=self.step)
            self.next_telemetry = 0.0
        self.send_report(done)

    def on_cancel(self, c: Cancel) -> None:
        if c.epoch <= self.spec.cancel_epoch_floor:
            return  # a watermark: never replayed
        cancelled: list[str] = []
        if c.epoch > self.cancel_epoch:
            ids = list(self.active) if c.scope == "all" else [
                r for r in c.request_ids if r in self.active]
            for rid in ids:
                self.finish(rid, FinishReason.ABORT)
            cancelled = ids
            self.cancel_epoch = c.epoch
            self.next_telemetry = 0.0
        self.send_report(CancelAck(deployment_id=c.deployment_id, epoch=c.epoch,
                                   rank=self.rank, step_applied=self.step, cancelled=cancelled))

    # --- requests (rank 0) -----------------------------------------------------------

    def on_request(self) -> None:
        got = self.req_ch.unpack_router(self.requests.recv_multipart())
        if got is None:
            return
        ident, msg = got
        body = msg.body
        if isinstance(body, Generate):
            cached = self.cache.match(body.prompt) if self.cache is not None else 0
            self.active[body.request_id] = Request(ident, body, cached_tokens=cached)
        elif isinstance(body, Abort):
            if body.request_id in self.active:
                self.finish(body.request_id, FinishReason.ABORT)
        elif isinstance(body, StatsRequest):
            self.reply(ident, Stats(request_id=body.request_id, phase=self.phase.value,
                                    step=self.step, active=len(self.active),
                                    active_ids=list(self.active), cancel_epoch=self.cancel_epoch))

    def reply(self, ident: bytes, body: object) -> None:
        self.requests.send_multipart([ident, self.req_ch.pack(body)], flags=zmq.NOBLOCK)

    def finish(self, rid: str, reason: FinishReason) -> None:
        req = self.active.pop(rid)
        self.reply(req.ident, Tokens(request_id=rid, tokens=[], index=req.produced,
                                     finish_reason=reason, step=self.step))

    def decode_step(self) -> None:
        self.step += 1
        for rid, req in list(self.active.items()):
            prompt = req.body.prompt or [0]
            tok = prompt[req.produced % len(prompt)]
            req.produced += 1
            done = req.produced >= req.body.max_tokens
            req.fed = [*(req.fed or prompt), tok]
            self.reply(req.ident, Tokens(
                request_id=rid, tokens=[tok], index=req.produced - 1,
                finish_reason=FinishReason.LENGTH if done else None, prompt_tokens=len(prompt),
                step=self.step, token_times=[time.time()],
                cached_tokens=req.cached_tokens if req.produced == 1 else 0))
            if done:
                del self.active[rid]
                if self.cache is not None:
                    self.cache.store(req.fed)

    # --- main loop -------------------------------------------------------------------

    def watchdog(self) -> None:
        if self.ppid is not None and os.getppid() != self.ppid:
            self.leave(Phase.LAUNCHER_LOST, "launcher (parent) gone", 4)
        stale = self.spec.settings.lease_ttl
        if self.last_lease and time.monotonic() - self.last_lease > stale:
            self.leave(Phase.LAUNCHER_LOST, f"supervisor lease stale for {stale:.0f}s", 4)

    def leave(self, phase: Phase, error: str | None, code: int) -> None:
        self.marker(phase, error)
        late = exit_late_s(self.rank)
        if late:
            time.sleep(late)
        os._exit(code)

    def pump(self, timeout_s: float) -> None:
        self.link.timers(time.monotonic())
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.report, zmq.POLLIN)
        if self.requests is not None:
            poller.register(self.requests, zmq.POLLIN)
        events = dict(poller.poll(max(1, int(timeout_s * 1000))))
        if self.report in events:
            self.on_report()
        if self.control in events:
            self.on_control()
        if self.requests is not None and self.requests in events:
            self.on_request()
        if self.stop_flag:
            self.leave(Phase.EXITING, None, 0)
        self.watchdog()
        now = time.monotonic()
        if now >= self.next_telemetry:
            self.telemetry()
            self.next_telemetry = now + self.spec.settings.rank_telemetry_interval_s

    def run(self) -> None:
        self.marker(Phase.STARTING)
        while not self.last_lease:  # slow-joiner proof: one lease seen before loading
            self.pump(0.05)
        self.marker(Phase.LOADING)
        if switched("LOCKSTEP_FAKE_CRASH_ON_LOAD", self.rank):
            self.error = "fake crash during load (LOCKSTEP_FAKE_CRASH_ON_LOAD)"
            self.marker(Phase.FAILED, self.error)
            print(self.error, file=sys.stderr, flush=True)
            os._exit(3)
        while switched("LOCKSTEP_FAKE_NEVER_READY", self.rank):
            self.pump(0.05)
        if self.rank == 0:
            self.requests = configure(self.ctx.socket(zmq.ROUTER))
            self.requests.bind(self.spec.requests_endpoint)
        self.marker(Phase.READY)
        self.send_report(RankReady(
            deployment_id=self.spec.deployment_id, job_id=self.spec.job_id, rank=self.rank,
            host=self.spec.host, pid=self.pid, start_time=self.start_time,
            boot_id=self.report_ch.signer.boot,
            endpoints={"requests": self.spec.requests_endpoint} if self.rank == 0 else {}))
        while True:
            now = time.monotonic()
            if self.active and now >= self.next_step:
                self.decode_step()
                self.next_step = now + self.step_s
            self.pump(self.step_s if self.active else 0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fake_rank")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    FakeRank(RankSpec.load(args.spec)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
