"""The host agent (services.hostagent) on this host, run as the subprocess it is over
ssh: `common.ssh` runs a 127.0.0.1 target directly, without ssh."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from common import ssh
from services.hostagent import agent_argv
from tests.support.processes import REPO

LOCAL = "127.0.0.1"


def agent(command: str, *args: str, input: bytes | None = None):
    """`python -m services.hostagent COMMAND ARGS` on this host; its JSON answer."""
    return ssh.run_json(LOCAL, agent_argv(sys.executable, command, *args), input=input,
                        timeout=60)


def ident_of(info: dict) -> dict:
    """The identity (pid, start time, command line) in a `spawn` or `identify` answer."""
    return {k: info[k] for k in ("pid", "start_time", "cmdline")}


def spawn(argv: list[str], *, log: Path, cwd: Path = REPO, env: dict | None = None,
          extra: Iterable[str] = ()) -> dict:
    """`hostagent spawn`: `argv` detached in its own session, output to `log`; `env`
    goes over stdin (never on a command line); `extra` are more spawn flags."""
    args = ["--cwd", str(cwd), "--log", str(log), *extra]
    if env is not None:
        args.append("--env-json-stdin")
    return agent("spawn", *args, "--", *argv,
                 input=None if env is None else json.dumps(env).encode())
