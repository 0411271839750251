"""Where a rank's threads spend their time: cumulative wall seconds and runs per phase.

    clock = PhaseClock()            # one per rank (RankRuntime.phases)
    tally = clock.tally()           # one per thread; only that thread writes it
    t0 = tally.now()
    ...                             # the phase's work
    tally.add(LoopPhase.PLAN, t0)   # returns now: the next phase may start from it

Two `perf_counter` calls per phase run and no lock on that path: each tally has one
writer, a float and an int added in place under the GIL; `snapshot` (the I/O thread,
once per telemetry) sums every tally, so a reader may miss the run in progress, never
count one twice. The times are wall time: a thread waiting for the GIL is charged to
the phase it is in.
"""

from __future__ import annotations

import enum
import threading
import time

from common.messages import PhaseTimes


class LoopPhase(str, enum.Enum):
    DRAIN = "drain"  # rank 0 main thread: one inbox event handled (never the wait)
    PLAN = "plan"  # build and apply a plan (rank 0), or apply one (followers)
    STEP = "step"  # engine.next(): the model, in MLX
    EMIT = "emit"  # rank 0: the step's tokens (and logprobs) into stream chunks
    SIGN_SEND_PLAN = "sign_send_plan"  # rank 0 I/O thread: a plan signed, sent to followers
    SIGN_SEND_TOKENS = "sign_send_tokens"  # rank 0 I/O thread: token chunks to requesters


_PHASES = tuple(LoopPhase)
_INDEX = {p: i for i, p in enumerate(_PHASES)}


class PhaseTally:
    """One thread's totals. Only its own thread calls `add`."""

    __slots__ = ("counts", "seconds")

    def __init__(self) -> None:
        self.seconds = [0.0] * len(_PHASES)
        self.counts = [0] * len(_PHASES)

    now = staticmethod(time.perf_counter)

    def add(self, phase: LoopPhase, t0: float) -> float:
        """One run of `phase` that began at `t0` (from `now`) ended now; returns now."""
        t = time.perf_counter()
        i = _INDEX[phase]
        self.seconds[i] += t - t0
        self.counts[i] += 1
        return t


class PhaseClock:
    def __init__(self) -> None:
        self._tallies: list[PhaseTally] = []
        self._lock = threading.Lock()  # taken to add a tally and to read, never to count

    def tally(self) -> PhaseTally:
        t = PhaseTally()
        with self._lock:
            self._tallies.append(t)
        return t

    def snapshot(self) -> PhaseTimes:
        """The totals over every thread, for the phases that ran at least once."""
        seconds = [0.0] * len(_PHASES)
        counts = [0] * len(_PHASES)
        with self._lock:
            tallies = list(self._tallies)
        for t in tallies:
            for i in range(len(_PHASES)):
                seconds[i] += t.seconds[i]
                counts[i] += t.counts[i]
        ran = [i for i in range(len(_PHASES)) if counts[i]]
        return PhaseTimes(seconds={_PHASES[i].value: seconds[i] for i in ran},
                          counts={_PHASES[i].value: counts[i] for i in ran})
