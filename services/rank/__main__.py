"""`python -m services.rank --spec FILE`: one MLX rank, started by a launcher.

The launcher (the supervisor, or tests/e2e/rank_harness.py) provides:
- FILE: a RankSpec JSON (common/rankspec.py, mode 0600) naming the deployment, rank,
  model, endpoints, `secret_path` (the launch secret, 0600) and RankSettings;
- MLX_RANK and MLX_HOSTFILE in the environment for a distributed backend, plus
  `common.rank_env.rank_environment(settings, base_env)` (buffer limits, OpenBLAS);
- a control PUB and a report ROUTER already bound at the spec's endpoints, publishing
  LEASE (the rank loads only after it saw one) and, after every RANK_READY, SERVE.

Exit codes: 0 clean (SHUTDOWN, SIGTERM/SIGINT), 1 failed closed (marker says why),
2 bad arguments or unreadable spec, 3 the signal escape hatch fired.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.rank", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, type=Path, help="RankSpec JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LOCKSTEP_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s rank[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from common.home import StateFileError
    from common.rankspec import RankSpec
    from common.schema import SchemaError

    try:
        spec = RankSpec.load(args.spec)
    except (StateFileError, SchemaError, OSError) as exc:
        print(f"rank: cannot read spec {args.spec}: {exc}", file=sys.stderr)
        return 2
    from services.rank.limits import keep_fd_limit

    with keep_fd_limit():  # importing mlx_lm lowers RLIMIT_NOFILE (services/rank/limits.py)
        from services.rank.boot import run

    run(spec)  # never returns: every path ends in RankRuntime.exit
    return 1


if __name__ == "__main__":
    sys.exit(main())
