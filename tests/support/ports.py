"""Free loopback TCP ports for tests that hand them to ranks (hostfiles, endpoints):
common/ports.py, outside the ephemeral range, so no connection a test makes meanwhile
can take one before the rank binds it.

A test's own draws (a gateway's port, a hostfile's) come from TEST_RANGE_ENV, a slice
apart from the LOCKSTEP_PORT_RANGE its subprocesses inherit (tests/conftest.py): a
supervisor drawing ranks' ports while the gateway `up` started has not bound the port
the test drew for it yet would otherwise hand that port to a rank (CI: "[ring] Couldn't
bind socket (error: 98)").
"""

from __future__ import annotations

import os

from common import ports

TEST_RANGE_ENV = "LOCKSTEP_TEST_PORT_RANGE"


def free_ports(n: int) -> list[int]:
    """`n` distinct ports: all are held at once, so none is handed out twice."""
    within = ports.configured_range({ports.RANGE_ENV: os.environ.get(TEST_RANGE_ENV, "")})
    return ports.free_ports(n, "127.0.0.1", within=within)


def free_port() -> int:
    return free_ports(1)[0]
