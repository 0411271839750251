"""`lockstep up`'s output: every message to $LOCKSTEP_HOME/runtime/logs/up.log and to the
terminal, and a write that fails never stops `up` (DESIGN 1: a stop never depends on a
writable stdout or terminal).

The terminal may be gone while `up` is stopping: a closed window (SIGHUP, then EIO on
the tty), `lockstep up | tee` after Ctrl-C (tee died first: EPIPE). The first failed
write to a stream points its descriptor at /dev/null, so nothing later (a print, the
interpreter's flush at exit) can fail on it again; the log file still gets everything.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TextIO


class UpConsole:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.broken: set[str] = set()  # "stdout" / "stderr": what failed once

    def say(self, text: str, *, err: bool = False) -> None:
        """One message (may span lines) to the log and to stdout (or stderr)."""
        self._to_log(text)
        self._to_stream("stderr" if err else "stdout", text)

    def log_only(self, text: str) -> None:
        self._to_log(text)

    def redraw(self, text: str) -> None:
        """Raw text to stdout, no newline added, not logged (up_progress's live line)."""
        if "stdout" in self.broken:
            return
        stream = sys.stdout
        try:
            if stream is None:
                raise OSError("closed")
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            self.broken.add("stdout")
            self._silence("stdout", stream)

    def is_tty(self) -> bool:
        try:
            return sys.stdout is not None and sys.stdout.isatty()
        except (OSError, ValueError):
            return False

    def _to_log(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        lines = "".join(f"{stamp} {line}\n" for line in text.strip("\n").splitlines() or [""])
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(lines)
        except OSError:
            pass  # a full disk must not stop a stop either

    def _to_stream(self, name: str, text: str) -> None:
        if name in self.broken:
            return
        stream: TextIO | None = getattr(sys, name)
        try:
            if stream is None:
                raise OSError("closed")
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):  # EPIPE, EIO (hung-up tty), closed file
            self.broken.add(name)
            self._silence(name, stream)

    def _silence(self, name: str, stream: TextIO | None) -> None:
        """Point the stream's descriptor at /dev/null: its buffered bytes and every
        later write (ours, a library's, the exit-time flush) go nowhere, quietly."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()  # now into /dev/null: drops what the failed write left buffered
        if stream is None or stream.closed:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as we do
