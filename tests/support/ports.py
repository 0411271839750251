"""Free loopback TCP ports for tests that hand them to ranks (hostfiles, endpoints):
common/ports.py, outside the ephemeral range, so no connection a test makes meanwhile
can take one before the rank binds it."""

from __future__ import annotations

from common import ports


def free_ports(n: int) -> list[int]:
    """`n` distinct ports: all are held at once, so none is handed out twice."""
    return ports.free_ports(n, "127.0.0.1")


def free_port() -> int:
    return free_ports(1)[0]
