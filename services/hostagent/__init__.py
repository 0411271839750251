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
    probe --identities-json '[{...}, ...]' [--home DIR [--deployment D]]
        → {"processes": [{"pid", "state", "current"}], "markers"?, "unreadable"?}: state
          is alive | gone | reused (other start time) | ambiguous (same start time,
          other command line); with --home, the markers as read-markers gives them
    read-markers --home DIR [--deployment D]
        → {"markers": [{"path", "marker"}], "unreadable": [{"path", "reason"}]}
    spawn --cwd DIR --log FILE [--env-json-stdin [--env-replace]] [--rank-env] -- ARGV...
        → {"pid", "pgid", "start_time", "cmdline"}, plus "exited": 0 for a command
          that already finished cleanly (its identity read before it was reaped; a
          non-zero status at once is an error); ARGV runs in a new session with
          stdin /dev/null and stdout+stderr appended to FILE (0600); the agent exits at
          once and the child is re-parented. With --env-json-stdin the environment is
          this process's environment updated by the JSON object on stdin (a null value
          removes a variable); with --env-replace it is exactly that object. --rank-env
          then applies the rank's environment rules on this host (common.rank_env:
          DESIGN 5.3 defaults yielding to set values, OpenBLAS preload, no TEMP).
    write-file PATH [--mode 600] [--parents]
        → {"path", "bytes", "mode"}; content from stdin, written atomically (temp file
          created with the final mode, fsync, rename, fsync of the directory);
          --parents creates missing directories, mode 0700
    remove-files --home DIR PATH...
        → {"removed": [...], "missing": [...]}; only paths below DIR/runtime/<area>/
          (a launch secret, a job directory, a marker directory), all checked first
    free-ports N [--host ADDR]
        → {"host", "ports": [N distinct ports free on ADDR now]}

SIGNAL is a name (TERM, SIGTERM) or a number. Identities are the dicts `identify` prints.
"""

from __future__ import annotations

import argparse
import json
import sys

from services.hostagent.base import AgentError, parse_signal
from services.hostagent.file_cmds import (
    cmd_free_ports,
    cmd_read_markers,
    cmd_remove_files,
    cmd_write_file,
)
from services.hostagent.proc_cmds import (
    cmd_identify,
    cmd_probe,
    cmd_signal,
    cmd_signal_group,
    cmd_spawn,
    cmd_wait_exit,
)

__all__ = ["AgentError", "agent_argv", "main", "parse_signal"]


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

    p = sub.add_parser("probe", help="state of recorded processes (+ markers with --home)")
    p.add_argument("--identities-json", required=True)
    p.add_argument("--home", default=None)
    p.add_argument("--deployment", default=None)
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("read-markers", help="rank markers under a LOCKSTEP_HOME")
    p.add_argument("--home", required=True)
    p.add_argument("--deployment", default=None)
    p.set_defaults(func=cmd_read_markers)

    p = sub.add_parser("spawn", help="start a command in a new session and return")
    p.add_argument("--cwd", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--env-json-stdin", action="store_true")
    p.add_argument("--env-replace", action="store_true")
    p.add_argument("--rank-env", action="store_true")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_spawn)

    p = sub.add_parser("write-file", help="write stdin to a file atomically")
    p.add_argument("path")
    p.add_argument("--mode", default="600")
    p.add_argument("--parents", action="store_true")
    p.set_defaults(func=cmd_write_file)

    p = sub.add_parser("remove-files", help="remove launch files below HOME/runtime")
    p.add_argument("--home", required=True)
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=cmd_remove_files)

    p = sub.add_parser("free-ports", help="TCP ports free on this host right now")
    p.add_argument("count", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.set_defaults(func=cmd_free_ports)
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
