"""`lockstep admin COMMAND` — the supervisor's signed ZeroMQ admin socket from the shell.

    lockstep admin [--home DIR] [--endpoint EP] [--timeout S] [--json] COMMAND ...

Every COMMAND, its flags and its help come from the registry of admin commands
(common/messages/commands: one module per command, its Args' fields are the flags and
its Reply renders the answer); `lockstep admin COMMAND --help` shows them. `watch` is the
CLI's own: `status` redrawn every second in place until Ctrl-C (exit 0).

The endpoint comes from `$LOCKSTEP_HOME/runtime/supervisor.json` unless given. Exit
status: 0 ok, 1 the supervisor answered with an error (its code is printed), 2 usage,
3 no answer (supervisor not running, or the deadline passed). `--json` prints the whole
reply `{ok, code, message, data}`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from common.atomic_json import StateFileError
from common.bus import BusTimeout, Channel, new_request_id
from common.envelope import Key
from common.home import Paths, default_home, read_supervisor_record
from common.keys import KeyFileError, load_cluster_key
from common.messages import ADMIN_OUT, AdminReply, AdminRequest
from common.messages.commands import COMMANDS, Command, ReplyError, args_wire, command_of
from common.messages.commands.status import Reply as StatusReply
from common.rpc_client import SyncRpcClient
from services.admin.flags import add_fields, args_from

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
WATCH = "watch"  # the CLI's own subcommand: `status`, redrawn


class AdminFailed(Exception):
    """The supervisor answered a command with an error (`reply.code`, `reply.message`)."""

    def __init__(self, command: str, reply: AdminReply) -> None:
        super().__init__(f"{command}: {reply.code}: {reply.message}")
        self.reply = reply


class AdminClient:
    """Blocking admin client (CLI, tests, scripts): one DEALER, calls with deadlines."""

    def __init__(self, endpoint: str, key: Key, *, ctx: zmq.Context | None = None) -> None:
        self._own = ctx is None
        self.ctx = ctx or zmq.Context()
        self.channel = Channel("admin_cli", "admin", sender=f"admin-cli:{new_request_id()}",
                               send_key=key, accept=ADMIN_OUT)
        self.rpc = SyncRpcClient(self.ctx, endpoint, self.channel)

    @classmethod
    def from_home(cls, home: Path, endpoint: str | None = None) -> AdminClient:
        key = load_cluster_key(Path(home) / "keys" / "cluster.key")
        return cls(endpoint or supervisor_endpoint(Path(home)), key)

    def call(self, command: str, timeout: float | None = None, **args: Any) -> AdminReply:
        """The reply as it came (ok or not; `data` as sent): for --json and tests."""
        req = AdminRequest(request_id=new_request_id(), command=command, args=args)
        cmd = COMMANDS.get(command)
        wait = timeout if timeout is not None else (cmd.wait_s if cmd else 15.0)
        return self.rpc.call(req, wait).body

    def ask(self, args: Any, timeout: float | None = None) -> Any:
        """Run the command whose Args `args` is: its Reply, decoded once. AdminFailed if
        the supervisor refused, ReplyError if it answered with something else."""
        cmd = command_of(args)
        reply = self.call(cmd.name, timeout, **args_wire(args))
        if not reply.ok:
            raise AdminFailed(cmd.name, reply)
        return cmd.decode(reply.data)

    def close(self) -> None:
        self.rpc.close()
        if self._own:
            self.ctx.term()


def supervisor_endpoint(home: Path) -> str:
    try:
        return read_supervisor_record(Paths(home).supervisor_file).admin
    except StateFileError as exc:
        raise SystemExit(f"lockstep admin: no supervisor found under {home} ({exc}); "
                         "start one with `lockstep supervisor` or pass --endpoint") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lockstep admin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # The common options work before or after the command (`admin status --json`); the
    # subcommand copies default to SUPPRESS so they never overwrite one given before.
    common = argparse.ArgumentParser(add_help=False)
    for parser, default in ((ap, None), (common, argparse.SUPPRESS)):
        parser.add_argument("--home", type=Path, default=default)
        parser.add_argument("--endpoint", default=default)
        parser.add_argument("--timeout", type=float, default=default,
                            help="seconds to wait for a reply")
        parser.add_argument("--json", action="store_true",
                            default=False if default is None else default,
                            help="print the whole reply as JSON")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        add_fields(sub.add_parser(cmd.cli, parents=[common], help=cmd.summary,
                                  description=cmd.module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter),
                   cmd.args)
    sub.add_parser(WATCH, parents=[common], help="status, redrawn every second until Ctrl-C")
    return ap


def build_request(ns: argparse.Namespace) -> tuple[Command | None, Any]:
    """(the command, its Args) from the parsed command line; (None, None) for watch."""
    if ns.command == WATCH:
        return None, None
    cmd = next(c for c in COMMANDS.values() if c.cli == ns.command)
    try:
        return cmd, args_from(ns, cmd.args)
    except ValueError as exc:  # a hosts file that cannot be used
        raise SystemExit(f"lockstep admin: {exc}") from None


def human(command: str, data: Any) -> str:
    """An ok reply's data, as the command's Reply renders it (ReplyError if it is not)."""
    return COMMANDS[command].decode(data).render()


def watch(client: AdminClient, timeout: float | None, period_s: float = 1.0) -> int:
    """`status`, redrawn in place every `period_s` until Ctrl-C (exit 0)."""
    prev = None
    # Ctrl-C is ours, explicitly: Python installs its KeyboardInterrupt handler only when
    # SIGINT did not arrive ignored, and a shell's background job inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            t0 = time.monotonic()
            try:
                status: StatusReply = client.ask(COMMANDS["status"].args(), timeout or 5.0)
                text = status.render(prev=prev)
                prev = status.steps()
            except AdminFailed as exc:
                text = f"error [{exc.reply.code}]: {exc.reply.message}"
            except BusTimeout as exc:
                text = f"lockstep admin watch: no answer: {exc}"
            except ReplyError as exc:
                text = f"lockstep admin watch: {exc}"
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{CLEAR}lockstep admin watch  {stamp}  "
                             f"(every {period_s:g}s, Ctrl-C to quit)\n\n{text}\n")
            sys.stdout.flush()
            time.sleep(max(0.0, period_s - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    home = (ns.home or default_home()).expanduser()
    cmd, args = build_request(ns)
    try:
        client = AdminClient.from_home(home, ns.endpoint)
    except KeyFileError as exc:
        print(f"lockstep admin: {exc}", file=sys.stderr)
        return 2
    if cmd is None:
        return watch(client, ns.timeout)
    try:
        reply = client.call(cmd.name, ns.timeout, **args_wire(args))
    except BusTimeout as exc:
        print(f"lockstep admin: {exc}", file=sys.stderr)
        return 3
    finally:
        client.close()
    if ns.json:
        print(json.dumps({"ok": reply.ok, "code": reply.code, "message": reply.message,
                          "data": reply.data}, indent=2, sort_keys=True, default=str))
    elif reply.ok:
        try:
            print(cmd.decode(reply.data).render())
        except ReplyError as exc:  # not what the supervisor writes: say so
            print(f"lockstep admin: {exc} (see --json)", file=sys.stderr)
            return 1
    else:
        print(f"error [{reply.code}]: {reply.message}", file=sys.stderr)
    return 0 if reply.ok else 1


if __name__ == "__main__":
    sys.exit(main())
