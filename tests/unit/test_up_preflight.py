"""`lockstep up` refuses to start, with a sentence per problem, when another supervisor
owns the home or a port it would bind is taken; and the home lock dies with its holder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from common.home import Paths
from services.supervisor.homelock import SupervisorBusy, hold_home_lock
from services.up.preflight import busy_ports, port_taken, supervisor_busy


@pytest.mark.timeout(30)
def test_the_home_lock_is_exclusive_and_released_on_close(tmp_path):
    paths = Paths(tmp_path / "home")
    paths.ensure()
    assert supervisor_busy(paths) is None
    fd = hold_home_lock(paths)
    try:
        with pytest.raises(SupervisorBusy, match="another supervisor is running"):
            hold_home_lock(paths)
        assert "another supervisor is running" in (supervisor_busy(paths) or "")
    finally:
        os.close(fd)
    assert supervisor_busy(paths) is None


@pytest.mark.timeout(30)
def test_the_home_lock_dies_with_a_killed_holder(tmp_path):
    paths = Paths(tmp_path / "home")
    paths.ensure()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, os; from pathlib import Path; "
         "from common.home import Paths; from services.supervisor.homelock import "
         "hold_home_lock; hold_home_lock(Paths(Path(sys.argv[1]))); print('held', flush=True); "
         "sys.stdin.read()", str(paths.home)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert supervisor_busy(paths) is not None
    finally:
        holder.kill()
        holder.wait(10)
    assert supervisor_busy(paths) is None  # SIGKILL left no stale lock


@pytest.mark.timeout(30)
def test_taken_ports_are_named_with_their_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert port_taken("127.0.0.1", taken)
        msgs = busy_ports([("--port", "127.0.0.1", taken), ("--admin-port", "127.0.0.1", 0)])
    assert msgs == [f"port {taken} on 127.0.0.1 is in use by another program "
                    "(choose another with --port)"]
    assert not port_taken("127.0.0.1", taken)  # free again once closed
