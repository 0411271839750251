"""One supervisor per state home, as real processes: a second `lockstep supervisor` on
the same home exits at once with a sentence naming the first (pid, admin endpoint) and
touches nothing; after the first is SIGKILLed, a new one starts (no stale lock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.support.processes import REPO, lockstep_env, process_gone
from tests.support.supervisor import ensure_key, poll_for, runtime_names, supervisor_argv


def _start(home) -> subprocess.Popen:
    return subprocess.Popen(supervisor_argv(home, "--log-level", "WARNING"), cwd=REPO,
                            env=lockstep_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.timeout(90)
def test_a_second_supervisor_on_the_same_home_is_refused(tmp_path):
    home = tmp_path / "home"
    ensure_key(home)
    runtime = home / "runtime" / "supervisor.json"
    first = _start(home)
    try:
        poll_for(lambda: runtime_names(runtime, first), 30, "the first supervisor's runtime file")
        before = runtime.read_bytes()
        second = _start(home)
        out, err = second.communicate(timeout=30)
        assert second.returncode == 2, (out, err)
        assert f"another supervisor is running for {home}" in err
        assert f"pid {first.pid}" in err and json.loads(before)["admin"] in err
        assert "Traceback" not in err
        assert runtime.read_bytes() == before  # the first one's file, untouched
        assert first.poll() is None

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        poll_for(lambda: process_gone(first.pid), 10, "the first supervisor gone")
        third = _start(home)  # the kernel dropped the lock with its holder
        try:
            poll_for(lambda: runtime_names(runtime, third), 30, "the third supervisor's file")
        finally:
            third.send_signal(signal.SIGTERM)
            third.communicate(timeout=30)
        assert third.returncode == 0
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
