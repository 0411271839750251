"""Supervisor restart + adoption (issue 44), tiny preset at TP=2 under one `lockstep up`:

TRIALS times: STREAMS streams decoding (temperature 0, logprobs, no EOS), the supervisor
SIGKILLed once every stream has its first tokens, then measured from outside:

- `to_admin_s`: from the SIGKILL until `admin status` (through the gateway's admin API,
  503 `supervisor_restarting` meanwhile) answers from a new supervisor with the same
  deployment serving — the restart plus the adoption's proof;
- `adopt_took_s`: the new supervisor's own figure for the proof (its `adopted` event);
- `to_new_request_s`: from the SIGKILL until a new request (1 token) completes — the data
  path (gateway → rank 0) never passes through the supervisor;
- `gap_s`: the longest gap between two tokens of any stream spanning the kill, against
  the same streams' longest gap in the unfaulted run before it (`baseline_gap_s`);
- whether every stream's tokens and logprobs equal the unfaulted run's.

Settings in the JSON. `--restart-backoff 0`: consecutive restarts 10 s apart would
otherwise measure the doubling backoff (2 s, 4 s, ... by default), not the restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import httpx

from bench.servers import environment_record, free_port

REPO = Path(__file__).resolve().parents[1]
TRIALS, STREAMS, TOKENS = 10, 2, 400
NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: every stream runs to TOKENS
UP_ARGS = ("--model", "tiny", "--tp", "2", "--supervisor-restarts", str(TRIALS + 2),
           "--restart-backoff", "0", "--adopt-window", "30")


def stream(url: str, prompt: str, first: threading.Event | None = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "stream": True, "logprobs": 1, "logit_bias": NO_EOS}
    toks, lps, times = [], [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])["choices"][0]
            if c.get("logprobs") and c["logprobs"]["tokens"]:
                times.append(time.monotonic())
                toks += c["logprobs"]["tokens"]
                lps += c["logprobs"]["token_logprobs"]
                if first is not None:
                    first.set()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"tokens": toks, "logprobs": lps, "times": times, "max_gap": max(gaps, default=0.0)}


class Up:
    def __init__(self, home: Path) -> None:
        self.home, port = home, free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.out = home / "up.out"
        home.mkdir(parents=True)
        argv = [sys.executable, "-m", "services", "up", "--home", str(home), "--port", str(port),
                "--admin-port", "0", "--events-port", "0", "--control-port", "0",
                "--report-port", "0", "--reaper-events-port", "0", *UP_ARGS]
        self._log = open(self.out, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.monotonic()
        while "Press Ctrl-C" not in self.out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() - t0 > 600:
                self.stop()
                raise RuntimeError(f"up did not serve: {self.out.read_text()[-2000:]}")
            time.sleep(0.1)
        self.hdr = {"Authorization": "Bearer " + (home / "admin.token").read_text().strip()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def supervisor_pid(self) -> int:
        return json.loads((self.home / "runtime" / "supervisor.json").read_text())["pid"]

    def status(self) -> httpx.Response:
        return httpx.get(self.url + "/admin/api/cluster/status", headers=self.hdr, timeout=10)


def trial(up: Up, k: int, unfaulted: list[dict]) -> dict:
    old = up.supervisor_pid()
    got: list[dict | None] = [None] * STREAMS
    firsts = [threading.Event() for _ in range(STREAMS)]

    def run(i: int) -> None:
        got[i] = stream(up.url, f"stream {i}", firsts[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for e in firsts:
        e.wait(120)
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    to_new = None
    while to_new is None and time.monotonic() - t_kill < 120:
        r = httpx.post(up.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"probe {k}", "max_tokens": 1})
        if r.status_code == 200:
            to_new = time.monotonic() - t_kill
    to_admin, took = None, None
    while time.monotonic() - t_kill < 180:
        r = up.status()
        if r.status_code == 200:
            body = r.json()
            sup = body.get("supervisor") or {}
            deps = [d for d in body.get("deployments", []) if d["state"] == "serving"]
            if sup.get("pid") not in (None, old) and deps:
                to_admin = time.monotonic() - t_kill
                took = next((e["data"].get("took_s") for e in reversed(body.get("events", []))
                             if e["name"] == "adopted"), None)
                break
        time.sleep(0.02)
    for t in threads:
        t.join(300)
    spanning = [g for g in got if g is not None and g["times"] and g["times"][-1] > t_kill]
    return {"trial": k, "to_admin_s": None if to_admin is None else round(to_admin, 3),
            "adopt_took_s": None if took is None else round(took, 3),
            "to_new_request_s": None if to_new is None else round(to_new, 3),
            "gap_s": round(max((g["max_gap"] for g in spanning), default=0.0), 3),
            "streams_spanning_kill": len(spanning),
            "identical": all(g is not None and g["tokens"] == u["tokens"]
                             and g["logprobs"] == u["logprobs"] for g, u in zip(got, unfaulted,
                                                                               strict=True))}


def run(out_dir: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-adopt-") as tmp:
        up = Up(Path(tmp) / "home")
        try:
            unfaulted = [stream(up.url, f"stream {i}") for i in range(STREAMS)]
            # the baseline gap: the same streams together, nothing killed
            both: list[dict | None] = [None] * STREAMS
            ts = [threading.Thread(target=lambda i=i: both.__setitem__(i, stream(
                up.url, f"stream {i}")), daemon=True) for i in range(STREAMS)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(300)
            baseline_gap = max(g["max_gap"] for g in both if g is not None)
            trials = [trial(up, k, unfaulted) for k in range(TRIALS)]
            up_running = up.proc.poll() is None
        finally:
            up.stop()
    ok = [t for t in trials if t["to_admin_s"] is not None]
    return {
        "bench": "supervisor_adoption",
        "settings": {"model": "tiny", "tp": 2, "trials": TRIALS, "streams": STREAMS,
                     "max_tokens": TOKENS, "temperature": 0, "up_args": list(UP_ARGS)},
        "median_to_admin_s": round(median(t["to_admin_s"] for t in ok), 3) if ok else None,
        "median_adopt_took_s": round(median(t["adopt_took_s"] for t in ok
                                            if t["adopt_took_s"] is not None), 3) if ok else None,
        "median_to_new_request_s": round(median(t["to_new_request_s"] for t in trials
                                                if t["to_new_request_s"] is not None), 3),
        "max_gap_s": max(t["gap_s"] for t in trials),
        "baseline_gap_s": round(baseline_gap, 3),
        "gap_ratio": round(max(t["gap_s"] for t in trials) / baseline_gap, 2)
        if baseline_gap else None,
        "all_identical": all(t["identical"] for t in trials),
        "adopted": len(ok), "up_running_after": up_running,
        "trials": trials,
        "environment": environment_record(),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
