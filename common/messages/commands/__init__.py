"""The admin commands' wire, one module per command: its `Args` (what ADMIN_REQUEST's
`args` decode into), its `Reply` (what ADMIN_REPLY's `data` decodes into, once, where it
arrives: the CLI, the gateway, `lockstep up`) and how that reply shows itself to a person
(`Reply.render()`, as circus's commands do). The module docstring is the protocol doc.

`COMMANDS` is the one place a command is named: the supervisor's dispatcher
(services/supervisor/commands), the CLI's subcommands and their flags (services/admin/cli.py,
from the Args fields) and the client deadlines all derive from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from common.messages.admin import AdminReply
from common.messages.commands import (
    abort_all,
    backend_selection,
    cache_clear,
    cancel,
    deploy,
    deployments,
    ping,
    reap,
    replan,
    status,
    stop,
)
from common.schema import SchemaError, decode_into, to_wire


class ReplyError(ValueError):
    """An ok reply whose data is not the command's Reply: names the command and the field
    (`reason` is the schema's code: missing_field, extra_field, wrong_type, ...)."""

    def __init__(self, command: str, exc: SchemaError) -> None:
        self.command, self.reason, self.detail = command, exc.reason, exc.detail
        super().__init__(f"the supervisor's {command} reply: {exc.reason}: {exc.detail}")


@dataclass(frozen=True)
class Command:
    name: str  # on the wire (AdminRequest.command)
    module: ModuleType  # its Args, Reply and protocol doc
    wait_s: float  # how long a client waits for the reply unless told

    @property
    def cli(self) -> str:
        """The CLI's subcommand: `abort-all` for `abort_all`."""
        return self.name.replace("_", "-")

    @property
    def summary(self) -> str:
        """The protocol doc's first clause, for the CLI's help."""
        para = " ".join((self.module.__doc__ or "").strip().split("\n\n")[0].split())
        text = para.split(" — ", 1)[-1]
        return min((text.split(sep, 1)[0] for sep in (": ", ". ", "; ")), key=len).rstrip(".")

    @property
    def args(self) -> type:
        return self.module.Args

    @property
    def reply(self) -> type:
        return self.module.Reply

    def decode(self, data: Any) -> Any:
        """The reply's data as this command's Reply; ReplyError if it is not one."""
        try:
            return decode_into(self.module.Reply, data)
        except SchemaError as exc:
            raise ReplyError(self.name, exc) from None


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("ping", ping, 15.0),
    Command("status", status, 15.0),
    Command("deployments", deployments, 15.0),
    Command("deploy", deploy, 900.0),
    Command("stop", stop, 120.0),
    Command("cancel", cancel, 60.0),
    Command("abort_all", abort_all, 120.0),
    Command("cache_clear", cache_clear, 620.0),
    Command("backend_selection", backend_selection, 15.0),
    Command("replan", replan, 900.0),
    Command("reap", reap, 120.0),
)}
_BY_ARGS = {c.args: c for c in COMMANDS.values()}


def command_of(args: Any) -> Command:
    """The command whose Args `args` is."""
    return _BY_ARGS[type(args)]


def args_wire(args: Any) -> dict[str, Any]:
    """An Args instance as AdminRequest.args."""
    return to_wire(args)


def decode_reply(command: str, reply: AdminReply) -> Any:
    """An ok AdminReply's data as `command`'s Reply (ReplyError if it is not)."""
    return COMMANDS[command].decode(reply.data)


def fields_of(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)
