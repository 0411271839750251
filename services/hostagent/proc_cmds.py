"""Process commands of the host agent: identify, signal, signal-group, wait-exit, probe,
spawn. Every check (identity before a signal, proof of exit) runs here, on the host that
owns the process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from common import procs
from common.messages.vocab import ProcState
from common.procs import START_TIME_TOLERANCE, ProcessIdentity
from common.schema import to_wire
from services.hostagent.base import (
    AgentError,
    identities_arg,
    identity_from_dict,
    identity_to_dict,
    json_arg,
    parse_signal,
    read_stdin,
)
from services.hostagent.file_cmds import markers_under
from services.hostagent.replies import Identity, Probe, ProcessState

# Popen returns once exec is past its point of no return, which can be before the new
# command line is visible in /proc (it reads empty for a moment): wait for it.
SPAWN_SETTLE_S = 10.0  # generous: on a loaded host exec can take a while to show
SPAWN_GRACE_S = 0.05
MAX_WAIT_S = 3600.0


def cmd_identify(args: argparse.Namespace) -> Any:
    ident = procs.identify(args.pid)
    return None if ident is None else identity_to_dict(ident)


def cmd_signal(args: argparse.Namespace) -> Any:
    cmdline = json_arg(args.cmdline_json, "--cmdline-json")
    ident = identity_from_dict({"pid": args.pid, "start_time": args.start_time,
                                "cmdline": cmdline}, "process")
    return {"sent": procs.signal_identity(ident, parse_signal(args.signal))}


def cmd_signal_group(args: argparse.Namespace) -> Any:
    members = identities_arg(args.members_json, "--members-json")
    sig = parse_signal(args.signal)
    return {"sent": procs.signal_group(args.pgid, sig, members=members)}


def cmd_wait_exit(args: argparse.Namespace) -> Any:
    if not 0 <= args.timeout <= MAX_WAIT_S:
        raise AgentError(f"--timeout must be within 0..{MAX_WAIT_S:g} seconds")
    idents = identities_arg(args.identities_json, "--identities-json")
    survivors = procs.wait_exit(idents, args.timeout)
    return {"survivors": [identity_to_dict(s) for s in survivors]}


def process_state(ident: ProcessIdentity) -> tuple[ProcState, ProcessIdentity | None]:
    """alive: that process (an empty command line is one on its way out); gone: exited
    or a zombie; reused: the pid belongs to a process with another start time;
    ambiguous: same start time, another command line (neither provably it nor not)."""
    current = procs.identify(ident.pid)
    if current is None:
        return ProcState.GONE, None
    if abs(current.start_time - ident.start_time) > START_TIME_TOLERANCE:
        return ProcState.REUSED, current
    if not current.cmdline or current.cmdline == ident.cmdline:
        return ProcState.ALIVE, current
    return ProcState.AMBIGUOUS, current


def cmd_probe(args: argparse.Namespace) -> Any:
    procs_there = []
    for ident in identities_arg(args.identities_json, "--identities-json"):
        state, current = process_state(ident)
        procs_there.append(ProcessState(ident.pid, state, None if current is None else Identity(
            current.pid, current.start_time, list(current.cmdline))))
    if args.home is None:
        return {"processes": to_wire(procs_there)}
    return to_wire(Probe(**vars(markers_under(args.home, args.deployment)),
                         processes=procs_there))


def _child_env(args: argparse.Namespace) -> dict[str, str] | None:
    if not args.env_json_stdin:
        if args.env_replace:
            raise AgentError("--env-replace needs --env-json-stdin")
        return None  # inherit
    raw = read_stdin()
    try:
        obj = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, ValueError) as e:
        raise AgentError(f"stdin: not a JSON object: {e}") from None
    if type(obj) is not dict:
        raise AgentError("stdin: expected a JSON object of environment variables")
    env = {} if args.env_replace else dict(os.environ)
    for key, value in obj.items():
        if not key or "=" in key or "\0" in key:
            raise AgentError(f"stdin: invalid environment variable name {key!r}")
        if value is None:
            env.pop(key, None)
        elif type(value) is str and "\0" not in value:
            env[key] = value
        else:
            raise AgentError(f"stdin: environment variable {key}: expected a string or null")
    return env


def _rank_env(env: dict[str, str] | None) -> dict[str, str]:
    """The rank service's own environment rules, applied on this host: DESIGN 5.3
    defaults yielding to what is set, OpenBLAS preload if this host has it, no TEMP."""
    from common.rank_env import rank_environment
    from common.rankspec import RankSettings

    return dict(rank_environment(RankSettings(), os.environ if env is None else env))


def _exited_unreaped(proc: psutil.Process) -> bool:
    """Our child has exited but is not reaped yet (a zombie): its pid, and so its start
    time, stay its own until we wait() on it. Nothing here reaps it."""
    try:
        return proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:  # reaped by someone else: cannot be, it is our child
        return True


def settled_identity(child: subprocess.Popen[bytes], argv: list[str]) -> ProcessIdentity | None:
    """The identity of a child we have not waited on yet, running or already exited.

    The start time is read first: until we reap the child its pid cannot be reused, so
    that start time is its own even if it has exited meanwhile (a zombie). Only the
    command line needs to settle (it reads empty for a moment after exec)."""
    try:
        proc = psutil.Process(child.pid)
        start = procs.start_time_of(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # reaped behind our back (SIGCHLD ignored), or macOS hides a zombie
    deadline = time.monotonic() + SPAWN_SETTLE_S
    while True:
        try:
            cmdline = tuple(proc.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            cmdline = ()
        if cmdline == tuple(argv):
            return ProcessIdentity(child.pid, start, cmdline)
        if _exited_unreaped(proc):
            # It ran and exited before we saw its command line: it was this argv.
            return ProcessIdentity(child.pid, start, tuple(argv))
        if time.monotonic() >= deadline:  # a program that rewrites its own argv
            return ProcessIdentity(child.pid, start, cmdline) if cmdline else None
        time.sleep(0.002)


def spawn_outcome(child: subprocess.Popen[bytes], argv: list[str], log: Path) -> dict[str, Any]:
    """What `spawn` answers for a child we have not waited on yet: started, exited 0
    (a short command that already finished), or an AgentError."""
    ident = settled_identity(child, argv)  # before any wait: the pid is still ours
    # A command that fails at once (bad arguments, a missing module) is reported as a
    # failure, not as a started process: give it a moment to do so.
    time.sleep(SPAWN_GRACE_S)
    if child.poll() is not None:
        if child.returncode != 0 or ident is None:
            raise AgentError(f"spawn: {argv[0]!r} exited at once with status "
                             f"{child.returncode}; see {log}")
        # A short command that already finished cleanly: its exit proven by our own wait.
        return {**identity_to_dict(ident), "pgid": child.pid, "exited": 0}
    if ident is None:
        # Running but its identity never settled: we could not prove later that a pid is
        # this child, so do not leave it behind unrecorded.
        child.kill()
        child.wait()
        raise AgentError(f"spawn: could not read the identity of {argv[0]!r} "
                         f"(pid {child.pid}); killed it")
    # Not waited for: when this agent exits, the child is re-parented and keeps running.
    return {**identity_to_dict(ident), "pgid": child.pid}


def cmd_spawn(args: argparse.Namespace) -> Any:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise AgentError("spawn: no command given after --")
    if not os.path.isdir(args.cwd):
        raise AgentError(f"spawn: --cwd {args.cwd}: no such directory on this host")
    env = _child_env(args)
    if args.rank_env:
        env = _rank_env(env)
    log = Path(args.log)
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        # The child must hold none of our stdio: an ssh session ends only when every
        # copy of its stdout/stderr is closed, so an inherited one would keep it open.
        child = subprocess.Popen(argv, cwd=args.cwd, env=env, stdin=subprocess.DEVNULL,
                                 stdout=fd, stderr=subprocess.STDOUT, close_fds=True,
                                 start_new_session=True)
    except OSError as e:
        raise AgentError(f"spawn: cannot start {argv[0]!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return spawn_outcome(child, argv, log)
