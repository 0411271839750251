"""What `lockstep up` checks before it starts anything: no other supervisor owns this
home, and every port it is about to bind is free. A clear sentence beats a traceback
from the third process it started."""

from __future__ import annotations

import errno
import os
import socket

from common.atomic_json import StateFileError
from common.home import Paths, read_supervisor_record
from common.procs import START_TIME_TOLERANCE, identify
from services.supervisor.homelock import SupervisorBusy, hold_home_lock


def supervisor_busy(paths: Paths) -> str | None:
    """Why a supervisor cannot start for `paths` (another one holds the home), or None."""
    paths.ensure()
    try:
        fd = hold_home_lock(paths)
    except SupervisorBusy as exc:
        return f"{exc} (is another `lockstep up` running?)"
    os.close(fd)  # free again at once: the supervisor we start takes it for good
    # A supervisor that predates the lock still names itself in its runtime file.
    try:
        info = read_supervisor_record(paths.supervisor_file)
    except StateFileError:
        return None
    me = identify(info.pid)
    if me is not None and abs(me.start_time - info.start_time) <= START_TIME_TOLERANCE:
        return (f"a supervisor is running for {paths.home} (pid {info.pid}, admin "
                f"{info.admin}; is another `lockstep up` running?)")
    return None


def port_taken(host: str, port: int) -> bool:
    if port == 0:  # any free port
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq and uvicorn do
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def busy_ports(ports: list[tuple[str, str, int]]) -> list[str]:
    """[(flag, host, port)] -> one message per port already in use."""
    return [f"port {port} on {host} is in use by another program (choose another with {flag})"
            for flag, host, port in ports if port_taken(host, port)]
