"""A stand-in service (and launcher) for the launcher-watch tests: real processes, real
signals, no Lockstep service around them.

    python -m tests.fakes.launcher_child serve INTERVAL RESEND HARD_EXIT handle|ignore
        watch LOCKSTEP_LAUNCHER (common.launcher_watch); print "watching" then, on
        SIGTERM, "term" and exit 0 (handle) or ignore every SIGTERM (ignore: only the
        hard exit ends it)
    python -m tests.fakes.launcher_child launch INTERVAL RESEND HARD_EXIT handle|ignore
        the launcher: start `serve` as its child from its main thread, with its own
        identity in LOCKSTEP_LAUNCHER; print the child's pid, then wait forever
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from common.launcher_watch import LAUNCHER_ENV, WatchSettings, launcher_value, watch_launcher
from common.procs import identify


def serve(settings: WatchSettings, mode: str) -> int:
    done = threading.Event()

    def on_term(signum, frame) -> None:
        if mode == "handle":
            print("term", flush=True)
            done.set()

    signal.signal(signal.SIGTERM, on_term)
    watch = watch_launcher("fake", settings=settings)
    print("watching" if watch is not None else "nothing to watch", flush=True)
    while not done.wait(0.05):
        pass
    return 0


def launch(argv: list[str]) -> int:
    env = {**os.environ, LAUNCHER_ENV: launcher_value(identify(os.getpid()))}
    child = subprocess.Popen([sys.executable, "-m", "tests.fakes.launcher_child", "serve", *argv],
                             env=env, stdout=sys.stdout, start_new_session=True)
    print(child.pid, flush=True)
    threading.Event().wait()
    return 0


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "launch":
        return launch(rest)
    interval, resend, hard = map(float, rest[:3])
    return serve(WatchSettings(interval, resend, hard), rest[3])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
