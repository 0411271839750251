"""The bench's CPU-per-token breakdown (bench/cpu_breakdown.py) says which process is
which from real command lines, charges each process only the CPU it used between the two
snapshots, records null with a reason for a process that vanished or was replaced, and
finds the busy thread of a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from bench import cpu_breakdown as cb
from tests.support.polling import poll_for

PY = "/work/main/.venv/bin/python"
SPEC = "/tmp/h/runtime/jobs/j-1/rank-{}.spec.json"


@pytest.mark.parametrize("cmdline,role", [
    ([PY, "-m", "services", "up", "--home", "/h", "--tp", "2"], "up"),
    ([PY, "-m", "services", "supervisor", "--home", "/h"], "supervisor"),
    ([PY, "-m", "services", "reaper", "--home", "/h", "--events-port", "0"], "reaper"),
    ([PY, "-m", "services", "gateway", "--home", "/h", "--port", "1"], "gateway"),
    ([PY, "-m", "services.gateway", "--home", "/h"], "gateway"),
    ([PY, "-m", "services.rank", "--spec", SPEC.format(0)], "rank_0"),
    ([PY, "-m", "services.rank", "--spec", SPEC.format(11)], "rank_11"),
    ([PY, "-m", "services.rank"], None),
    ([PY, "-m", "mlx_lm", "server", "--model", "/m"], None),
    ([PY, "-m", "services", "status"], None),
])
def test_roles_come_from_the_command_line(cmdline, role):
    assert cb.role_of(cmdline) == role


def _proc(pid, user, system, threads=None, ct=1.0):
    th = None if threads is None else {
        tid: cb.ThreadTimes(tid, name, u, s) for tid, (name, u, s) in threads.items()}
    return cb.ProcTimes(pid, ct, user, system, th)


def test_breakdown_per_token_with_threads_and_missing_processes():
    before = cb.Snapshot(10.0, {
        "rank_0": _proc(100, 1.0, 0.5, {100: ("python", 0.8, 0.2), 101: ("python", 0.2, 0.3)}),
        "gateway": _proc(200, 2.0, 0.0),
        "reaper": _proc(300, 0.0, 0.0),
        "supervisor": _proc(400, 0.0, 0.0),
        "bench_client": _proc(500, 0.0, 0.0),
    }, machine_busy=100.0)
    after = cb.Snapshot(12.0, {
        # +2.0 s: main +1.5 s, 101 +0.2 s, new 102 +0.2 s, 0.1 s from a thread that ended
        "rank_0": _proc(100, 2.8, 0.7, {100: ("python", 2.2, 0.3), 101: ("python", 0.3, 0.4),
                                        102: ("ZMQbg/IO/0", 0.1, 0.1)}),
        "gateway": _proc(200, 2.1, 0.1),
        "reaper": "pid 300 no longer exists",
        "supervisor": _proc(401, 0.0, 0.0, ct=5.0),
        "bench_client": _proc(500, 1.0, 0.0),
    }, machine_busy=104.0)
    bd = cb.breakdown(before, after, tokens=1000)
    r0 = bd["processes"]["rank_0"]
    assert (r0["user"], r0["system"], r0["total"]) == (1800.0, 200.0, 2000.0)
    th = r0["threads"]
    assert th["busiest_thread"] == 1500.0 and th["other_threads"] == 400.0
    assert th["python_main_thread"] == 1500.0
    assert th["ended_or_rounding"] == 100.0
    assert th["busiest"][0] == {"tid": 100, "os_name": "python", "is_initial_thread": True,
                                "user": 1400.0, "system": 100.0, "total": 1500.0}
    assert th["other_by_os_name"] == {"python": 200.0, "ZMQbg/IO/0": 200.0}
    assert bd["processes"]["gateway"]["total"] == 200.0
    assert bd["processes"]["gateway"]["threads"] is None
    assert bd["processes"]["reaper"] is None and bd["processes"]["supervisor"] is None
    assert bd["missing"]["reaper"] == "pid 300 no longer exists"
    assert "replaced by pid 401" in bd["missing"]["supervisor"]
    assert bd["deployment_total"] is None  # a process is unmeasured: no total pretends
    assert bd["machine_busy"] == 4000.0 and bd["window_s"] == 2.0
    assert bd["machine_busy_fraction"] == round(4.0 / (2.0 * os.cpu_count()), 3)
    c = cb.compact(bd)
    assert c["rank_0"] == {"total": 2000.0, "user": 1800.0, "system": 200.0,
                           "busiest_thread": 1500.0, "python_main_thread": 1500.0,
                           "other_threads": 400.0}
    assert c["reaper"] is None

    del before.procs["reaper"], before.procs["supervisor"]
    del after.procs["reaper"], after.procs["supervisor"]
    # bench_client's 1000 µs is outside the deployment
    assert cb.breakdown(before, after, tokens=1000)["deployment_total"] == 2200.0


def test_the_busy_thread_of_a_real_process_is_found():
    code = ("import threading, time\n"
            "def spin():\n"
            "    end = time.monotonic() + 30\n"
            "    while time.monotonic() < end: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\n"
            "print('go', flush=True)\n"
            "time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "go"
        before = cb.snapshot(lambda: cb.tree_roles(child.pid, "spinner"))
        used = before.procs["spinner"].user
        poll_for(lambda: psutil.Process(child.pid).cpu_times().user - used >= 0.3, 20,
                 "the spinning thread to use 0.3 s of CPU")
        after = cb.snapshot(lambda: cb.tree_roles(child.pid, "spinner"))
        th = cb.breakdown(before, after, tokens=1)["processes"]["spinner"]["threads"]
        assert th["busiest"][0]["is_initial_thread"] is False  # the spinner, not main
        assert th["busiest_thread"] >= 0.25e6 and th["other_threads"] < th["busiest_thread"] / 4
        assert th["python_main_thread"] < th["busiest_thread"] / 4
    finally:
        child.kill()
        child.wait(10)
    bd = cb.breakdown(before, cb.snapshot(lambda: {"spinner": child.pid}), tokens=1)
    assert bd["processes"]["spinner"] is None
    assert bd["missing"]["spinner"] == f"pid {child.pid} no longer exists"
