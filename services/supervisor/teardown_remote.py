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

import json
from dataclasses import dataclass, field
from typing import Any

from common.procs import START_TIME_TOLERANCE, ProcessIdentity
from common.ssh import SshError
from common.state import RankMarker, StateFileError
from services.supervisor.deployment import RankState
from services.supervisor.remote import RemoteHost, ident_from, idents_json

STEPS = (("sigterm", "TERM"), ("sigkill", "KILL"), ("sigkill-retry", "KILL"))
SWEEP_TERM_S = 0.2
GONE_STATES = frozenset({"gone", "reused"})


@dataclass
class HostTeardown:
    host: RemoteHost
    ranks: list[RankState]
    left: list[ProcessIdentity] = field(default_factory=list)  # not (yet) proven gone
    path: list[str] = field(default_factory=list)
    error: str | None = None  # the ssh failure that ended this host's teardown
    swept: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    swept_rank: dict[int, int] = field(default_factory=dict)  # pid -> rank

    def __post_init__(self) -> None:
        self.left = [rs.identity for rs in self.ranks if rs.identity is not None]

    def fail(self, what: str, exc: Exception) -> None:
        self.error = f"{what} on {self.host.describe()} failed: {exc}"

    def rank_of(self, pid: int) -> int | None:
        for rs in self.ranks:
            if rs.pid == pid:
                return rs.rank
        return self.swept_rank.get(pid)

    def report(self) -> dict[str, Any]:
        return {"ssh": self.host.target.target, "path": self.path, "error": self.error}


def wait_gone(ht: HostTeardown, timeout: float) -> None:
    if ht.error or not ht.left:
        return
    try:
        ans = ht.host.agent("wait-exit", "--identities-json", idents_json(ht.left),
                            "--timeout", f"{timeout:.3f}", wait=timeout)
        ht.left = [ident_from(d) for d in ans["survivors"]]
    except (SshError, KeyError, TypeError) as exc:
        ht.fail("wait-exit", exc)


def _signal(ht: HostTeardown, ident: ProcessIdentity, sig: str) -> None:
    pgid = next((rs.pgid for rs in ht.ranks if rs.pid == ident.pid), 0)
    # The group only while this member proves it (the agent checks); else the process.
    if pgid > 1 and ht.host.agent("signal-group", str(pgid), sig, "--members-json",
                                  idents_json([ident]))["sent"]:
        return
    ht.host.agent("signal", str(ident.pid), repr(ident.start_time), sig,
                  "--cmdline-json", json.dumps(list(ident.cmdline)))


def ladder(ht: HostTeardown, term_timeout: float, kill_timeout: float) -> None:
    for (step, sig), timeout in zip(STEPS, (term_timeout, kill_timeout, kill_timeout),
                                    strict=True):
        if ht.error or not ht.left:
            return
        ht.path.append(step)
        try:
            for ident in ht.left:
                _signal(ht, ident, sig)
        except (SshError, KeyError, TypeError) as exc:
            ht.fail(f"{step}", exc)
            return
        wait_gone(ht, timeout)


def _names_launch(cmdline: list[str], job_id: str) -> bool:
    return "--spec" in cmdline and any(job_id in a for a in cmdline)


def _leftovers(ht: HostTeardown, markers: list[dict[str, Any]], deployment_id: str,
               job_id: str) -> list[tuple[int, ProcessIdentity]]:
    """Marker pids on that host that the manifest does not name and that are provably
    this launch's ranks (start time and command line, read there)."""
    known = {rs.pid for rs in ht.ranks}
    placed = {rs.rank for rs in ht.ranks}  # only ranks placed on this host
    found = []
    for item in markers:
        try:
            m = RankMarker.from_dict(item["marker"])
        except (StateFileError, KeyError, TypeError):
            continue
        if m.pid in known or m.rank not in placed or m.deployment_id != deployment_id:
            continue
        current = ht.host.agent("identify", str(m.pid))
        if current is None:
            continue  # exited (or a zombie): never signalled
        ident = ident_from(current)
        if abs(ident.start_time - m.start_time) > START_TIME_TOLERANCE:
            ht.skipped.append({"rank": m.rank, "pid": m.pid, "host": ht.host.name,
                               "reason": f"pid reused: start time {ident.start_time:.2f} "
                                         f"!= marker {m.start_time:.2f}"})
        elif m.job_id != job_id or not _names_launch(list(ident.cmdline), job_id):
            ht.skipped.append({"rank": m.rank, "pid": m.pid, "host": ht.host.name,
                               "reason": "command line does not name this launch"})
        else:
            found.append((m.rank, ident))
    return found


def sweep_and_prove(ht: HostTeardown, deployment_id: str, job_id: str,
                    kill_timeout: float) -> None:
    """One probe: the recorded ranks' states there (the proof for them) and this
    deployment's markers there (the sweep). Leaves `ht.left` = what is not proven gone."""
    if ht.error:
        return
    recorded = [rs.identity for rs in ht.ranks if rs.identity is not None]
    try:
        ans = ht.host.agent("probe", "--identities-json", idents_json(recorded),
                            "--home", ht.host.home, "--deployment", deployment_id)
        states = {p["pid"]: p["state"] for p in ans["processes"]}
        ht.left = [i for i in recorded if states.get(i.pid) not in GONE_STATES]
        found = _leftovers(ht, ans.get("markers", []), deployment_id, job_id)
    except (SshError, KeyError, TypeError) as exc:
        ht.left = recorded
        ht.fail("probe", exc)
        return
    if not found:
        return
    sweep = HostTeardown(ht.host, [])
    sweep.left = [i for _, i in found]
    ladder(sweep, SWEEP_TERM_S, kill_timeout)
    if "sweep" not in ht.path:
        ht.path.append("sweep")
    ht.swept += [{"rank": r, "pid": i.pid, "host": ht.host.name, "path": sweep.path}
                 for r, i in found]
    ht.swept_rank.update({i.pid: r for r, i in found})
    ht.left += sweep.left
    if sweep.error:
        ht.error = sweep.error


def survivors(ht: HostTeardown) -> list[dict[str, Any]]:
    reason = ht.error or "alive after the last step"
    return [{"rank": ht.rank_of(i.pid), "pid": i.pid, "host": ht.host.name,
             "ssh": ht.host.target.target, "cmdline": list(i.cmdline), "reason": reason}
            for i in ht.left]
