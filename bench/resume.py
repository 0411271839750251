"""Resume (issue 28): the time from a follower rank's SIGKILL to the next token reaching
the client, split into where it goes, on the tiny and bench presets.

Per preset: `lockstep up --model <preset> --tp 2` (its own home, free ports, defaults
otherwise: peer_abort_grace 5 s, up's 1 s watch), an unfaulted reference run of STREAMS
greedy streams (EOS biased away, so each runs to max_tokens), then TRIALS faulted runs:
once every stream has streamed KILL_AFTER tokens, rank 1 of the serving deployment is
SIGKILLed; `up` tears the failed launch down with proof and redeploys, the gateway sends
each stream its continuation, and the stream goes on. Every trial's text must equal the
reference (greedy: token for token), and the gateway must count one resume per stream.

Where each instant comes from (all one host, one wall clock, time.time()):
  kill            this process, just before os.kill
  failed          the supervisor's journal: the old deployment's `state failed` event
  proven          the journal: its `teardown` event (after the failure, proven: true)
  stopped         the journal: `state stopped`, up's forced stop of the old deployment
                  (up watches its deployment once a second, then stops it, then deploys)
  loading         the journal: the new deployment's `state loading` (its ranks spawned)
  rank phases     the new ranks' logs (runtime/logs/<job>-rank<i>.log): `phase loading`
                  (the interpreter and MLX imported, the report link authenticated),
                  `phase ready` (weights loaded, warmed); the latest rank's
  canary, serving the journal: the new deployment's `state canary`, `state serving`
  resumed         the gateway's log: `request ... resumed as ... on <new deployment>`
                  (the continuation GENERATE sent), per stream
  next token      the client: per stream, the first SSE chunk after its continuation was
                  sent (chunks arriving between the kill and then were already in flight
                  from the old deployment: counted, not taken as the next token)
Phases: detection = failed - kill; teardown = stopped - failed (proof + up noticing);
redeploy = serving - stopped (launch, process start, load, canary); pickup = resumed -
serving (the gateway hears of the new deployment); re-prefill = next token - resumed.
Per trial, pickup, re-prefill and the total are the median over its streams; the phases
add up to the total, kill -> next token at the client.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from statistics import median

import httpx

from bench.servers import free_port, source_record

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"tiny": {"max_tokens": 400, "kill_after": 30},
           "bench": {"max_tokens": 200, "kill_after": 15}}
TRIALS = 3
STREAMS = 3
MSG = [{"role": "user", "content": "Count for me, slowly, and keep going."}]
PROMPTS = [MSG, [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
           [{"role": "user", "content": "List every prime you know, one per line."}]]


def _argv(home: Path, port: int, model: Path) -> list[str]:
    return [sys.executable, "-m", "services", "up", "--home", str(home), "--port", str(port),
            "--admin-port", "0", "--events-port", "0", "--control-port", "0",
            "--report-port", "0", "--reaper-events-port", "0", "--model", str(model), "--tp", "2",
            "--restarts", str(TRIALS + 3)]


class Cluster:
    def __init__(self, tmp: Path, preset: str) -> None:
        from models.tinymodel import build_model

        # a path, not the preset's name: run from the repository, `bench` is bench/
        model = build_model(tmp / "models" / preset, preset=preset)
        self.preset, self.home = preset, tmp / f"home-{preset}"
        self.out = tmp / f"up-{preset}.out"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(self.out, "wb")  # noqa: SIM115 - closed by stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(_argv(self.home, port, model), cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while "Press Ctrl-C" not in self.out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() - t0 > 900:
                self.stop()
                raise RuntimeError(f"up did not serve: {self.out.read_text()[-2000:]}")
            time.sleep(0.1)
        self.boot_s = time.monotonic() - t0
        token = (self.home / "admin.token").read_text().strip()
        self.hdr = {"Authorization": f"Bearer {token}"}
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        gen = json.loads((model / "generation_config.json").read_text())
        eos = gen["eos_token_id"]
        self.eos = eos if isinstance(eos, list) else [eos]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def get(self, path: str) -> dict:
        return httpx.get(self.url + path, headers=self.hdr, timeout=10).json()

    def serving(self) -> dict | None:
        deps = self.get("/admin/api/cluster/deployments")["deployments"]
        return next((d for d in deps if d["state"] == "serving"), None)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _stream(c: Cluster, i: int, max_tokens: int, got: dict, lock: threading.Lock) -> None:
    body = {"model": c.model, "messages": PROMPTS[i % len(PROMPTS)], "stream": True,
            "temperature": 0, "max_tokens": max_tokens,
            "logit_bias": {str(t): -100 for t in c.eos}}
    chunks: list[tuple[float, str]] = []
    got[i] = {"chunks": chunks}
    try:
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"stream error: {data['error']}")
                got[i].setdefault("id", data.get("id"))
                for ch in data["choices"]:
                    with lock:
                        chunks.append((time.time(), ch["delta"].get("content") or ""))
                    if ch.get("finish_reason"):
                        got[i]["finish"] = ch["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - recorded, judged by the caller
        got[i]["error"] = repr(exc)


def _run(c: Cluster, max_tokens: int, fault=None) -> dict:
    got: dict = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=_stream, args=(c, i, max_tokens, got, lock), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 300
        while True:
            with lock:
                counts = [len(got.get(i, {}).get("chunks", [])) for i in range(STREAMS)]
                ended = [i for i in range(STREAMS) if "finish" in got.get(i, {})]
            if ended:
                raise RuntimeError(f"streams {ended} ended before the fault")
            if min(counts) >= fault[1]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"streams never reached {fault[1]} tokens: {counts}")
            time.sleep(0.005)
        fault[0]()
    for t in threads:
        t.join(600)
    return got


def _text(got: dict) -> dict:
    return {i: ("".join(s for _, s in got[i]["chunks"]), got[i].get("finish"),
                got[i].get("error")) for i in range(STREAMS)}


def _events(c: Cluster, since: float) -> list[dict]:
    return [e for e in c.get("/admin/api/cluster/status")["events"]
            if e["at"] >= since and e["topic"] == "deployment"]


def _at(events: list[dict], dep: str, name: str, state: str | None = None) -> float | None:
    return next((e["at"] for e in events if e["deployment_id"] == dep and e["name"] == name
                 and (state is None or e["state"] == state)), None)


def d(a: float | None, b: float | None) -> float | None:
    """b - a in seconds, or None when either instant is unknown."""
    return round(b - a, 3) if a is not None and b is not None else None


LOG_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _log_lines(path: Path, pattern: str) -> list[tuple[float, str]]:
    """(wall time, line) of each line of `path` matching `pattern` (logging's local time)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = LOG_TS.match(line)
        if m and re.search(pattern, line):
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    return out


def _rank_phases(c: Cluster, job: str) -> dict:
    """The latest rank's `phase loading` and `phase ready` times of launch `job`."""
    logs = c.home / "runtime" / "logs"
    out: dict = {}
    for phase in ("loading", "ready"):
        ts = [t for p in sorted(logs.glob(f"{job}-rank*.log"))
              for t, _ in _log_lines(p, rf"phase {phase}\b")[:1]]
        out[phase] = max(ts) if ts else None
    return out


def _trial(c: Cluster, reference: dict, max_tokens: int, kill_after: int) -> dict:
    resumes0 = c.metric("lockstep_gateway_resumes_total")
    h_sum0 = c.metric("lockstep_gateway_resume_first_token_seconds_sum")
    h_n0 = c.metric("lockstep_gateway_resume_first_token_seconds_count")
    killed: dict = {}

    def kill() -> None:
        dep = c.serving()
        killed.update(dep=dep["deployment_id"], pids=[r["pid"] for r in dep["ranks"]])
        killed["t"] = time.time()
        os.kill(killed["pids"][1], signal.SIGKILL)

    got = _run(c, max_tokens, (kill, kill_after))
    t_kill, old = killed["t"], killed["dep"]
    deadline = time.monotonic() + 60  # the events and log lines are written by now, or soon
    while True:
        ev = _events(c, t_kill - 1)
        new = next((e for e in ev if e["deployment_id"] != old and e["state"] == "serving"), None)
        resumed = _log_lines(c.home / "runtime" / "logs" / "gateway.log",
                             rf"resumed as .* on {new['deployment_id']}" if new else "^$")
        if (new and len(resumed) >= STREAMS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if new is None:
        raise RuntimeError(f"no redeploy serving after the kill: {ev}")
    nid, job = new["deployment_id"], new["data"].get("job_id", "")
    t = {"failed": _at(ev, old, "state", "failed"), "proven": _at(ev, old, "teardown"),
         "stopped": _at(ev, old, "state", "stopped"), "loading": _at(ev, nid, "state", "loading"),
         "canary": _at(ev, nid, "state", "canary"), "serving": new["at"]}
    ranks = _rank_phases(c, job)
    # per stream: its continuation sent (the gateway's line naming its request id), then
    # the first chunk after that; chunks between the kill and it were already in flight
    t_res = [next((ts for ts, line in resumed if f"request {got[i].get('id')} resumed" in line),
                  None) for i in range(STREAMS)]
    nexts = [next((ts for ts, _ in got[i]["chunks"] if r is not None and ts > r), None)
             for i, r in enumerate(t_res)]
    in_flight = [sum(1 for ts, _ in got[i]["chunks"] if t_kill < ts <= (r or t_kill))
                 for i, r in enumerate(t_res)]
    total = [d(t_kill, x) for x in nexts]
    teardown = next((e["data"] for e in ev if e["deployment_id"] == old
                     and e["name"] == "teardown"), {})
    h_n = c.metric("lockstep_gateway_resume_first_token_seconds_count") - h_n0
    h_sum = c.metric("lockstep_gateway_resume_first_token_seconds_sum") - h_sum0
    return {
        "killed": {"deployment": old, "rank": 1, "pids": killed["pids"]},
        "redeployed_as": nid,
        "tokens_before_kill": [sum(1 for ts, _ in got[i]["chunks"] if ts <= t_kill)
                               for i in range(STREAMS)],
        "detection_s": d(t_kill, t["failed"]),
        "teardown_s": d(t["failed"], t["stopped"]),
        "teardown_split_s": {"proven_after_failure": d(t["failed"], t["proven"]),
                             "up_notices_and_stops": d(t["proven"], t["stopped"])},
        "teardown_outcome": teardown.get("outcome"),
        "redeploy_s": d(t["stopped"], t["serving"]),
        "redeploy_split_s": {"launch": d(t["stopped"], t["loading"]),
                             "process_start_imports_auth": d(t["loading"], ranks["loading"]),
                             "weights_load_warm": d(ranks["loading"], ranks["ready"]),
                             "ready_to_canary": d(ranks["ready"], t["canary"]),
                             "canary": d(t["canary"], t["serving"])},
        "gateway_pickup_s": _med([d(t["serving"], r) for r in t_res]),
        "re_prefill_s": _med([d(r, x) for r, x in zip(t_res, nexts, strict=True)]),
        "total_kill_to_next_token_s": _med(total),
        "total_per_stream_s": total,
        "re_prefill_per_stream_s": [d(r, x) for r, x in zip(t_res, nexts, strict=True)],
        "chunks_in_flight_after_kill": in_flight,
        "gateway_resume_first_token_mean_s": round(h_sum / h_n, 3) if h_n else None,
        "resumes_counted": c.metric("lockstep_gateway_resumes_total") - resumes0,
        "text_equals_unfaulted": _text(got) == reference,
        "errors": [got[i].get("error") for i in range(STREAMS) if got[i].get("error")],
    }


KEYS = ("detection_s", "teardown_s", "redeploy_s", "gateway_pickup_s", "re_prefill_s",
        "total_kill_to_next_token_s")


def _med(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return round(median(vals), 3) if vals else None


def _medians(trials: list[dict]) -> dict:
    out = {k: _med([t[k] for t in trials]) for k in KEYS}
    for group in ("teardown_split_s", "redeploy_split_s"):
        out[group] = {k: _med([t[group][k] for t in trials]) for k in trials[0][group]}
    return out


def _preset(tmp: Path, preset: str) -> dict:
    cfg = PRESETS[preset]
    c = Cluster(tmp, preset)
    try:
        reference = _text(_run(c, cfg["max_tokens"]))
        if any(e for _, _, e in reference.values()):
            raise RuntimeError(f"the unfaulted run failed: {reference}")
        trials = []
        for _ in range(TRIALS):
            trials.append(_trial(c, reference, cfg["max_tokens"], cfg["kill_after"]))
            time.sleep(1.0)
        return {"boot_until_banner_s": round(c.boot_s, 2), "eos_ids_biased_away": c.eos,
                "streams": STREAMS, **cfg, "median": _medians(trials),
                "all_text_equal_unfaulted": all(t["text_equals_unfaulted"] for t in trials),
                "resumes_per_trial": [t["resumes_counted"] for t in trials], "trials": trials}
    finally:
        c.stop()


def run(out_dir: Path) -> dict:
    load_before = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ls-resume-") as tmp:
        for preset in PRESETS:
            rows[preset] = _preset(Path(tmp), preset)
    return {
        "what": "follower rank SIGKILLed mid-stream under lockstep up --tp 2: time from the "
                "kill to the next token at the client, split into detection, teardown, "
                "redeploy, the gateway's pickup and re-prefill (sources: module docstring)",
        "sources": {"kill, next token": "this process's clock (time.time)",
                    "failed, teardown, stopped, loading, canary, serving":
                        "the supervisor's journal (/admin/api/cluster/status events)",
                    "rank phases": "the new ranks' logs", "resumed": "the gateway's log"},
        "settings": "defaults (peer_abort_grace 5 s, up polls its deployment every 1 s), "
                    f"--restarts {TRIALS + 3}; greedy, EOS biased away",
        "shared_machine": "a 2-core machine other engineers use concurrently: load average "
                          "before/after recorded; timings include their contention",
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(), "source": source_record(), "presets": rows,
    }


if __name__ == "__main__":
    from bench import RESULTS, write_result

    print(write_result(RESULTS, "resume", run(RESULTS)))
