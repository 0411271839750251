"""Verified teardown of the ranks on one remote host (DESIGN.md 5.7), over ssh through
the host agent, which checks identity before every signal and observes every exit on
that host:

  wait-exit (the graceful window) → per step: signal-group (else signal) + wait-exit:
  SIGTERM → SIGKILL → SIGKILL once more → probe (process states and this deployment's
  markers there) → marker pids not in the manifest: identify, and signal only one whose
  start time and command line prove it is this launch's rank → proof.

An ssh failure (host unreachable, refused, timed out) ends the host's ladder: nothing
there is proven gone, every rank still counted is a survivor with the reason, and the
caller keeps the manifest so the next stop retries. These functions block (ssh): the
teardown runs them in threads, one per host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.messages.vocab import ProcState
from common.procs import START_TIME_TOLERANCE, ProcessIdentity
from common.ssh import SshError
from services.hostagent import client
from services.hostagent.client import STEPS, Ladder, RemoteHost
from services.hostagent.replies import Probe
from services.supervisor.deployment import RankState

__all__ = ["STEPS", "HostTeardown", "ladder", "survivors", "sweep_and_prove", "wait_gone"]
SWEEP_TERM_S = 0.2
GONE_STATES = frozenset({ProcState.GONE, ProcState.REUSED})


@dataclass
class HostTeardown(Ladder):
    host: RemoteHost | None = None
    ranks: list[RankState] = field(default_factory=list)  # every rank placed there
    swept: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    swept_rank: dict[int, int] = field(default_factory=dict)  # pid -> rank

    @classmethod
    def of(cls, host: RemoteHost, ranks: list[RankState]) -> HostTeardown:
        return cls(left=[rs.identity for rs in ranks if rs.identity is not None],
                   host=host, ranks=ranks)

    def rank_of(self, pid: int) -> int | None:
        for rs in self.ranks:
            if rs.pid == pid:
                return rs.rank
        return self.swept_rank.get(pid)

    def report(self) -> dict[str, Any]:
        return {"ssh": self.host.target.target, "path": self.path, "error": self.error}


def wait_gone(ht: HostTeardown, timeout: float) -> None:
    client.wait_gone(ht.host, ht, timeout)


def ladder(ht: HostTeardown, term_timeout: float, kill_timeout: float) -> None:
    client.run_ladder(ht.host, ht, {rs.pid: rs.pgid for rs in ht.ranks},
                      term_timeout=term_timeout, kill_timeout=kill_timeout)


def names_launch(cmdline: list[str], job_id: str) -> bool:
    """A rank's command line (`--spec FILE`) whose spec file is this job's."""
    return "--spec" in cmdline and any(job_id in a for a in cmdline)


def _leftovers(ht: HostTeardown, found: Probe, deployment_id: str,
               job_id: str) -> list[tuple[int, ProcessIdentity]]:
    """Marker pids on that host that the manifest does not name and that are provably
    this launch's ranks (start time and command line, read there)."""
    known = {rs.pid for rs in ht.ranks}
    placed = {rs.rank for rs in ht.ranks}  # only ranks placed on this host
    out = []
    for m in found.rank_markers():
        if m.pid in known or m.rank not in placed or m.deployment_id != deployment_id:
            continue
        current = ht.host.identify(m.pid)
        if current is None:
            continue  # exited (or a zombie): never signalled
        ident = current.ident()
        if abs(ident.start_time - m.start_time) > START_TIME_TOLERANCE:
            ht.skipped.append({"rank": m.rank, "pid": m.pid, "host": ht.host.name,
                               "reason": f"pid reused: start time {ident.start_time:.2f} "
                                         f"!= marker {m.start_time:.2f}"})
        elif m.job_id != job_id or not names_launch(list(ident.cmdline), job_id):
            ht.skipped.append({"rank": m.rank, "pid": m.pid, "host": ht.host.name,
                               "reason": "command line does not name this launch"})
        else:
            out.append((m.rank, ident))
    return out


def sweep_and_prove(ht: HostTeardown, deployment_id: str, job_id: str,
                    kill_timeout: float) -> None:
    """One probe: the recorded ranks' states there (the proof for them) and this
    deployment's markers there (the sweep). Leaves `ht.left` = what is not proven gone."""
    if ht.error:
        return
    recorded = [rs.identity for rs in ht.ranks if rs.identity is not None]
    try:
        seen = client.probe(ht.host, recorded, deployment_id)
        states = seen.states()
        ht.left = [i for i in recorded if states.get(i.pid) not in GONE_STATES]
        found = _leftovers(ht, seen, deployment_id, job_id)
    except SshError as exc:
        ht.left = recorded
        ht.error = f"probe of {ht.host.describe()} failed: {exc}"
        return
    if not found:
        return
    sweep = Ladder(left=[i for _, i in found])
    client.run_ladder(ht.host, sweep, {}, term_timeout=SWEEP_TERM_S, kill_timeout=kill_timeout)
    ht.swept += [{"rank": r, "pid": i.pid, "host": ht.host.name, "path": sweep.path}
                 for r, i in found]
    ht.swept_rank.update({i.pid: r for r, i in found})
    ht.left += sweep.left
    ht.error = ht.error or sweep.error


def survivors(ht: HostTeardown) -> list[dict[str, Any]]:
    reason = ht.error or "alive after the last step"
    return [{"rank": ht.rank_of(i.pid), "pid": i.pid, "host": ht.host.name,
             "ssh": ht.host.target.target, "cmdline": list(i.cmdline), "reason": reason}
            for i in ht.left]
