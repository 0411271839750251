"""A stand-in launcher for watchdog tests: `python -m tests.e2e.rank_launcher PLAN`.

PLAN is a JSON list, one entry per rank: {"argv", "env", "cwd", "log"}. Each rank is
started in its own session (as the supervisor does), their pids are printed as one JSON
line on stdout, then the launcher waits for them. SIGKILL it to orphan the ranks: each
one sees its parent gone (tests/e2e/test_rank_watchdogs.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    procs = []
    for entry in plan:
        with open(entry["log"], "ab") as log:
            procs.append(subprocess.Popen(
                entry["argv"], env=entry["env"], cwd=entry["cwd"], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    print(json.dumps([p.pid for p in procs]), flush=True)
    for p in procs:
        p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
