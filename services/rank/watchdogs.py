"""The rank's watchdogs (DESIGN 7): pure decisions, with every clock and exit injected.

    PeerWatchdog      rank 0: rounds of PING (one nonce per round, to every joined
                      follower); a follower that has not echoed a round's nonce by the
                      next round failed it. `fail_tolerance` failures in a row → abort
                      stage; every peer answering again → recovered; still failing
                      `peer_abort_grace` after the stage began → lost (grace 0: lost at
                      once).
    LeaderWatchdog    followers: rank 0 pings every interval; silence longer than
                      (tolerance + 1) intervals → suspect, that plus the grace → lost.
    LauncherWatchdog  every rank: the parent is gone (with `adopt_window_s`: and no
                      restarted supervisor adopted the rank within it), or the
                      supervisor's lease is older than `lease_ttl` (a lease never seen
                      is never stale).
    ProgressWatchdog  every rank: requests active but the step counter unchanged for
                      `progress_stall_timeout` (what catches a rank stuck in a collective).

`Watchdogs` (services/rank/watchdog_thread.py) runs them on a thread of their own. None of these
classes reads a clock: each call takes `now`, so unit tests need no real seconds. After
the process itself was stopped (SIGSTOP, a suspended VM), `rebase` restarts the clocks
instead of blaming the peers for the time this process did not run.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.config import ConfigError
from common.rankspec import RankSettings


class WatchdogConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WatchdogSettings:
    """The watchdogs' subset of RankSettings, under the same names."""

    peer_probe_interval_s: float = 0.5  # rank 0 → followers, once loaded
    peer_probe_interval_loading_s: float = 2.0  # while loading
    peer_fail_tolerance: int = 2  # consecutive failed rounds before the abort stage
    peer_abort_grace: float = 5.0  # re-probing after the abort stage; 0: no abort stage
    lease_ttl: float = 45.0  # 0: lease not watched
    adopt_window_s: float = 0.0  # parent gone: wait this long for an adoption; 0: lost
    progress_stall_timeout: float = 120.0  # 0: progress not watched
    signal_clear_timeout: float = 10.0  # the escape hatch after SIGTERM/SIGINT/SHUTDOWN

    @classmethod
    def resolve(cls, s: RankSettings, env: Mapping[str, str] | None = None) -> WatchdogSettings:
        """From the spec's settings, then the LOCKSTEP_* overrides in `env` (the one
        parser: RankSettings.with_env), every range checked."""
        try:
            s = s.with_env(env or {})
        except ConfigError as exc:
            raise WatchdogConfigError(str(exc)) from None
        return cls(**{f.name: getattr(s, f.name) for f in dataclasses.fields(cls)})


class Seen(str, enum.Enum):
    """What a watchdog saw (a closed set; the watchdog thread acts on each)."""

    ABORT = "abort"  # peers failing: the abort stage
    SUSPECT = "suspect"  # rank 0 silent: waiting out the grace
    RECOVERED = "recovered"  # every peer answers again: serving on
    LOST = "lost"  # a peer (or rank 0) silent past the grace
    LAUNCHER_LOST = "launcher_lost"
    ORPHANED = "orphaned"  # the parent is gone: waiting for a restarted supervisor
    ADOPTED = "adopted"  # a restarted supervisor's lease came in time: serving on
    STALLED = "stalled"


@dataclass(frozen=True)
class Verdict:
    what: Seen
    reason: str


class Inside(enum.Enum):
    """Where the main thread is, when it is inside something it may not come back from."""

    STEP = "step"  # engine.next(): a collective with every peer
    LAST_STEP = "the last step"  # draining the step in flight before a clean exit
    DISTRIBUTED_INIT = "distributed init"  # a peer that never starts blocks it forever
    LOAD = "the model load"
    WARM_UP = "the warm-up"  # a generation with every peer, before ready (warmup.py)


@dataclass(frozen=True)
class Where:
    """What the watchdogs ask of a rank's main thread: which `Inside`, and the step."""

    inside: Inside
    step: int | None = None

    def __str__(self) -> str:
        return f"step {self.step}" if self.inside is Inside.STEP else self.inside.value


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


class PeerWatchdog:
    OK, ABORTING, LOST = "ok", "aborting", "lost"

    def __init__(self, tolerance: int, grace_s: float) -> None:
        self.tolerance = tolerance
        self.grace_s = grace_s
        self.state = self.OK
        self.nonce = 0  # the round in flight (0: none yet)
        self.round_at: float | None = None
        self.pinged: frozenset[int] = frozenset()
        self.fails: dict[int, int] = {}
        self.abort_at: float | None = None

    def due(self, now: float, interval: float) -> bool:
        return self.state != self.LOST and self.wait(now, interval) <= 0.0

    def wait(self, now: float, interval: float) -> float:
        """Seconds until the next round (a sleep that wakes a hair early still counts)."""
        if self.round_at is None:
            return 0.0
        left = self.round_at + interval - now
        return 0.0 if left <= interval * 0.01 else left

    def round(self, now: float, peers: Iterable[int],
              answered: Mapping[int, int]) -> tuple[int, list[Verdict]]:
        """Close the round in flight (`answered`: rank → highest nonce it echoed) and
        open the next one; returns its nonce (to send to every peer) and the verdicts."""
        verdicts: list[Verdict] = []
        if self.round_at is not None:
            for r in self.pinged:
                self.fails[r] = 0 if answered.get(r, 0) >= self.nonce else self.fails.get(r, 0) + 1
            verdicts = self._judge(now)
        self.nonce += 1
        self.round_at = now
        self.pinged = frozenset(peers)
        return self.nonce, verdicts

    def _judge(self, now: float) -> list[Verdict]:
        failing = [r for r, n in self.fails.items() if n >= self.tolerance]
        if self.state == self.OK and failing:
            self.state, self.abort_at = self.ABORTING, now
            why = f"{_ranks(failing)} failed {self.tolerance} probes in a row"
            out = [Verdict(Seen.ABORT, why)]
            if self.grace_s <= 0:
                self.state = self.LOST
                out.append(Verdict(Seen.LOST, why + " (no abort grace)"))
            return out
        if self.state == self.ABORTING:
            if not any(self.fails.values()):
                self.state, self.abort_at = self.OK, None
                return [Verdict(Seen.RECOVERED, "every peer answers probes again")]
            if now - self.abort_at >= self.grace_s:
                self.state = self.LOST
                silent = [r for r, n in self.fails.items() if n]
                return [Verdict(Seen.LOST,
                                f"{_ranks(silent)} still silent {now - self.abort_at:.1f}s "
                                f"after the abort stage (grace {self.grace_s:g}s)")]
        return []

    def rebase(self, gap: float) -> None:
        self.round_at = None  # that round's silence was ours, not the peers'
        if self.abort_at is not None:
            self.abort_at += gap


class LeaderWatchdog:
    OK, SUSPECT, LOST = "ok", "suspect", "lost"

    def __init__(self, tolerance: int, grace_s: float) -> None:
        self.tolerance = tolerance
        self.grace_s = grace_s
        self.state = self.OK
        self.base = -math.inf  # silence is counted from here at the earliest

    def check(self, now: float, last_ping_at: float | None, interval: float) -> list[Verdict]:
        if last_ping_at is None or self.state == self.LOST:
            return []  # rank 0 never pinged yet: nothing to lose
        silent = now - max(last_ping_at, self.base)
        limit = (self.tolerance + 1) * interval
        if silent <= limit:
            if self.state == self.SUSPECT:
                self.state = self.OK
                return [Verdict(Seen.RECOVERED, "rank 0 pings again")]
            return []
        out = []
        if self.state == self.OK:
            self.state = self.SUSPECT
            out.append(Verdict(Seen.SUSPECT, f"no probe from rank 0 for {silent:.1f}s"))
        if silent > limit + self.grace_s:
            self.state = self.LOST
            out.append(Verdict(Seen.LOST, f"no probe from rank 0 for {silent:.1f}s "
                                          f"(limit {limit:g}s + grace {self.grace_s:g}s)"))
        return out

    def rebase(self, now: float) -> None:
        self.base = now


class LauncherWatchdog:
    """The parent (a local rank's supervisor) gone, or the lease stale.

    `adopt_window` 0: the parent gone is lost at once. Above 0 (supervisor adoption,
    docs/rank.md "Adoption"): from the first check that sees the parent gone (t0), a
    restarted supervisor has `adopt_window` seconds to adopt this rank, which it shows by
    a lease delivered after t0 (control from a new supervisor is delivered only after
    its re-authentication: services/rank/control_intake.py). Adopted: the parent is not
    watched any more (it is init now), only the lease, as on a remote rank. Not adopted
    by t0 + adopt_window: lost. `check` moves that state on and judges; `judge` only
    reads it (for another thread asking why the rank is leaving)."""

    def __init__(self, lease_ttl: float, adopt_window: float = 0.0) -> None:
        self.lease_ttl = lease_ttl
        self.adopt_window = adopt_window
        self.base = -math.inf
        self.orphaned_at: float | None = None  # t0: when the parent was first seen gone
        self.adopted = False

    def check(self, now: float, parent_gone: str | None,
              last_lease_at: float | None) -> Verdict | None:
        """`parent_gone`: why the launcher process is gone, or None while it lives. Besides
        LAUNCHER_LOST, returns ORPHANED (once: waiting for an adoption) and ADOPTED (once)."""
        if parent_gone and not self.adopted and self.adopt_window > 0:
            if self.orphaned_at is None:
                self.orphaned_at = now
                lost = self.judge(now, parent_gone, last_lease_at)
                return lost or Verdict(Seen.ORPHANED, f"{parent_gone}; waiting up to "
                                                      f"{self.adopt_window:g}s for a restarted "
                                                      f"supervisor to adopt this rank")
            if last_lease_at is not None and last_lease_at > self.orphaned_at:
                self.adopted = True
                return Verdict(Seen.ADOPTED, f"a restarted supervisor's lease "
                                             f"{now - self.orphaned_at:.1f}s after the parent "
                                             f"was gone; the parent is not watched any more")
        return self.judge(now, parent_gone, last_lease_at)

    def judge(self, now: float, parent_gone: str | None,
              last_lease_at: float | None) -> Verdict | None:
        """LAUNCHER_LOST (why) or None, from the state as it is (no change to it)."""
        if parent_gone and not self.adopted:
            if self.adopt_window <= 0:
                return Verdict(Seen.LAUNCHER_LOST, parent_gone)
            since = now if self.orphaned_at is None else self.orphaned_at
            gone = now - since
            if gone >= self.adopt_window and not (
                    last_lease_at is not None and last_lease_at > since):
                return Verdict(Seen.LAUNCHER_LOST,
                               f"supervisor (parent) gone for {gone:.1f}s and nobody adopted "
                               f"this rank (adopt window {self.adopt_window:g}s): {parent_gone}")
        if last_lease_at is None or self.lease_ttl <= 0:
            return None  # a lease never seen is not stale
        age = now - max(last_lease_at, self.base)
        if age > self.lease_ttl:
            return Verdict(Seen.LAUNCHER_LOST, f"no supervisor lease for {age:.1f}s "
                                               f"(stale after {self.lease_ttl:g}s)")
        return None

    def rebase(self, now: float) -> None:
        self.base = now
        if self.orphaned_at is not None and not self.adopted:
            self.orphaned_at = now  # this process did not run: the window starts again


class ProgressWatchdog:
    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.since: float | None = None  # when the current stretch without progress began
        self.step = -1

    def check(self, now: float, active: int, step: int) -> Verdict | None:
        if active <= 0 or self.stall_s <= 0:
            self.since = None
            return None
        if self.since is None or step != self.step:
            self.since, self.step = now, step
            return None
        stalled = now - self.since
        if stalled >= self.stall_s:
            return Verdict(Seen.STALLED, f"{active} active request(s) but no step progress "
                                         f"for {stalled:.1f}s (stuck before or inside step "
                                         f"{step})")
        return None

    def rebase(self, now: float) -> None:
        if self.since is not None:
            self.since = now
