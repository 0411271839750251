"""The caller's side of the host agent: a remote host as reached over ssh, and the stop
ladder run there one step per ssh (shared by the supervisor's teardown and the reaper).

Every call is `common.ssh.run_json` (batch mode, connect timeout, keep-alives, a
deadline); the agent on that host checks identity before each signal and observes each
exit. Each answer is decoded once into its reply type (replies.py); SshError (naming the
target) for anything that did not answer, or answered with something else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from common.home import Paths
from common.procs import ProcessIdentity
from common.schema import SchemaError, decode_into
from common.ssh import SshError, SshTarget, run_json
from services.hostagent import agent_argv
from services.hostagent.base import identity_to_dict
from services.hostagent.replies import Identity, Probe, Removed, Sent, Survivors

R = TypeVar("R")

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

    def ask(self, reply: type[R], command: str, *args: str, input: bytes | None = None,
            wait: float = 0.0) -> R:
        """The agent's answer decoded once into `reply`; SshError if it did not answer or
        answered with something else."""
        ans = self.agent(command, *args, input=input, wait=wait)
        try:
            return decode_into(reply, ans)
        except SchemaError as exc:
            raise SshError(self.target.target, f"{command} answered badly: {exc}") from None

    def identify(self, pid: int) -> Identity | None:
        """The process holding `pid` there now (None: none, or a zombie)."""
        ans = self.agent("identify", str(pid))
        if ans is None:
            return None
        try:
            return decode_into(Identity, ans)
        except SchemaError as exc:
            raise SshError(self.target.target, f"identify answered badly: {exc}") from None

    def describe(self) -> str:
        return f"{self.name} ({self.target.target})"


def idents_json(idents: list[ProcessIdentity]) -> str:
    return json.dumps([identity_to_dict(i) for i in idents])


def probe(host: RemoteHost, idents: list[ProcessIdentity],
          deployment_id: str | None = None) -> Probe:
    """Each process's state there, and the markers of `deployment_id` under the host's
    home when given (else none)."""
    args = ["--identities-json", idents_json(idents)]
    if deployment_id is not None:
        args += ["--home", host.home, "--deployment", deployment_id]
    return host.ask(Probe, "probe", *args)


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
        ans = host.ask(Survivors, "wait-exit", "--identities-json", idents_json(lad.left),
                       "--timeout", f"{timeout:.3f}", wait=timeout)
        lad.left = [s.ident() for s in ans.survivors]
    except SshError as exc:
        lad.error = f"wait-exit on {host.describe()} failed: {exc}"


def _signal(host: RemoteHost, ident: ProcessIdentity, sig: str, pgid: int) -> None:
    # The group only while this member proves it (the agent checks), else the process.
    if pgid > 1 and host.ask(Sent, "signal-group", str(pgid), sig, "--members-json",
                             idents_json([ident])).sent:
        return
    host.ask(Sent, "signal", str(ident.pid), repr(ident.start_time), sig,
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
        except SshError as exc:
            lad.error = f"{step} on {host.describe()} failed: {exc}"
            return
        wait_gone(host, lad, timeout)


def remove_launch_files(host: RemoteHost, job_id: str,
                        deployment_id: str | None = None) -> Removed:
    """The launch secret and job directory there (and the deployment's markers when
    `deployment_id` is given); the agent refuses anything outside its runtime/."""
    p = host.paths
    paths = [str(p.secrets / f"{job_id}.key"), str(p.runtime / "jobs" / job_id)]
    if deployment_id is not None:
        paths.append(str(p.markers / deployment_id))
    return host.ask(Removed, "remove-files", "--home", host.home, *paths)
