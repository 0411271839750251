"""Benchmarks (DESIGN.md §11). Each module defines `run(out_dir) -> dict`, writes
`<out_dir>/<name>.json` and is runnable on its own (`python -m bench.<name>`);
`python -m bench [NAME ...]` runs them all (or the named ones) and prints a summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(out_dir: Path | str | None, name: str, result: dict[str, Any]) -> Path:
    """Write `<out_dir>/<name>.json` atomically (temp file + rename)."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = out / f".{name}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
