"""`python -m bench [NAME ...] [--out DIR] [--timeout S]` — run the benchmarks.

Every module in `bench/` that defines a top-level `run(out_dir)` is a benchmark (found
without importing it). Each runs in its own process group, so one that crashes, hangs
past `--timeout` or leaves processes behind cannot stop the others; its result dict is
written to `<out>/<name>.json`. A summary is printed at the end; the exit status is 1
if any benchmark failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import RESULTS, write_result

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def discover() -> list[str]:
    """Module names in bench/ with a top-level `def run(...)`, sorted."""
    names = []
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            names.append(path.stem)  # let the run report the error
            continue
        if any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run"
               for node in tree.body):
            names.append(path.stem)
    return names


def run_one(name: str, out_dir: Path) -> int:
    """In the child: import bench.<name>, call run(out_dir), write its JSON."""
    import importlib

    try:
        module = importlib.import_module(f"bench.{name}")
        run = getattr(module, "run", None)
        if not callable(run):
            print(f"bench.{name} has no run(out_dir)", file=sys.stderr)
            return 2
        result = run(out_dir)
        if isinstance(result, dict):
            write_result(out_dir, name, result)
        return 0
    except Exception:  # noqa: BLE001 - report any failure, the parent continues
        traceback.print_exc()
        return 1


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(10)


def launch(name: str, out_dir: Path, timeout: float | None) -> dict[str, Any]:
    """In the parent: run one benchmark in its own session and collect its outcome."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    path = out_dir / f"{name}.json"
    before = path.stat().st_mtime if path.exists() else None
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench", "--one", name, "--out", str(out_dir)],
                            cwd=REPO, env=env, start_new_session=True)
    status = "ok"
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        status, rc = "timeout", None
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    finally:
        _kill_group(proc)  # whatever it left behind in its process group goes too
    if status == "ok" and rc != 0:
        status = f"failed (exit {rc})"
    outcome: dict[str, Any] = {"name": name, "status": status,
                               "seconds": round(time.monotonic() - t0, 1)}
    if status == "ok" and path.exists() and path.stat().st_mtime != before:
        try:
            outcome["result"] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            outcome["status"] = f"failed (unreadable {path.name}: {exc})"
    elif status == "ok":
        outcome["status"] = f"failed (no {path.name} written)"
    return outcome


def headline(result: dict[str, Any] | None) -> str:
    if not result:
        return ""
    if isinstance(result.get("summary"), str):
        return result["summary"]
    scalars = [f"{k}={v}" for k, v in result.items() if isinstance(v, int | float | str | bool)]
    return ", ".join(scalars[:6])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run in this process
    args = ap.parse_args(argv)
    out_dir = args.out.resolve()
    if args.one:
        return run_one(args.one, out_dir)
    found = discover()
    if args.list:
        print("\n".join(found))
        return 0
    unknown = [n for n in args.names if n not in found]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; found: {', '.join(found) or 'none'}",
              file=sys.stderr)
        return 2
    outcomes = []
    for name in args.names or found:
        print(f"== bench {name}", flush=True)
        outcomes.append(launch(name, out_dir, args.timeout))
    print("\n== summary")
    width = max((len(o["name"]) for o in outcomes), default=4)
    swidth = max((len(o["status"]) for o in outcomes), default=2)
    for o in outcomes:
        print(f"{o['name']:<{width}}  {o['status']:<{swidth}}  {o['seconds']:>7.1f}s  "
              f"{headline(o.get('result'))}")
    print(f"results in {out_dir}")
    return 0 if all(o["status"] == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
