"""The caller's side of the host agent: a remote host as reached over ssh, and the stop
ladder run there one step per ssh (shared by the supervisor's teardown and the reaper).

Every call is `common.ssh.run_json` (batch mode, connect timeout, keep-alives, a
deadline); the agent on that host checks identity before each signal and observes each
exit. SshError (naming the target) for anything that did not answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.home import Paths
from common.messages.vocab import ProcState
from common.procs import ProcessIdentity
from common.ssh import SshError, SshTarget, run_json
from services.hostagent import agent_argv
from services.hostagent.base import identity_to_dict

STEPS = (("sigterm", "TERM"), ("sigkill", "KILL"), ("sigkill-retry", "KILL"))


@dataclass(frozen=True)
class RemoteHost:
    """One remote host: how to reach its agent, and its $LOCKSTEP_HOME."""

    name: str  # for messages
    target: SshTarget
    python: str  # interpreter there (runs the agent and, by default, the ranks)
    home: str  # its $LOCKSTEP_HOME (absolute)
    cwd: str = "/"  # where ranks start
    timeout: float = 35.0  # deadline of one agent command (its own waits come on top)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.target.target, self.python, self.home)

    @property
    def paths(self) -> Paths:
        return Paths(Path(self.home))

    def agent(self, command: str, *args: str, input: bytes | None = None,
              wait: float = 0.0) -> Any:
        """The agent's JSON answer; SshError if ssh or the command failed or did not
        answer within timeout + wait seconds."""
        return run_json(self.target, agent_argv(self.python, command, *args), input=input,
                        timeout=self.timeout + wait)

    def describe(self) -> str:
        return f"{self.name} ({self.target.target})"


def idents_json(idents: list[ProcessIdentity]) -> str:
    return json.dumps([identity_to_dict(i) for i in idents])


def ident_from(d: Mapping[str, Any]) -> ProcessIdentity:
    return ProcessIdentity(int(d["pid"]), float(d["start_time"]), tuple(d["cmdline"]))


def probe_states(host: RemoteHost, idents: list[ProcessIdentity],
                 deployment_id: str | None = None) -> tuple[dict[int, ProcState], list[dict]]:
    """({pid: its state there}, markers there) — markers of `deployment_id` under the
    host's home when given, else none. The one reader of a probe's reply."""
    args = ["--identities-json", idents_json(idents)]
    if deployment_id is not None:
        args += ["--home", host.home, "--deployment", deployment_id]
    try:
        ans = host.agent("probe", *args)
        return ({int(p["pid"]): ProcState(p["state"]) for p in ans["processes"]},
                list(ans.get("markers", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise SshError(host.target.target, f"probe answered badly: {exc}") from None


@dataclass
class Ladder:
    """The stop ladder's state on one host."""

    left: list[ProcessIdentity] = field(default_factory=list)  # not (yet) proven gone
    path: list[str] = field(default_factory=list)
    error: str | None = None  # the ssh failure that ended it: nothing more is proven


def wait_gone(host: RemoteHost, lad: Ladder, timeout: float) -> None:
    if lad.error or not lad.left:
        return
    try:
        ans = host.agent("wait-exit", "--identities-json", idents_json(lad.left),
                         "--timeout", f"{timeout:.3f}", wait=timeout)
        lad.left = [ident_from(d) for d in ans["survivors"]]
    except (SshError, KeyError, TypeError, ValueError) as exc:
        lad.error = f"wait-exit on {host.describe()} failed: {exc}"


def _signal(host: RemoteHost, ident: ProcessIdentity, sig: str, pgid: int) -> None:
    # The group only while this member proves it (the agent checks), else the process.
    if pgid > 1 and host.agent("signal-group", str(pgid), sig, "--members-json",
                               idents_json([ident]))["sent"]:
        return
    host.agent("signal", str(ident.pid), repr(ident.start_time), sig,
               "--cmdline-json", json.dumps(list(ident.cmdline)))


def run_ladder(host: RemoteHost, lad: Ladder, pgid_of: Mapping[int, int], *,
               term_timeout: float, kill_timeout: float) -> None:
    """SIGTERM → wait → SIGKILL → wait → SIGKILL → wait, over ssh, stopping as soon as
    nothing is left or ssh fails."""
    for (step, sig), timeout in zip(STEPS, (term_timeout, kill_timeout, kill_timeout),
                                    strict=True):
        if lad.error or not lad.left:
            return
        lad.path.append(step)
        try:
            for ident in lad.left:
                _signal(host, ident, sig, pgid_of.get(ident.pid, 0))
        except (SshError, KeyError, TypeError) as exc:
            lad.error = f"{step} on {host.describe()} failed: {exc}"
            return
        wait_gone(host, lad, timeout)


def remove_launch_files(host: RemoteHost, job_id: str,
                        deployment_id: str | None = None) -> dict[str, Any]:
    """The launch secret and job directory there (and the deployment's markers when
    `deployment_id` is given); the agent refuses anything outside its runtime/."""
    p = host.paths
    paths = [str(p.secrets / f"{job_id}.key"), str(p.runtime / "jobs" / job_id)]
    if deployment_id is not None:
        paths.append(str(p.markers / deployment_id))
    return host.agent("remove-files", "--home", host.home, *paths)
