"""`lockstep up`'s output never stops it (services/up/console.py): a stdout whose reader
is gone (EPIPE) is silenced after the first failure, and the log file still gets every
message."""

from __future__ import annotations

import io
import os
import sys

from services.up.console import UpConsole


def test_a_dead_pipe_is_silenced_and_the_log_keeps_everything(tmp_path, monkeypatch):
    r, w = os.pipe()
    os.close(r)  # the reader is gone: the next write is EPIPE (SIGPIPE is ignored by Python)
    dead = io.TextIOWrapper(io.FileIO(w, "w"), write_through=False)
    monkeypatch.setattr(sys, "stdout", dead)
    console = UpConsole(tmp_path / "up.log")
    console.say("lockstep up: stopping")
    console.say("two\nlines")
    assert console.broken == {"stdout"}
    dead.write("later writes (the exit-time flush) go to /dev/null\n")
    dead.flush()
    lines = (tmp_path / "up.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["lockstep up: stopping", "two", "lines"]
    assert (tmp_path / "up.log").stat().st_mode & 0o777 == 0o600
    dead.close()


def test_no_stderr_at_all_and_no_writable_log_still_do_not_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)
    console = UpConsole(tmp_path / "no-such-dir" / "up.log")
    console.say("lockstep up: NOT verified", err=True)
    assert console.broken == {"stderr"}
    sys.stderr.write("a library's message\n")  # replaced by /dev/null, not None
    sys.stderr.close()
