"""The teardown after a rank is lost while serving (services/supervisor/after_failure.py),
against real fake-rank processes: an attempt that cannot prove the exit (a rank whose
signals vanish, the kill seam) is recorded and retried while the state stays `failed`,
and proven once it can be; an attempt that raises is logged with its traceback and
retried, never lost with the state stuck in `failed` and nothing done."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest

from common.home import Paths, manifest_path
from common.procs import ProcessIdentity
from services.supervisor.after_failure import attempt_deadline
from services.supervisor.teardown import TeardownSeams
from tests.support.supervisor import pid_gone, poll_for


def _dep(rs, dep_id: str) -> dict:
    return next(d for d in rs.ok("deployments")["deployments"] if d["deployment_id"] == dep_id)


def _failures(home, job_id: str) -> list[str]:
    try:
        return json.loads(manifest_path(Paths(home), job_id).read_text())["teardown_failures"]
    except (OSError, ValueError, KeyError):
        return []


def _really_kill(target, sig) -> None:
    pid = target.pid if isinstance(target, ProcessIdentity) else target
    (os.kill if isinstance(target, ProcessIdentity) else os.killpg)(pid, sig)


def _lose_rank0(rs, dep_id: str) -> list[int]:
    pids = [r["pid"] for r in _dep(rs, dep_id)["ranks"]]
    os.kill(pids[0], signal.SIGKILL)
    poll_for(lambda: _dep(rs, dep_id)["state"] != "serving", 10, "the monitor to notice")
    return pids


def _proven_without_a_stop(rs, home, dep_id: str, job_id: str, pids: list[int]) -> None:
    poll_for(lambda: not manifest_path(Paths(home), job_id).exists(), 30,
             "the teardown after the failure to be proven")
    dep = _dep(rs, dep_id)
    assert dep["state"] == "failed" and dep["teardown"]["proven"], dep
    assert all(pid_gone(p) for p in pids)
    rs.ok("stop", deployment_id=dep_id)  # a failed deployment is removed by stop
    assert rs.ok("deployments")["deployments"] == []


@pytest.mark.timeout(60)
def test_unproven_attempts_are_retried_until_proven(start_supervisor, home, model_dir,
                                                    monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "1")  # rank 1 waits for a signal
    blocked: set[int] = set()

    def kill(target, sig):  # the seam: signals to a blocked pid (or its group) vanish
        pid = target.pid if isinstance(target, ProcessIdentity) else target
        if pid not in blocked:
            _really_kill(target, sig)

    rs = start_supervisor(seams=TeardownSeams(kill=kill), graceful_timeout=0.3,
                          stop_timeout=0.3, kill_timeout=0.3)
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="lost")
    blocked.add(_dep(rs, "lost")["ranks"][1]["pid"])
    pids = _lose_rank0(rs, "lost")
    poll_for(lambda: len(_failures(home, out["job_id"])) >= 2, 30,
             "two unproven attempts recorded in the manifest")
    dep = _dep(rs, "lost")
    assert dep["state"] == "failed" and not dep["teardown"]["proven"], dep  # still trying
    assert not pid_gone(pids[1])
    blocked.clear()  # the host is reachable again: the next attempt proves it
    _proven_without_a_stop(rs, home, "lost", out["job_id"], pids)


@pytest.mark.timeout(60)
def test_an_attempt_that_raises_is_logged_and_retried(start_supervisor, home, model_dir,
                                                      monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="lockstep.supervisor")
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "1")  # the ladder runs for rank 1
    raised: list[int] = []

    def kill(target, sig):  # the seam: the first signal blows up, as a bug would
        if not raised:
            raised.append(sig)
            raise RuntimeError("kill seam exploded")
        _really_kill(target, sig)

    rs = start_supervisor(seams=TeardownSeams(kill=kill), graceful_timeout=0.3,
                          stop_timeout=0.3, kill_timeout=0.3)
    out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="boom")
    pids = _lose_rank0(rs, "boom")
    _proven_without_a_stop(rs, home, "boom", out["job_id"], pids)
    assert raised
    logged = [r for r in caplog.records if "teardown after the failure raised" in r.getMessage()]
    assert logged and logged[0].exc_info and "kill seam exploded" in str(logged[0].exc_info[1])


@pytest.mark.timeout(90)
def test_an_attempt_that_stalls_is_cut_at_its_deadline_and_retried(start_supervisor, home,
                                                                   model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAKE_IGNORE_SIGTERM", "1")  # the ladder runs for rank 1
    release = threading.Event()
    stalled: list[float] = []

    def sleep(seconds: float) -> None:  # the seam: the first ladder wait hangs, as a stalled
        if not stalled:                 # ssh would
            stalled.append(seconds)
            release.wait(120)
        time.sleep(seconds)

    rs = start_supervisor(seams=TeardownSeams(sleep=sleep), graceful_timeout=0.3,
                          stop_timeout=0.3, kill_timeout=0.3, ssh_connect_timeout=1.0)
    try:
        out = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="stall")
        t0 = time.monotonic()
        pids = _lose_rank0(rs, "stall")
        _proven_without_a_stop(rs, home, "stall", out["job_id"], pids)
        took = time.monotonic() - t0
        assert stalled and not release.is_set()  # proven while the first attempt hangs
        assert took < attempt_deadline(rs.sup.settings) + 15, took
    finally:
        release.set()
