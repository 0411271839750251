"""`python -m services.hostagent COMMAND ...` — process and file operations on one host,
run there (locally, or as the remote command of an ssh), answering with JSON.

Remote operations call this module by name with plain arguments, so no Python source is
ever embedded in an ssh command line, and every check (identity before a signal, proof
of exit) runs on the host that owns the process. Secrets and environments travel on
stdin, never in argv (argv is readable by anyone on the host, through /proc).

Commands (the answer is one JSON line on stdout; exit 0 on success, 1 with
`{"error": "..."}` on failure, 2 for a usage error):

    identify PID
        → {"pid", "start_time", "cmdline"}, or null if gone (a zombie counts as gone)
    signal PID START_TIME SIGNAL --cmdline-json '["argv", ...]'
        → {"sent": bool}: sent only if PID still is that process (start time + cmdline)
    signal-group PGID SIGNAL --members-json '[{"pid", "start_time", "cmdline"}, ...]'
        → {"sent": bool}: sent only if a listed member still lives in that group
    wait-exit --identities-json '[{...}, ...]' --timeout S
        → {"survivors": [{...}, ...]} after polling until all exited or S seconds
    read-markers --home DIR [--deployment D]
        → {"markers": [{"path", "marker"}], "unreadable": [{"path", "reason"}]}
    spawn --cwd DIR --log FILE [--env-json-stdin [--env-replace]] -- ARGV...
        → {"pid", "pgid", "start_time", "cmdline"}; ARGV runs in a new session with
          stdin /dev/null and stdout+stderr appended to FILE (0600); the agent exits at
          once and the child is re-parented. With --env-json-stdin the environment is
          this process's environment updated by the JSON object on stdin (a null value
          removes a variable); with --env-replace it is exactly that object.
    write-file PATH [--mode 600] [--parents]
        → {"path", "bytes", "mode"}; content from stdin, written atomically (temp file
          created with the final mode, fsync, rename, fsync of the directory);
          --parents creates missing directories, mode 0700

SIGNAL is a name (TERM, SIGTERM) or a number. Identities are the dicts `identify` prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import procs
from common.procs import ProcessIdentity
from common.state import Paths, read_markers

# Popen returns once exec is past its point of no return, which can be before the new
# command line is visible in /proc (it reads empty for a moment): wait for it.
SPAWN_SETTLE_S = 2.0
MAX_STDIN_BYTES = 16 * 1024 * 1024
MAX_WAIT_S = 3600.0


class AgentError(Exception):
    """A failure reported as {"error": ...} with exit status 1."""


# --- answers ------------------------------------------------------------------------


def identity_to_dict(ident: ProcessIdentity) -> dict[str, Any]:
    return {"pid": ident.pid, "start_time": ident.start_time, "cmdline": list(ident.cmdline)}


def identity_from_dict(d: Any, where: str = "identity") -> ProcessIdentity:
    # "pgid" is allowed, so that what `spawn` prints can be passed back as it is.
    if type(d) is not dict or set(d) - {"pid", "start_time", "cmdline", "pgid"}:
        raise AgentError(f"{where}: expected an object with pid, start_time, cmdline")
    pid, start, cmdline = d.get("pid"), d.get("start_time"), d.get("cmdline")
    if type(pid) is not int or pid < 1:
        raise AgentError(f"{where}.pid: expected an int >= 1, got {pid!r}")
    if type(start) not in (int, float):
        raise AgentError(f"{where}.start_time: expected a number, got {start!r}")
    if type(cmdline) is not list or not all(type(a) is str for a in cmdline):
        raise AgentError(f"{where}.cmdline: expected a list of strings")
    return ProcessIdentity(pid, float(start), tuple(cmdline))


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise AgentError(f"{what}: not valid JSON: {e}") from None


def _identities(text: str, what: str) -> list[ProcessIdentity]:
    raw = _json_arg(text, what)
    if type(raw) is not list:
        raise AgentError(f"{what}: expected a JSON list of identities")
    return [identity_from_dict(d, f"{what}[{i}]") for i, d in enumerate(raw)]


def parse_signal(text: str) -> int:
    """TERM, SIGTERM, sigterm or 15 → 15. Signal 0 (probe) is not a signal here."""
    if text.isdigit():
        num = int(text)
        valid = {int(s) for s in signal.valid_signals()}
        if num not in valid or num == 0:
            raise AgentError(f"unknown signal {text!r}")
        return num
    name = text.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
    if sig is None:
        raise AgentError(f"unknown signal {text!r}")
    return int(sig)


def _read_stdin() -> bytes:
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    if len(data) > MAX_STDIN_BYTES:
        raise AgentError(f"stdin is larger than {MAX_STDIN_BYTES} bytes")
    return data


# --- commands -----------------------------------------------------------------------


def cmd_identify(args: argparse.Namespace) -> Any:
    ident = procs.identify(args.pid)
    return None if ident is None else identity_to_dict(ident)


def cmd_signal(args: argparse.Namespace) -> Any:
    cmdline = _json_arg(args.cmdline_json, "--cmdline-json")
    ident = identity_from_dict({"pid": args.pid, "start_time": args.start_time,
                                "cmdline": cmdline}, "process")
    return {"sent": procs.signal_identity(ident, parse_signal(args.signal))}


def cmd_signal_group(args: argparse.Namespace) -> Any:
    members = _identities(args.members_json, "--members-json")
    sig = parse_signal(args.signal)
    return {"sent": procs.signal_group(args.pgid, sig, members=members)}


def cmd_wait_exit(args: argparse.Namespace) -> Any:
    if not 0 <= args.timeout <= MAX_WAIT_S:
        raise AgentError(f"--timeout must be within 0..{MAX_WAIT_S:g} seconds")
    idents = _identities(args.identities_json, "--identities-json")
    survivors = procs.wait_exit(idents, args.timeout)
    return {"survivors": [identity_to_dict(s) for s in survivors]}


def cmd_read_markers(args: argparse.Namespace) -> Any:
    try:
        scan = read_markers(Paths(home=Path(args.home)), args.deployment)
    except ValueError as e:  # an invalid deployment id
        raise AgentError(str(e)) from None
    return {"markers": [{"path": str(p), "marker": m.to_dict()} for p, m in scan.markers],
            "unreadable": [{"path": str(p), "reason": r} for p, r in scan.unreadable]}


def _child_env(args: argparse.Namespace) -> dict[str, str] | None:
    if not args.env_json_stdin:
        if args.env_replace:
            raise AgentError("--env-replace needs --env-json-stdin")
        return None  # inherit
    raw = _read_stdin()
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


def _settled_identity(child: subprocess.Popen[bytes], argv: list[str]) -> ProcessIdentity | None:
    deadline = time.monotonic() + SPAWN_SETTLE_S
    while True:
        ident = procs.identify(child.pid)
        if ident is not None and ident.cmdline == tuple(argv):
            return ident
        if child.poll() is not None:
            return None
        if time.monotonic() >= deadline:  # a program that rewrites its own argv
            return ident if ident is not None and ident.cmdline else None
        time.sleep(0.002)


def cmd_spawn(args: argparse.Namespace) -> Any:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise AgentError("spawn: no command given after --")
    env = _child_env(args)
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
    ident = _settled_identity(child, argv)
    if ident is None:
        code = child.wait()
        raise AgentError(f"spawn: {argv[0]!r} exited at once with status {code}; see {log}")
    # Not waited for: when this agent exits, the child is re-parented and keeps running.
    return {**identity_to_dict(ident), "pgid": child.pid}


def cmd_write_file(args: argparse.Namespace) -> Any:
    try:
        mode = int(args.mode, 8)
    except ValueError:
        raise AgentError(f"--mode {args.mode!r}: expected octal, e.g. 600") from None
    if not 0 <= mode <= 0o777:
        raise AgentError(f"--mode {args.mode!r}: permission bits only (0..777)")
    path = Path(args.path).absolute()
    data = _read_stdin()
    if args.parents:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never reuse or follow someone else's file; created with at most the
    # final mode, so the content is never more visible than asked, not even briefly.
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o600)
    except OSError as e:
        raise AgentError(f"write-file {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)  # exact mode, whatever the umask
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise AgentError(f"write-file {path}: {e.strerror or e}") from None
        raise
    return {"path": str(path), "bytes": len(data), "mode": f"{mode:03o}"}


# --- command line -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lockstep hostagent",
                                 description="process and file operations on this host, "
                                             "answering with JSON (see the module doc)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("identify", help="identity of a running process, or null")
    p.add_argument("pid", type=int)
    p.set_defaults(func=cmd_identify)

    p = sub.add_parser("signal", help="signal a process only if its identity matches")
    p.add_argument("pid", type=int)
    p.add_argument("start_time", type=float)
    p.add_argument("signal")
    p.add_argument("--cmdline-json", required=True)
    p.set_defaults(func=cmd_signal)

    p = sub.add_parser("signal-group", help="signal a group only if a member proves it")
    p.add_argument("pgid", type=int)
    p.add_argument("signal")
    p.add_argument("--members-json", required=True)
    p.set_defaults(func=cmd_signal_group)

    p = sub.add_parser("wait-exit", help="poll until processes exit; print survivors")
    p.add_argument("--identities-json", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.set_defaults(func=cmd_wait_exit)

    p = sub.add_parser("read-markers", help="rank markers under a LOCKSTEP_HOME")
    p.add_argument("--home", required=True)
    p.add_argument("--deployment", default=None)
    p.set_defaults(func=cmd_read_markers)

    p = sub.add_parser("spawn", help="start a command in a new session and return")
    p.add_argument("--cwd", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--env-json-stdin", action="store_true")
    p.add_argument("--env-replace", action="store_true")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_spawn)

    p = sub.add_parser("write-file", help="write stdin to a file atomically")
    p.add_argument("path")
    p.add_argument("--mode", default="600")
    p.add_argument("--parents", action="store_true")
    p.set_defaults(func=cmd_write_file)
    return ap


def agent_argv(python: str, command: str, *args: str) -> list[str]:
    """The argv that runs this agent on a host with interpreter `python` (which must have
    the lockstep package importable there), e.g. for `common.ssh.run_json`."""
    return [python, "-m", "services.hostagent", command, *args]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        answer = args.func(args)
    except AgentError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
