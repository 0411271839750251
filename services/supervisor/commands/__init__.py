"""Admin commands: one module per command, its docstring the protocol doc; this
registry maps names to modules. Each module has `Args` (a dataclass the request's
`args` are decoded into strictly: a bad field is `bad_request` naming it) and
`async run(sup, args) -> dict`, where `sup` is what a command sees of the supervisor
(interfaces.CommandHost: the table, its identity, and deploy/stop/replan/reap).

Wire: `AdminRequest(request_id, command, args)` → `AdminReply(request_id, ok, code,
message, data)`; `code` is an AdminCode (common/messages/admin.py): OK on success, else why not.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING

from common.messages import AdminCode, AdminReply, AdminRequest
from common.schema import SchemaError, decode_into
from services.supervisor.commands import (
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
from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost

log = logging.getLogger("lockstep.supervisor.admin")

REGISTRY: dict[str, ModuleType] = {
    "ping": ping, "status": status, "deployments": deployments, "deploy": deploy,
    "stop": stop, "cancel": cancel, "abort_all": abort_all,
    "backend_selection": backend_selection, "replan": replan, "reap": reap,
    "cache_clear": cache_clear,
}


async def dispatch(sup: CommandHost, req: AdminRequest) -> AdminReply:
    mod = REGISTRY.get(req.command)
    try:
        if mod is None:
            raise AdminError("unknown_command", f"unknown command {req.command[:64]!r}; "
                             f"known: {', '.join(sorted(REGISTRY))}")
        try:
            args = decode_into(mod.Args, req.args, prefix="args.")
        except SchemaError as exc:
            raise AdminError("bad_request", f"{exc.reason}: {exc.detail}",
                             {"field": exc.detail, "reason": exc.reason}) from None
        data = await mod.run(sup, args)
        return AdminReply(request_id=req.request_id, ok=True, code=AdminCode.OK, data=data)
    except AdminError as exc:
        return AdminReply(request_id=req.request_id, ok=False, code=exc.code,
                          message=exc.message[:60000], data=exc.data)
    except Exception as exc:  # noqa: BLE001 - never let a command take the socket down
        log.exception("admin command %s failed", req.command)
        return AdminReply(request_id=req.request_id, ok=False, code=AdminCode.INTERNAL,
                          message=f"{type(exc).__name__}: {exc}"[:60000])
