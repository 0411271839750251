"""TCP ports chosen before the process that listens on them binds them (a rank's bus
endpoints, hostfiles).

    free_ports(n, host) -> list[int]

Binding to port 0 draws from the kernel's ephemeral range, the same range every outgoing
connection takes its local port from. So between choosing such a port and the rank's
bind, any `connect()` on the host can take it, and the rank fails to load with "cannot
open the bus: Address already in use". That happened in CI while other tests were
connecting. Ports are drawn at random from below the ephemeral range instead (or above
it if there is no room below). No outgoing connection takes those ports, and each one is
checked by binding it. All are held at once, so none is handed out twice.

LOCKSTEP_PORT_RANGE=LOW-HIGH, in the environment of the process that draws them (the
supervisor for its own host's ranks, the host agent on another host), narrows the draw:
for a firewall, or to keep two drawers on one host apart (the suite's two workers).
"""

from __future__ import annotations

import errno
import os
import random
import socket
import sys

LOWEST = 20000  # below: well-known and registered services are more common
MIN_SPAN = 1000  # a range narrower than this is not worth drawing from
EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL = (49152, 65535) if sys.platform == "darwin" else (32768, 60999)
ATTEMPTS_PER_PORT = 64


RANGE_ENV = "LOCKSTEP_PORT_RANGE"


def configured_range(env: dict[str, str] | None = None) -> tuple[int, int] | None:
    """LOCKSTEP_PORT_RANGE as (low, high); None when unset. Malformed is an error."""
    raw = (os.environ if env is None else env).get(RANGE_ENV, "").strip()
    if not raw:
        return None
    lo, _, hi = raw.partition("-")
    try:
        span = int(lo), int(hi)
    except ValueError:
        span = (0, -1)
    if not 1 <= span[0] <= span[1] <= 65535:
        raise ValueError(f"{RANGE_ENV}={raw!r}: expected LOW-HIGH within 1-65535, "
                         "e.g. 20000-20999")
    return span


def ephemeral_range(path: str = EPHEMERAL_FILE) -> tuple[int, int]:
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def listen_range(ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """Where to draw from: below the ephemeral range, else above it; None if neither
    leaves room (then port 0 it is, with its race)."""
    lo, hi = ephemeral
    if lo - 1 - LOWEST >= MIN_SPAN:
        return LOWEST, lo - 1
    if 65535 - (hi + 1) >= MIN_SPAN:
        return hi + 1, 65535
    return None


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_ports(n: int, host: str = "127.0.0.1", *, ephemeral: tuple[int, int] | None = None,
               rng: random.Random | None = None,
               within: tuple[int, int] | None = None) -> list[int]:
    """`n` distinct ports free on `host` now, outside the ephemeral range when it can;
    `within` (low, high) overrides both the range configured and the default."""
    span = within or configured_range() or listen_range(ephemeral or ephemeral_range())
    held: list[socket.socket] = []
    try:
        if span is None:
            for _ in range(n):
                s = socket.socket(_family(host), socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, 0))
            return [s.getsockname()[1] for s in held]
        pick = rng or random.SystemRandom()
        tried = 0
        while len(held) < n:
            if tried >= ATTEMPTS_PER_PORT * n:
                raise OSError(f"no {n} free TCP ports on {host} within {span[0]}-{span[1]}")
            tried += 1
            s = socket.socket(_family(host), socket.SOCK_STREAM)
            try:
                s.bind((host, pick.randint(*span)))
            except OSError as exc:
                s.close()
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise  # not a taken port: the address itself (not on this host)
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
