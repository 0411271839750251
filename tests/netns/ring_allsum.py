"""One rank of an `all_sum` over MLX's real ring backend (for the netns host tests).

    MLX_RANK=r MLX_HOSTFILE=hosts.json python tests/netns/ring_allsum.py OUT

hosts.json is `[["10.213.X.2:P"], ["10.213.X.3:P"]]`: each rank listens on its own entry
and connects to its neighbour's. Rank r contributes (r + 1) * [0, 1, ..., 7], so with
n ranks every rank must get n(n+1)/2 * [0, ..., 7]. Each rank writes
{"rank", "size", "result", "netns" (inode of its network namespace)} to OUT (atomically), then meets its peers once more so that
no rank exits while another is still inside the first collective. A rank blocks forever
if a peer never starts: callers run it under a deadline and kill it.
"""

from __future__ import annotations

import json
import os
import sys

import mlx.core as mx

LENGTH = 8


def expected(size: int) -> list[float]:
    return [float(size * (size + 1) // 2 * i) for i in range(LENGTH)]


def main(argv: list[str]) -> int:
    (out_path,) = argv
    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.arange(LENGTH, dtype=mx.float32) * (group.rank() + 1)
    y = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
    mx.eval(y)
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": group.rank(), "size": group.size(), "result": y.tolist(),
                   "netns": os.stat("/proc/self/ns/net").st_ino}, f)
    os.replace(tmp, out_path)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
