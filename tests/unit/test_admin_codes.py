"""Admin replies carry a closed, typed code: every failing code has one HTTP status, a
code outside the set fails the schema, and an AdminError cannot carry an unknown one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import msgpack
import pytest

from common.messages import AdminCode, AdminReply, AdminRequest
from common.messages.commands import COMMANDS, Command
from common.schema import SchemaError, decode_into, to_wire
from services.gateway.admin import api as admin_api
from services.gateway.core.errors import ADMIN_STATUS, TYPES, ApiError
from services.gateway.core.metrics import Metrics
from services.supervisor import commands
from services.supervisor.errors import AdminError


@dataclass
class NoArgs:
    pass


@pytest.mark.parametrize("code", [c for c in AdminCode if c is not AdminCode.OK])
async def test_a_failing_command_reaches_http_with_its_code_and_status(code, monkeypatch):
    """A command that raises AdminError(code) on the supervisor, through its dispatcher,
    the wire and the gateway's admin call, is an HTTP error carrying the same code, with
    a status the gateway renders (never the catch-all 500 of a code it does not know)."""
    async def run(sup, args):
        raise AdminError(code, "what to do", {"evidence": 1})

    monkeypatch.setitem(COMMANDS, "fails", Command("fails", SimpleNamespace(Args=NoArgs), 1.0))
    monkeypatch.setitem(commands.REGISTRY, "fails", SimpleNamespace(run=run))
    reply = await commands.dispatch(None, AdminRequest("r-1", "fails", {}))
    reply = decode_into(AdminReply, msgpack.unpackb(msgpack.packb(to_wire(reply))))

    async def admin(command, args, timeout=None):
        return reply

    gw = SimpleNamespace(cluster=SimpleNamespace(admin=admin), metrics=Metrics())
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(gw=gw)))
    with pytest.raises(ApiError) as e:
        await admin_api.call(request, "fails")
    err = e.value
    assert err.code == code.value and err.message == "what to do" and err.data == {"evidence": 1}
    assert err.status in TYPES and err.status >= 400
    assert err.status != 500 or code in (AdminCode.INTERNAL, AdminCode.TEARDOWN_FAILED), code
    body = err.response()
    assert body.status_code == err.status and json.loads(body.body)["error"]["code"] == code.value


def test_the_statuses_design_names():
    assert ADMIN_STATUS[AdminCode.SIGNATURE_MISMATCH] == 409
    assert ADMIN_STATUS[AdminCode.NOT_FOUND] == 404


def test_the_code_is_decoded_strictly_and_printed_as_its_wire_string():
    wire = to_wire(AdminReply("r-1", False, AdminCode.CONFLICT, "busy"))
    assert wire["code"] == "conflict"
    back = decode_into(AdminReply, wire)
    assert back.code is AdminCode.CONFLICT and f"{back.code}" == "conflict"
    with pytest.raises(SchemaError):
        decode_into(AdminReply, {**wire, "code": "maybe"})


def test_an_admin_error_takes_only_a_known_failing_code():
    assert AdminError("not_found", "no such deployment").code is AdminCode.NOT_FOUND
    with pytest.raises(ValueError):
        AdminError("no_such_code", "x")
    with pytest.raises(ValueError):
        AdminError(AdminCode.OK, "x")
