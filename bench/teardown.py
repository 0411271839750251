"""Verified teardown time of a TP=2 deployment (DESIGN.md §11): obedient real MLX ranks
(graceful shutdown ends it), and SIGTERM-ignoring fake ranks (they ignore the control
shutdown and SIGTERM too, so the ladder runs to SIGKILL). Median and max over runs of the
supervisor's own measurement (graceful → ... → proof of exit), plus the admin round trip.

    python -m bench.teardown [--runs N]   → bench/results/teardown.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import write_result
from common.keys import generate_key_file, load_cluster_key
from services.admin.cli import AdminClient
from services.supervisor.settings import SupervisorSettings

FAKE_RANK = f"{sys.executable} -m tests.fakes.fake_rank"


class _Supervisor:
    """A real supervisor (port-0 sockets) on its own event loop thread."""

    def __init__(self, settings: SupervisorSettings, rank_env: dict[str, str] | None = None):
        from services.supervisor.service import Supervisor

        key = settings.home / "keys" / "cluster.key"
        if not key.exists():
            generate_key_file(key)
        self.loop = asyncio.new_event_loop()
        self.sup = Supervisor(settings, rank_env=rank_env)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.sup.start())
            ready.set()
            self.loop.run_until_complete(self.sup.wait_closed())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not ready.wait(60):
            raise RuntimeError("supervisor did not start")
        self.client = AdminClient(self.sup.sockets.admin_endpoint, load_cluster_key(key))

    def ok(self, command: str, timeout: float = 300.0, **args: Any) -> dict[str, Any]:
        reply = self.client.call(command, timeout, **args)
        if not reply.ok:
            raise RuntimeError(f"{command}: {reply.code}: {reply.message}")
        return reply.data

    def close(self) -> None:
        self.client.close()
        asyncio.run_coroutine_threadsafe(self.sup.close(), self.loop).result(120)
        self.thread.join(30)
        self.loop.close()


def _measure(sup: _Supervisor, runs: int, model_path: str | None) -> dict[str, Any]:
    samples = []
    for i in range(runs):
        sup.ok("deploy", model_path=model_path, tp=2, deployment_id=f"bench-{i}")
        t0 = time.perf_counter()
        out = sup.ok("stop", deployment_id=f"bench-{i}")["outcome"]
        wall = time.perf_counter() - t0
        if not out["proven"]:
            raise RuntimeError(f"teardown not proven: {out}")
        samples.append({"teardown_s": out["duration_s"], "stop_call_s": round(wall, 4),
                        "path": out["path"]})
    durations = [s["teardown_s"] for s in samples]
    return {"runs": runs, "median_s": round(statistics.median(durations), 4),
            "max_s": round(max(durations), 4), "min_s": round(min(durations), 4),
            "paths": sorted({" -> ".join(s["path"]) for s in samples}), "samples": samples}


def run(out_dir: Path | str | None = None, runs: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-teardown-") as tmp:
        home = Path(tmp) / "home"
        base = SupervisorSettings(home=home, admin_port=0, events_port=0, control_port=0,
                                  report_port=0, canary_window_s=0.5)
        real = _Supervisor(replace(base, rank_command=""))
        try:
            obedient = _measure(real, runs, None)
        finally:
            real.close()
        fake_model = Path(tmp) / "fake-model"
        fake_model.mkdir()
        stubborn_sup = _Supervisor(replace(base, rank_command=FAKE_RANK),
                                   rank_env={"LOCKSTEP_FAKE_IGNORE_SIGTERM": "all"})
        try:
            stubborn = _measure(stubborn_sup, runs, str(fake_model))
        finally:
            stubborn_sup.close()
    settings = asdict(base)
    result = {
        "name": "teardown",
        "what": "verified teardown of a TP=2 deployment: graceful -> SIGTERM -> SIGKILL -> "
                "sweep -> proof of exit",
        "obedient": {"ranks": "real (services.rank, embedded tiny model, ring)", **obedient},
        "sigterm_ignoring": {"ranks": "fake (tests.fakes.fake_rank, ignores SIGTERM and "
                             "shutdown)", **stubborn},
        "settings": {k: settings[k] for k in ("graceful_timeout", "stop_timeout",
                                              "kill_timeout")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_result(out_dir, "teardown", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.teardown")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    r = run(args.out, args.runs)
    for case in ("obedient", "sigterm_ignoring"):
        c = r[case]
        print(f"{case:>17}: median {c['median_s']:.3f}s max {c['max_s']:.3f}s "
              f"over {c['runs']} runs ({', '.join(c['paths'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
