"""The append-only record of what each rank removed from its batch, and when.

`runtime/markers/<deployment>/rank-<r>.removals.jsonl`, one JSON object per line:

    {"request_id", "uid", "step", "reason", "at", "n_tokens", "tokens_sha"}

`reason` is the plan's remove reason (abort, cancel, shutdown, ...) or the model's
finish (stop, length). `step` is the step the removal precedes (plan removes) or the
step that produced the last token (model finishes); it is the same on every rank.
`tokens_sha` is `token_digest` of the tokens the request emitted on this rank, so tests
and incident forensics can compare ranks without storing whole completions.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from common.home import Paths, marker_dir


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()[:32]


def removals_path(paths: Paths, deployment_id: str, rank: int) -> Path:
    return marker_dir(paths, deployment_id) / f"rank-{rank}.removals.jsonl"


def read_removals(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


class RemovalLog:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def append(self, request_id: str, uid: int, step: int, reason: str, tokens: list[int]) -> None:
        rec = {"request_id": request_id, "uid": uid, "step": step, "reason": reason,
               "at": time.time(), "n_tokens": len(tokens), "tokens_sha": token_digest(tokens)}
        # One write per record with O_APPEND: a line is never interleaved or torn.
        os.write(self._fd, (json.dumps(rec, sort_keys=True) + "\n").encode())

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
