"""One rank of a 2-process sharded greedy generation over MLX's real ring backend.

    MLX_RANK=r MLX_HOSTFILE=hosts.json python tests/e2e/ring_sharded_check.py DIR tp|pp OUT

hosts.json is `[["127.0.0.1:P0"], ["127.0.0.1:P1"]]`. Both ranks generate; rank 0 writes
the token ids to OUT as JSON. A rank blocks forever if its peer never starts, so callers
must run it under a deadline and kill it.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

PROMPT = "Tell me a short story about a cat."
MAX_TOKENS = 16


def greedy_ids(model, tokenizer, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy (argmax) token ids; the same function serves single-process references."""
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]


def main(argv: list[str]) -> int:
    from mlx_lm.utils import sharded_load

    model_dir, mode, out_path = argv
    if mode not in ("tp", "pp"):
        print(f"mode must be tp or pp, not {mode!r}", file=sys.stderr)
        return 2
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != 2:
        print(f"expected 2 ranks, got {group.size()}", file=sys.stderr)
        return 2
    kind = "pipeline_group" if mode == "pp" else "tensor_group"
    model, tokenizer = sharded_load(model_dir, **{kind: group})
    ids = greedy_ids(model, tokenizer)
    # generate_step has already queued the step after the last token; it talks to the
    # peer, so drain it and meet the peer before exiting, or the peer's step fails.
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "size": group.size(), "tokens": ids}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
