"""A fake rank: writes its marker, then sleeps until told to stop.

    python -m tests.fakes.sleeper_rank --home DIR --deployment D --job J --rank R

Bad behaviours, switched by environment variables (tests only):
  LOCKSTEP_FAKE_IGNORE_TERM=1  ignore SIGTERM (only SIGKILL ends it)
  LOCKSTEP_FAKE_NO_MARKER=1    never write a marker
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from common.home import Paths, write_marker
from common.procs import identify
from common.records import Phase, RankMarker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    if os.environ.get("LOCKSTEP_FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("LOCKSTEP_FAKE_NO_MARKER") != "1":
        me = identify(os.getpid())
        assert me is not None
        write_marker(Paths(args.home), RankMarker(
            deployment_id=args.deployment, job_id=args.job, rank=args.rank,
            host=socket.gethostname(), pid=me.pid, start_time=me.start_time,
            phase=Phase.SERVING, updated_at=time.time()))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
