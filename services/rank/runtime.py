"""One rank's identity, phase, counters, marker file and exit path.

`RankRuntime` is shared by the main thread (which changes phase, step and active ids)
and the I/O thread (which reads them for telemetry, PONG and STATS). Plain attribute
writes are atomic under the GIL; the marker file is written under a lock from one
consistent snapshot, so a heartbeat can never overwrite a newer phase.

Hook points for the watchdogs of issue 4: `last_lease_at` / `last_progress_at`,
`request_abort_all(reason)` (an abort stage folded into the next plan), `exit(code,
phase, error)`, and `arm_escape_hatch()` (what a signal or SHUTDOWN arms).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import mlx.core as mx

from common.envelope import BOOT_ID
from common.messages import Telemetry
from common.rankspec import RankSpec
from common.state import Paths, Phase, RankMarker, marker_path, write_marker

log = logging.getLogger("lockstep.rank")
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SIGNAL_HATCH = 3


def _start_time(pid: int) -> float:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - identity is best effort here; the manifest has it
        return time.time()


class TestSeams:
    """Fault switches, honoured only when `settings.test_seams` is true."""

    __test__ = False  # not a pytest class

    def __init__(self, enabled: bool, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        get = env.get if enabled else (lambda _k, d=None: d)
        drop = get("LOCKSTEP_TEST_DROP_PLAN_SEQ")
        self.drop_plan_seq: int | None = int(drop) if drop else None
        self.step_delay_s = float(get("LOCKSTEP_TEST_STEP_DELAY_S") or 0.0)


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
        self.seams = TestSeams(spec.settings.test_seams)
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.step = 0
        self.active_ids: tuple[str, ...] = ()
        self.pending = 0  # leader: accepted but not yet in a plan
        self.cancel_floor = spec.cancel_epoch_floor  # start-up watermark: never applied
        self.cancel_epoch = spec.cancel_epoch_floor  # last consumed (or the watermark)
        self.parent_pid: int | None = os.getppid()
        self.last_lease_at: float | None = None
        self.last_progress_at = time.monotonic()
        self.signal_received: int | None = None
        self.reject_sources: list[Callable[[], dict[str, int]]] = []
        self.post_event: Callable[[object], None] | None = None  # set by RankIO
        self._marker_lock = threading.Lock()
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

    def progressed(self, step: int) -> None:
        self.step = step
        self.last_progress_at = time.monotonic()

    def memory(self) -> tuple[int, int]:
        try:
            return int(mx.get_active_memory()), int(mx.get_peak_memory())
        except Exception:  # noqa: BLE001
            return 0, 0

    def rejects(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for source in self.reject_sources:
            for k, n in source().items():
                out[k] = out.get(k, 0) + n
        return out

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
                       "boot_id": self.boot_id, "rejects": self.rejects()},
            )
            try:
                write_marker(self.paths, m)
            except OSError as exc:
                log.error("cannot write marker %s: %s", self.marker_file(), exc)

    def telemetry(self) -> Telemetry:
        mem_active, mem_peak = self.memory()
        return Telemetry(
            deployment_id=self.spec.deployment_id, job_id=self.spec.job_id, rank=self.rank,
            pid=self.pid, phase=self.phase.value, step=self.step, active=self.active,
            cancel_epoch=self.cancel_epoch, mem_active=mem_active, mem_peak=mem_peak,
            at=self.clock(), error=self.error, rejects=self.rejects(),
        )

    # -- hooks for watchdogs (issue 4) ---------------------------------------------------

    def request_abort_all(self, reason: str) -> None:
        """Thread-safe: every active request is removed at the next step boundary."""
        from services.rank.events import AbortAllEv

        if self.post_event is not None:
            self.post_event(AbortAllEv(reason))

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
        if wakeup_fd is not None:
            signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False)

    def arm_escape_hatch(self, why: str) -> None:
        """If the main thread cannot reach a clean exit in time (blocked in a collective
        or in distributed init), leave anyway: marker, then _exit."""
        if self._hatch is not None:
            return
        timeout = self.spec.settings.signal_clear_timeout_s

        def fire() -> None:
            log.error("rank %d: no clean exit %.0fs after %s; leaving", self.rank, timeout, why)
            self.error = self.error or f"escape hatch after {why}"
            self.phase = Phase.EXITING
            self.write_marker()
            _flush_logs()
            os._exit(EXIT_SIGNAL_HATCH)

        self._hatch = threading.Timer(timeout, fire)
        self._hatch.daemon = True
        self._hatch.start()

    def exit(self, code: int, phase: Phase, error: str | None = None,
             stop_io: Callable[[], None] | None = None) -> NoReturn:
        """The one way out: marker, exit hooks (streams end), I/O flushed, memory freed."""
        if phase != self.phase or error:
            self.set_phase(phase, error)
        reason = error or phase.value
        for hook in self._exit_hooks:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - an exit hook must not block the exit
                log.exception("exit hook failed")
        if stop_io is not None:
            try:
                stop_io()
            except Exception:  # noqa: BLE001
                log.exception("stopping the I/O thread failed")
        release_memory()
        self.write_marker()
        log.info("rank %d exits %d (%s)", self.rank, code, phase.value)
        _flush_logs()
        os._exit(code)


def release_memory() -> None:
    try:
        if hasattr(mx, "set_wired_limit"):
            mx.set_wired_limit(0)
        mx.clear_cache()
    except Exception:  # noqa: BLE001
        pass


def _flush_logs() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
