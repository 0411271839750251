"""How long a split the model cannot take costs the user, refused before anything starts.

`lockstep up --tp 2` on a model with 9 heads used to load every rank and then fail the
canary inside MLX's attention; now `up` reads config.json and exits at once
(services/supervisor/topology.py). Measured here, on the random-weight presets whose
shapes refuse tp=3 (tiny: 4 heads; bench: 16 heads): the wall time of the refused
`lockstep up` against the wall time of an accepted one until its banner (load, barrier,
canary), in the same run. The accepted start is what the refusal used to cost at least.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench.servers import free_port

REPO = Path(__file__).resolve().parents[1]
REFUSALS = 5


def _argv(home: Path, model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "services", "up", "--home", str(home), "--model",
            str(model), "--port", str(free_port()), "--admin-port", "0", "--events-port", "0",
            "--control-port", "0", "--report-port", "0", "--reaper-events-port", "0", *extra]


def _refused(home: Path, model: Path, tp: int) -> tuple[float, str]:
    t0 = time.monotonic()
    out = subprocess.run(_argv(home, model, "--tp", str(tp)), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    took = time.monotonic() - t0
    if out.returncode != 1 or "valid:" not in out.stderr:
        raise RuntimeError(f"expected a refusal, got {out.returncode}: {out.stderr[-500:]}")
    return took, out.stderr.strip().splitlines()[-1]


def _accepted(home: Path, model: Path, tp: int) -> float:
    """Seconds until `lockstep up --tp N` prints its banner (then stopped with Ctrl-C)."""
    log = home / "up.out"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(_argv(home, model, "--tp", str(tp)), cwd=REPO, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = t0 + 600
        while "Press Ctrl-C" not in log.read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"up did not serve: {log.read_text()[-1500:]}")
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: anything it left
            p.wait(10)


def run(out_dir: Path) -> dict:
    from models.tinymodel import build_model

    rows = {}
    with tempfile.TemporaryDirectory(prefix="ls-topo-") as tmp:
        for preset in ("tiny", "bench"):
            model = build_model(Path(tmp) / "models" / preset, preset=preset)
            home = Path(tmp) / f"home-{preset}"
            times, said = [], ""
            for _ in range(REFUSALS):
                took, said = _refused(home, model, 3)
                times.append(took)
            served = _accepted(home, model, 2)
            rows[preset] = {"refused_tp3_s_median": round(median(times), 3),
                            "refused_tp3_s": [round(t, 3) for t in times],
                            "message": said, "accepted_tp2_until_banner_s": round(served, 2),
                            "ratio_refusal_to_accepted_start": round(median(times) / served, 4)}
    return {"what": "lockstep up with a tp the model cannot take: refused before anything "
                    "starts (wall time of the whole command, Python start-up included) vs an "
                    "accepted start until its banner, same run",
            "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "presets": rows}
