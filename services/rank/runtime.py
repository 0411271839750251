"""One rank's identity, phase, counters, marker file and exit path.

`RankRuntime` is shared by the main thread (which changes phase, step and active ids)
and the I/O thread (which reads them for telemetry, PONG and STATS). Plain attribute
writes are atomic under the GIL; the marker file is written under a lock from one
consistent snapshot, so a heartbeat can never overwrite a newer phase.

What the watchdogs (services.rank.watchdog_thread) read and call: `last_lease_at`,
`last_ping_at` (followers), `step` / `active`, `inside` (a typed `Where`: what the main
thread is inside — a step, distributed init, the load), `request_abort_all(reason, detail)` (the abort
stage: every stream ends now, the requests leave at the next step boundary), and
`hard_exit` — the way out from any thread when the main thread is stuck in C. Signals:
the handler records; the I/O thread calls `on_signal` (first: escape hatch armed and a
clean shutdown scheduled; second: `hard_exit` at once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

import mlx.core as mx

from common.envelope import BOOT_ID
from common.home import Paths, marker_path, write_marker
from common.messages import (
    CacheStats,
    DiskIndex,
    KvStats,
    Phase,
    RemoveReason,
    SpecStats,
    Telemetry,
)
from common.rankspec import RankSpec
from common.records import RankMarker
from services.rank import load_progress
from services.rank.outbox import AbortAll, Command
from services.rank.phase_clock import PhaseClock
from services.rank.process_exit import (
    EXIT_FAILED,
    EXIT_SIGNAL_HATCH,
    cache_memory,
    flush_logs,
    kernel_alarm,
    release_memory,
)
from services.rank.seams import TestSeams
from services.rank.watchdog_thread import parent_gone
from services.rank.watchdogs import LauncherWatchdog, WatchdogSettings, Where

log = logging.getLogger("lockstep.rank")
HARD_EXIT_WAIT_S = 5.0  # a hard exit lets a clean exit already under way finish first
HARD_EXIT_IO_S = 1.0  # what a hard exit gives the I/O thread to flush the last messages
# The last resort, in the kernel: if a Python-level way out cannot run (a thread stuck
# holding the GIL), SIGALRM's default action ends the process this long after the hatch
# or the hard exit should have.
KERNEL_ALARM_MARGIN_S = 5
CLEAN_EXIT_ALARM_S = 20


class IoPort(Protocol):
    """What the runtime needs of the I/O thread (services.rank.io.RankIO)."""

    def post(self, *cmds: Command) -> None: ...
    def stop(self, timeout: float = ..., why: str = ...) -> None: ...
    def reject_counts(self) -> dict[str, int]: ...


def _start_time(pid: int) -> float:
    try:
        import psutil

        from common.procs import start_time_of

        return start_time_of(psutil.Process(pid))
    except Exception:  # noqa: BLE001 - identity is best effort here; the manifest has it
        return time.time()


class RankRuntime:
    def __init__(self, spec: RankSpec, *, clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.paths = Paths(Path(spec.home))
        self.rank = spec.rank
        self.leader = spec.rank == 0
        self.pid = os.getpid()
        self.start_time = _start_time(self.pid)
        self.boot_id = BOOT_ID
        self.clock = clock
        self.seams = TestSeams(spec.settings.rank_test_seams)
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.step = 0
        self.active_ids: tuple[str, ...] = ()
        # rank 0: False from a peer watchdog's abort stage until the peer answers again
        # (STATS carries it: the gateway resumes what the abort ended only once it is True)
        self.peers_ok = True
        self.pending = 0  # leader: accepted but not yet in a plan
        self.cache: CacheStats | None = None  # the prompt-cache store, after the last plan
        self.kv = KvStats()  # KV held for running requests (loop.py), the budget (leader.py)
        self.spec_stats: SpecStats | None = None  # rank 0 speculating: its counts (leader.py)
        # follower: its disk tier's report for rank 0 (services/rank/disk_report.py),
        # re-sent by the I/O thread until a PING acknowledges its seq; rank 0: the acks
        self.disk_report: DiskIndex | None = None
        self.disk_tier = None  # services.rank.disk_tier.DiskTier, once open
        self.disk_acks: list[int] = []
        self.phases = PhaseClock()  # time per loop phase, one tally per thread (telemetry)
        self.cancel_floor = spec.cancel_epoch_floor  # start-up watermark: never applied
        self.cancel_epoch = spec.cancel_epoch_floor  # last consumed (or the watermark)
        self.parent_pid: int | None = os.getppid() if spec.watch_parent else None
        self.last_lease_at: float | None = None
        self.last_ping_at: float | None = None  # follower: rank 0's last probe
        self.last_progress_at = time.monotonic()
        self.inside: Where | None = None  # what the main thread is inside (for watchdogs)
        self.timeouts = WatchdogSettings.resolve(spec.settings)  # boot adds the env
        # The one launcher watchdog: the watchdog thread moves it on (adoption, t0), the
        # main thread asks it why the rank is leaving (`launcher_gone`).
        self.launcher = LauncherWatchdog(self.timeouts.lease_ttl, self.timeouts.adopt_window_s)
        self.signal_received: int | None = None
        self.signals = 0  # counted by the I/O thread (on_signal)
        self.memory_released = False
        self.memory_note: str | None = None
        self.verdict: tuple[Phase, str] | None = None  # mark_verdict
        self.io: IoPort | None = None  # attach_io: the I/O thread, once it exists
        self._marker_lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._hatch: threading.Timer | None = None
        self._exit_hooks: list[Callable[[str], None]] = []

    # -- state ------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self.active_ids) + self.pending

    def set_phase(self, phase: Phase, error: str | None = None) -> None:
        self.phase = phase
        if error is not None:
            self.error = error[:2000]
        log.info("rank %d phase %s%s", self.rank, phase.value, f" ({error})" if error else "")
        self.write_marker()

    def mark_verdict(self, phase: Phase, reason: str) -> None:
        """A watchdog's verdict (peer_lost, launcher_lost, failed): the first one is
        what this rank exits with, whatever breaks after it (a collective failing once
        the other ranks left for the same cause)."""
        if self.verdict is None:
            self.verdict = (phase, reason)
        self.set_phase(*self.verdict)

    def launcher_gone(self) -> str | None:
        """Why the launcher is gone (parent gone, lease stale), or None."""
        v = self.launcher.judge(time.monotonic(), parent_gone(self.parent_pid),
                                self.last_lease_at)
        return None if v is None else v.reason

    def progressed(self, step: int) -> None:
        self.step = step
        self.last_progress_at = time.monotonic()

    def memory(self) -> tuple[int, int]:
        try:
            return int(mx.get_active_memory()), int(mx.get_peak_memory())
        except Exception:  # noqa: BLE001
            return 0, 0

    def attach_io(self, io: IoPort) -> None:
        """The I/O thread this runtime posts to (the abort stage), stops (a hard exit)
        and whose reject counts it reports. Boot wires it once, right after building it."""
        self.io = io

    def rejects(self) -> dict[str, int]:
        return {} if self.io is None else self.io.reject_counts()

    def marker_file(self) -> Path:
        return marker_path(self.paths, self.spec.deployment_id, self.rank)

    def write_marker(self) -> None:
        with self._marker_lock:
            mem_active, mem_peak = self.memory()
            m = RankMarker(
                deployment_id=self.spec.deployment_id, job_id=self.spec.job_id,
                rank=self.rank, host=self.spec.host, pid=self.pid,
                start_time=self.start_time, phase=self.phase, updated_at=self.clock(),
                step=self.step, active=self.active, cancel_epoch=self.cancel_epoch,
                error=self.error,
                extra={"mem_active": mem_active, "mem_peak": mem_peak,
                       "mem_cache": cache_memory(), "memory_released": self.memory_released,
                       "memory_note": self.memory_note,
                       "boot_id": self.boot_id, "rejects": self.rejects()},
            )
            try:
                write_marker(self.paths, m)
            except OSError as exc:
                log.error("cannot write marker %s: %s", self.marker_file(), exc)

    def cache_now(self) -> CacheStats | None:
        """The store's stats after the last plan, with the disk tier's counters as of now
        (its writer lands entries between plans)."""
        c, tier = self.cache, self.disk_tier
        if c is None or tier is None:
            return c
        d = tier.stats()
        return dataclasses.replace(c, disk_entries=d.entries, disk_bytes=d.bytes,
                                   disk_written=d.written, disk_write_errors=d.write_errors,
                                   disk_rejected=d.rejected, disk_loaded=d.loaded)

    def telemetry(self) -> Telemetry:
        mem_active, mem_peak = self.memory()
        return Telemetry(
            deployment_id=self.spec.deployment_id, job_id=self.spec.job_id, rank=self.rank,
            pid=self.pid, phase=self.phase, step=self.step, active=self.active,
            cancel_epoch=self.cancel_epoch, mem_active=mem_active, mem_peak=mem_peak,
            at=self.clock(), error=self.error, rejects=self.rejects(), cache=self.cache_now(),
            load=load_progress.sample(self.phase, self.spec.model_path),
            phases=self.phases.snapshot(), kv=self.kv, spec=self.spec_stats,
        )

    # -- hooks for the watchdogs (services.rank.watchdog_thread) -------------------------------------

    def request_abort_all(self, reason: RemoveReason, detail: str | None = None) -> None:
        """Any thread: every stream rank 0 has open ends now with `abort` (`detail` as
        its error text), and every request leaves the batch at the next step boundary
        with removal reason `reason`."""
        if self.io is not None:  # before it exists no stream is open
            self.io.post(AbortAll(reason, detail))

    def on_exit(self, hook: Callable[[str], None]) -> None:
        self._exit_hooks.append(hook)

    # -- signals and exit -----------------------------------------------------------------

    def install_signal_handlers(self, wakeup_fd: int | None) -> None:
        """Handlers only record the signal; the I/O thread is woken through the fd and
        turns it into a SignalEv for the main loop (the same path as a SHUTDOWN)."""

        def handler(signum: int, _frame: object) -> None:
            self.signal_received = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # kernel_alarm: the process ends
        if wakeup_fd is not None:
            signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False)

    def on_signal(self, signum: int) -> bool:
        """I/O thread, once per SIGTERM/SIGINT: the first arms the escape hatch and
        returns True (the caller schedules a clean shutdown); a second leaves at once."""
        self.signals += 1
        if self.signals == 1:
            self.arm_escape_hatch(f"signal {signum}")
            return True
        log.error("rank %d: second signal (%d); leaving now", self.rank, signum)
        # At once: not even a clean exit already under way is waited for.
        self.hard_exit(EXIT_SIGNAL_HATCH, Phase.EXITING, f"second signal ({signum})",
                       wait_s=0.0)
        return False

    def arm_escape_hatch(self, why: str) -> None:
        """If the main thread cannot reach a clean exit in time (blocked in a collective
        or in distributed init), leave anyway after `signal_clear_timeout`
        (LOCKSTEP_SIGNAL_CLEAR_TIMEOUT): `hard_exit` with code 3."""
        if self._hatch is not None:
            return
        timeout = self.timeouts.signal_clear_timeout

        def fire() -> None:
            log.error("rank %d: no clean exit %gs after %s; leaving", self.rank, timeout, why)
            self.hard_exit(EXIT_SIGNAL_HATCH, Phase.EXITING,
                           self.error or f"escape hatch {timeout:g}s after {why}")

        self._hatch = threading.Timer(timeout, fire)
        self._hatch.daemon = True
        self._hatch.start()
        kernel_alarm(timeout + KERNEL_ALARM_MARGIN_S)

    def hard_exit(self, code: int, phase: Phase, error: str | None, *,
                  wait_s: float = HARD_EXIT_WAIT_S) -> NoReturn:
        """Any thread, even with the main thread stuck inside a collective: marker (a
        watchdog's verdict wins), every open stream ended, I/O flushed (bounded), memory
        released unless the main thread is inside MLX, _exit. A clean exit already
        under way gets `wait_s` to finish first."""
        kernel_alarm(wait_s + 2 * HARD_EXIT_IO_S + KERNEL_ALARM_MARGIN_S)
        self._exit_lock.acquire(timeout=wait_s)  # never released: we leave
        if self.verdict is not None:
            (phase, error), code = self.verdict, code or EXIT_FAILED
        self.set_phase(phase, error)
        if self.io is not None:
            try:
                self.io.stop(timeout=HARD_EXIT_IO_S, why=error or phase.value)
            except Exception:  # noqa: BLE001 - nothing may stop this exit
                log.exception("stopping the I/O thread failed")
        self._leave(code)

    def exit(self, code: int, phase: Phase, error: str | None = None) -> NoReturn:
        """The clean way out (main thread): marker, exit hooks (streams end), I/O
        flushed and stopped (if attached), memory freed. If a hard exit is under way,
        wait for it instead."""
        kernel_alarm(CLEAN_EXIT_ALARM_S)  # whatever hangs in here, the process ends
        self._exit_lock.acquire()  # never released: we leave
        if self.verdict is not None:
            (phase, error), code = self.verdict, code or EXIT_FAILED
        if phase != self.phase or error:
            self.set_phase(phase, error)
        reason = error or phase.value
        for hook in self._exit_hooks:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - an exit hook must not block the exit
                log.exception("exit hook failed")
        if self.io is not None:
            try:
                self.io.stop()
            except Exception:  # noqa: BLE001
                log.exception("stopping the I/O thread failed")
        self._leave(code)

    def _leave(self, code: int) -> NoReturn:
        if self.inside is None:
            self.memory_released = release_memory()
        else:  # measured: clear_cache blocks, holding the GIL, while a step is stuck
            self.memory_note = f"left to the process exit (main thread inside {self.inside})"
            log.warning("rank %d: memory %s", self.rank, self.memory_note)
        self.write_marker()
        log.info("rank %d exits %d (%s)", self.rank, code, self.phase.value)
        flush_logs()
        os._exit(code)
