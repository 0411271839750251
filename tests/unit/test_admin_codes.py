"""Admin replies carry a closed, typed code: every failing code has one HTTP status, a
code outside the set fails the schema, and an AdminError cannot carry an unknown one."""

from __future__ import annotations

import pytest

from common.messages import AdminCode, AdminReply
from common.schema import SchemaError, decode_into, to_wire
from services.gateway.errors import ADMIN_STATUS
from services.supervisor.errors import CODES, AdminError


def test_every_failing_code_has_one_http_status():
    failing = {c for c in AdminCode if c is not AdminCode.OK}
    assert failing <= ADMIN_STATUS.keys()
    assert CODES == {c.value for c in failing}
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
