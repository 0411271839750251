"""The watchdog thread: runs services.rank.watchdogs against one rank, and ends it.

    every tick (≤ 0.5 s; the probe interval on rank 0 once loaded):
      launcher  parent gone (past the adopt window, if any) / lease stale
                → marker launcher_lost → abort stage → exit
      progress  active requests, no step for the stall timeout → marker failed → exit
      peers     rank 0: close the probe round, send the next (PING through the I/O
                thread); followers: judge rank 0's silence

Ending a rank (`Watchdogs.end`): the marker first; then, unless the verdict is a stall,
the abort stage (every open stream ends now with `abort`, from the I/O thread; the
requests leave the batch through a plan if the main thread reaches a step boundary);
then, when it can answer, the main thread is asked to leave cleanly (`ExitEv`: a final
shutdown plan, so every rank leaves at one step) and given `leave_wait_s` — launcher
lost: unless it is in distributed init, the load or the warm-up; peer lost: only if it is not inside
anything (a step with a lost peer never ends); stalled: never; last, the hard exit from
this thread (`RankRuntime.hard_exit`: streams ended, I/O flushed, memory released when
safe, `os._exit`), the only way out of a main thread stuck inside a collective in C.

Everything the thread touches goes through `RankHooks`; `clock`, `sleep` and the hooks
are injected, so tests drive it without real seconds or real processes.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from common.messages import Phase, Ping, RemoveReason
from services.rank.events import ExitEv
from services.rank.outbox import Probe
from services.rank.process_exit import EXIT_FAILED
from services.rank.watchdogs import (
    Inside,
    LauncherWatchdog,
    LeaderWatchdog,
    PeerWatchdog,
    ProgressWatchdog,
    Seen,
    Verdict,
    WatchdogSettings,
    Where,
)

log = logging.getLogger("lockstep.rank.watchdog")
MAX_TICK_S = 0.5
LEAVE_WAIT_S = 5.0  # a free main thread gets this long to leave cleanly
SUSPENDED_AFTER_S = 2.0  # a tick this late means this process itself did not run


class Leave(enum.Enum):
    """When `Watchdogs.end` asks the main thread to leave cleanly (see there)."""

    ALWAYS = "always"
    IF_FREE = "if free"
    NEVER = "never"


class RankHooks(Protocol):
    leader: bool
    world_size: int

    def fast(self) -> bool: ...  # loaded: probe at the serving interval
    def parent_gone(self) -> str | None: ...
    def last_lease_at(self) -> float | None: ...
    def activity(self) -> tuple[int, int]: ...  # (active requests, step)
    def where(self) -> Where | None: ...  # what the main thread is inside, if anything
    def peers(self) -> list[int]: ...  # rank 0: joined followers
    def answered(self) -> Mapping[int, int]: ...  # rank 0: rank → highest nonce echoed
    def send_probe(self, nonce: int) -> None: ...
    def last_ping_at(self) -> float | None: ...  # followers
    def mark(self, phase: Phase, reason: str) -> None: ...
    def abort_all(self, reason: str) -> None: ...
    def peers_ok(self, ok: bool) -> None: ...  # rank 0: every peer answers (STATS says so)
    def request_exit(self, code: int, phase: Phase, reason: str) -> None: ...
    def hard_exit(self, code: int, phase: Phase, reason: str) -> None: ...


class Watchdogs:
    def __init__(self, hooks: RankHooks, settings: WatchdogSettings, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 leave_wait_s: float = LEAVE_WAIT_S,
                 launcher: LauncherWatchdog | None = None) -> None:
        self.hooks, self.s, self.clock, self.sleep = hooks, settings, clock, sleep
        self.leave_wait_s = leave_wait_s
        # The rank's one launcher watchdog (RankRuntime.launcher: its main thread asks it
        # why the rank is leaving, from the adoption state this thread moves on).
        self.launcher = launcher or LauncherWatchdog(settings.lease_ttl, settings.adopt_window_s)
        self.progress = ProgressWatchdog(settings.progress_stall_timeout)
        self.peer = PeerWatchdog(settings.peer_fail_tolerance, settings.peer_abort_grace) \
            if hooks.leader and hooks.world_size > 1 else None
        self.rank0 = LeaderWatchdog(settings.peer_fail_tolerance, settings.peer_abort_grace) \
            if not hooks.leader else None
        self.last_tick: float | None = None
        self.last_interval: float | None = None  # the probe rate expected at the last tick
        self.ended: tuple[int, Phase, str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="rank-watchdog", daemon=True)
        self._thread.start()

    def run(self) -> None:
        while self.ended is None:
            self.sleep(self.tick())

    def interval(self) -> float:
        s = self.s
        return s.peer_probe_interval_s if self.hooks.fast() else s.peer_probe_interval_loading_s

    def tick(self) -> float:
        """One pass over every watchdog; returns the seconds until the next."""
        h, now = self.hooks, self.clock()
        if self.last_tick is not None and now - self.last_tick > SUSPENDED_AFTER_S:
            self._rebase(now, now - self.last_tick)
        self.last_tick = now
        interval = self.interval()
        if self.rank0 is not None and self.last_interval is not None \
                and interval < self.last_interval:
            # A follower starts serving: rank 0's probes are expected at the fast rate
            # from now on. The silence before (rank 0 warming up, probing at the loading
            # rate) is not measured against the fast limit.
            self.rank0.rebase(now)
        self.last_interval = interval
        v = self.launcher.check(now, h.parent_gone(), h.last_lease_at())
        if v is not None and v.what is Seen.ORPHANED:
            log.warning("launcher watchdog: %s", v.reason)
        elif v is not None and v.what is Seen.ADOPTED:
            log.warning("launcher watchdog: adopted: %s", v.reason)
        elif v is not None:
            return self.end(EXIT_FAILED, Phase.LAUNCHER_LOST, v.reason, abort=True,
                            leave=Leave.ALWAYS)
        v = self.progress.check(now, *h.activity())
        if v is not None:
            return self.end(EXIT_FAILED, Phase.FAILED, v.reason, abort=False,
                            leave=Leave.NEVER)
        if self.peer is not None:
            if self.peer.due(now, interval):
                nonce, verdicts = self.peer.round(now, h.peers(), h.answered())
                self._peer_verdicts(verdicts)
                if self.ended is None:
                    h.send_probe(nonce)
        elif self.rank0 is not None:
            self._peer_verdicts(self.rank0.check(now, h.last_ping_at(), interval))
        if self.peer is not None:
            return min(MAX_TICK_S, self.peer.wait(self.clock(), interval))
        return min(MAX_TICK_S, interval / 2)

    def _peer_verdicts(self, verdicts: list[Verdict]) -> None:
        for v in verdicts:
            if self.ended is not None:
                return
            if v.what is Seen.ABORT:
                log.error("peer watchdog: %s; abort stage: every in-flight request is "
                          "cancelled, re-probing for %gs", v.reason, self.s.peer_abort_grace)
                self.hooks.peers_ok(False)  # first: no STATS may say ok after the abort
                self.hooks.abort_all(f"peer lost: {v.reason}")
            elif v.what is Seen.SUSPECT:
                log.error("peer watchdog: %s; waiting up to %gs more", v.reason,
                          self.s.peer_abort_grace)
            elif v.what is Seen.RECOVERED:
                log.warning("peer watchdog: %s; serving on", v.reason)
                self.hooks.peers_ok(True)  # a request it aborted may resume here
            elif v.what is Seen.LOST:
                self.end(EXIT_FAILED, Phase.PEER_LOST, v.reason, abort=True,
                         leave=Leave.IF_FREE)

    def _rebase(self, now: float, gap: float) -> None:
        log.warning("watchdog thread did not run for %.1fs (was this process stopped?); "
                    "its clocks restart now", gap)
        self.launcher.rebase(now)
        self.progress.rebase(now)
        if self.peer is not None:
            self.peer.rebase(gap)
        if self.rank0 is not None:
            self.rank0.rebase(now)

    def end(self, code: int, phase: Phase, reason: str, *, abort: bool,
            leave: Leave) -> float:
        """Marker → abort stage (`abort`) → the main thread asked to leave cleanly
        (`leave`: ALWAYS — unless in distributed init, the load or the warm-up: its steps still
        complete, e.g. the launcher is gone but every peer lives; IF_FREE — only when
        not inside anything, a step with a lost peer never ends; NEVER — it stalled) and
        given `leave_wait_s` → hard exit."""
        h = self.hooks
        self.ended = (code, phase, reason)
        log.error("watchdog: %s: %s", phase.value, reason)
        h.mark(phase, reason)
        if abort:
            h.abort_all(f"{phase.value}: {reason}")
        where = h.where()
        if may_ask(leave, where) and self.leave_wait_s > 0:
            h.request_exit(code, phase, reason)
            deadline = self.clock() + self.leave_wait_s
            while self.clock() < deadline:
                self.sleep(0.05)
            log.error("watchdog: the main thread did not leave within %gs", self.leave_wait_s)
        else:
            log.error("watchdog: leaving from this thread (main thread: %s)",
                      "stalled" if leave is Leave.NEVER else where)
        h.hard_exit(code, phase, reason)
        return 0.0


def may_ask(leave: Leave, where: Where | None) -> bool:
    """Whether the main thread can answer a request to leave: not if it stalled; yes if
    it is inside nothing; inside a step only for `ALWAYS` (the step still completes)."""
    if leave is Leave.NEVER:
        return False
    if where is None:
        return True
    return leave is Leave.ALWAYS and where.inside is Inside.STEP


def parent_gone(parent_pid: int | None) -> str | None:
    """Why the launcher is gone (we were re-parented), or None. A rank started with no
    real parent (pid 1: already orphaned, or a daemon) has nothing to watch."""
    if parent_pid is None or parent_pid <= 1:
        return None
    now = os.getppid()
    if now != parent_pid:
        return f"the launcher (parent pid {parent_pid}) is gone; re-parented to pid {now}"
    return None


class RankSide:
    """`RankHooks` of a real rank: its RankRuntime and RankIO (duck-typed, so this
    module imports neither MLX nor ZeroMQ)."""

    def __init__(self, rt, io) -> None:
        self.rt, self.io = rt, io
        self.leader = rt.leader
        self.world_size = rt.spec.world_size

    def fast(self) -> bool:
        # Rank 0 probes fast once it is loaded; a follower expects fast probes only once
        # it serves (SERVE needs rank 0's RANK_READY, so rank 0 is loaded by then).
        loaded = (Phase.READY, Phase.SERVING, Phase.DRAINING) if self.leader \
            else (Phase.SERVING, Phase.DRAINING)
        return self.rt.phase in loaded

    def parent_gone(self) -> str | None:
        return parent_gone(self.rt.parent_pid)

    def last_lease_at(self) -> float | None:
        return self.rt.last_lease_at

    def activity(self) -> tuple[int, int]:
        return self.rt.active, self.rt.step

    def where(self) -> Where | None:
        return self.rt.inside

    def peers(self) -> list[int]:
        return list(self.io.session.followers)

    def answered(self) -> Mapping[int, int]:
        return {r: p.nonce for r, p in list(self.io.session.last_pong.items())}

    def send_probe(self, nonce: int) -> None:
        self.io.post(Probe(Ping(nonce=nonce, sent_at=time.time())))

    def last_ping_at(self) -> float | None:
        return self.rt.last_ping_at

    def mark(self, phase: Phase, reason: str) -> None:
        self.rt.mark_verdict(phase, reason)

    def abort_all(self, reason: str) -> None:
        self.rt.request_abort_all(RemoveReason.WATCHDOG, reason)

    def peers_ok(self, ok: bool) -> None:
        self.rt.peers_ok = ok

    def request_exit(self, code: int, phase: Phase, reason: str) -> None:
        self.io.inbox.put(ExitEv(code, phase, reason))

    def hard_exit(self, code: int, phase: Phase, reason: str) -> None:
        self.rt.hard_exit(code, phase, reason)
