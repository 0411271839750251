"""A closed terminal that sends `up` no SIGHUP. The kernel hangs up a terminal by
signalling only its session's leader; when that leader is not a shell that passes the
SIGHUP on to its jobs but, say, `make` (`ssh -t host make up`, `script -c "make up"`),
it waits for its children and `up` hears nothing. So `up` watches the terminal itself:
a hung-up tty reports POLLHUP on every descriptor open on it, and that is a stop, the same
as SIGHUP."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def _tty_fd() -> int | None:
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return fd
        except OSError:
            continue
    return None


def watch_terminal(on_hangup: Callable[[], None]) -> threading.Thread | None:
    """Call `on_hangup` once, from a daemon thread, when the terminal on stdin, stdout or
    stderr (the first that is one) hangs up; None when none of them is a terminal."""
    fd = _tty_fd()
    if fd is None:
        return None
    own = os.dup(fd)  # ours: the console may close or replace sys.stdout meanwhile

    def run() -> None:
        p = select.poll()
        p.register(own, 0)  # no events asked: only hang-up and errors wake it (0 % CPU)
        while True:
            if any(ev & GONE for _, ev in p.poll()):
                on_hangup()
                return

    t = threading.Thread(target=run, name="terminal-watch", daemon=True)
    t.start()
    return t
