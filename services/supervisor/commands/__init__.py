"""Admin commands: one module per command, named as common/messages/commands names it
(COMMANDS, the one registry: its Args, its Reply and the protocol doc live there). Each
module here is the command's execution, `async run(sup, args) -> dict`, where `sup` is
what a command sees of the supervisor (interfaces.CommandHost: the table, its identity,
and deploy/stop/replan/reap).

Wire: `AdminRequest(request_id, command, args)` → `AdminReply(request_id, ok, code,
message, data)`; `args` are decoded strictly into the command's Args (a bad field is
`bad_request` naming it); on success `data` is the command's Reply, checked here before it
leaves (a reply that is not one is `internal`: a bug of ours, never the client's to parse);
`code` is an AdminCode (common/messages/admin.py): OK on success, else why not.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import TYPE_CHECKING

from common.messages import AdminCode, AdminReply, AdminRequest
from common.messages.commands import COMMANDS
from common.schema import SchemaError, decode_into, to_wire
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost

log = logging.getLogger("lockstep.supervisor.admin")

# name -> the module that runs it (services/supervisor/commands/<name>.py)
REGISTRY: dict[str, ModuleType] = {
    name: importlib.import_module(f"{__name__}.{name}") for name in COMMANDS}


async def dispatch(sup: CommandHost, req: AdminRequest) -> AdminReply:
    cmd = COMMANDS.get(req.command)
    try:
        if cmd is None:
            raise AdminError(AdminCode.UNKNOWN_COMMAND, f"unknown command {req.command[:64]!r}; "
                             f"known: {', '.join(sorted(COMMANDS))}")
        try:
            args = decode_into(cmd.args, req.args, prefix="args.")
        except SchemaError as exc:
            raise AdminError(AdminCode.BAD_REQUEST, f"{exc.reason}: {exc.detail}",
                             {"field": exc.detail, "reason": exc.reason}) from None
        data = to_wire(await REGISTRY[cmd.name].run(sup, args))
        cmd.decode(data)  # what it promises: ReplyError (internal) if not
        return AdminReply(request_id=req.request_id, ok=True, code=AdminCode.OK, data=data)
    except AdminError as exc:
        return AdminReply(request_id=req.request_id, ok=False, code=exc.code,
                          message=exc.message[:60000], data=exc.data)
    except Exception as exc:  # noqa: BLE001 - never let a command take the socket down
        log.exception("admin command %s failed", req.command)
        return AdminReply(request_id=req.request_id, ok=False, code=AdminCode.INTERNAL,
                          message=f"{type(exc).__name__}: {exc}"[:60000])
