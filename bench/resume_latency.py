"""Resume latency (issue 43): from a rank's SIGKILL to (a) the first resumed token of the
streams it was serving and (b) the first token of a new request sent right after the
kill — median and p95 over KILLS kills, without and with replicas.

Both configurations run the tiny preset with one rank per deployment (`--tp 1`), so the
only difference is the replica:
  single    `lockstep up --tp 1`: the kill fails the only deployment. `up` redeploys it;
            the streams wait for it and resume there, and the new request waits for it
            too (admission through a redeploy, LOCKSTEP_ADMIT_WAIT at its default).
  replicas  `lockstep up --tp 1 --replicas 2`: the streams resume on the other replica at
            once, and the new request is admitted there.
Per kill: STREAMS greedy streams (EOS biased away) on distinct prompts; once all stream,
rank 0 of the deployment serving the first of them is SIGKILLed and one new streamed
request is sent at once. Every deployment serves again before the next kill. Times, all
wall clock on this host:
  resumed token   per stream on the killed deployment: its first content chunk after
                  the gateway sent the continuation (`recent_resumes[].at`), minus the kill
  new request     its first content chunk, minus the kill
Each faulted stream's text must equal the unfaulted run of the same prompt.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

from bench.replicas import Up, _pct
from bench.servers import environment_record

KILLS = 10
STREAMS = 2
TOKENS = 1500  # a stream alone makes ~250 tokens/s here: still running at the kill
NEW_TOKENS = 16
CONFIGS = {"single": 1, "replicas": 2}
# `up` spaces its redeploys by a doubling backoff from 2 s (its default): ten kills in a
# row would measure the backoff from the sixth on (19-47 s, seen in
# bench/results/resume_latency_default_backoff.json). 0: every kill measures the path.
UP_ARGS = ("--restart-backoff", "0")


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"resume latency stream {i}: tell a long story"}]


def _wait_serving(up: Up, n: int) -> None:
    deadline = time.monotonic() + 300
    while len(up.serving()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} deployments not serving again")
        time.sleep(0.25)


def _kill(up: Up, replicas: int, reference: dict[int, str]) -> dict:
    _wait_serving(up, replicas)
    got: dict = {}

    def one(key, msgs, tokens) -> None:
        try:
            got[key] = up.stream(msgs, tokens)
        except Exception as exc:  # noqa: BLE001 - recorded, judged below
            got[key] = {"error": repr(exc)}

    threads = [threading.Thread(target=one, args=(i, _prompt(i), TOKENS), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every stream under way (tokens arriving), far from its end
    if any(k in got for k in range(STREAMS)):
        raise RuntimeError(f"a stream ended before the kill: {got}")
    seen = len(up.status()["recent_resumes"])
    deps = {d["deployment_id"]: d for d in up.serving()}
    victim = next(iter(deps.values())) if replicas == 1 else None
    if victim is None:  # the replica serving stream 0 (its header said where)
        where = [d for d in deps if d in {r.get("where") for r in got.values()}]
        victim = deps[where[0]] if where else next(iter(deps.values()))
    killed_at = time.time()
    os.kill(victim["ranks"][0]["pid"], signal.SIGKILL)
    new = threading.Thread(target=one, args=("new", _prompt(99), NEW_TOKENS), daemon=True)
    new.start()
    for t in [*threads, new]:
        t.join(600)
    resumed = {r["request_id"]: r for r in up.status()["recent_resumes"][seen:]}
    to_token = []
    for i in range(STREAMS):
        res = resumed.get(got[i].get("rid"))
        if res is not None:
            nxt = next((x for x in got[i]["times"] if x > res["at"]), None)
            to_token.append(None if nxt is None else round(nxt - killed_at, 3))
    nt = got["new"].get("times") or []
    return {"killed": victim["deployment_id"], "streams_resumed": len(to_token),
            "kill_to_resumed_token_s": to_token,
            "kill_to_new_request_token_s": round(nt[0] - killed_at, 3) if nt else None,
            "new_request_ran_on": got["new"].get("where"),
            "text_equals_unfaulted": all(got[i].get("text") == reference[i]
                                         for i in range(STREAMS)),
            "errors": [g["error"] for g in got.values() if "error" in g]}


def _summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median_s": round(median(xs), 3) if xs else None,
            "p95_s": _pct(xs, 0.95) if xs else None}


def _config(tmp: Path, model: Path, name: str, replicas: int) -> dict:
    up = Up(tmp, name, model, replicas, restarts=KILLS + 2, args=UP_ARGS)
    try:
        _wait_serving(up, replicas)
        reference = {i: up.stream(_prompt(i), TOKENS)["text"] for i in range(STREAMS)}
        kills = [_kill(up, replicas, reference) for _ in range(KILLS)]
    finally:
        up.stop()
    resumed = [x for k in kills for x in k["kill_to_resumed_token_s"] if x is not None]
    new = [k["kill_to_new_request_token_s"] for k in kills
           if k["kill_to_new_request_token_s"] is not None]
    return {"command": f"lockstep up --model tiny --tp 1 --replicas {replicas} "
                       f"--restarts {KILLS + 2} {' '.join(UP_ARGS)}",
            "kill_to_resumed_token": _summary(resumed),
            "kill_to_new_request_token": _summary(new),
            "all_text_equal_unfaulted": all(k["text_equals_unfaulted"] for k in kills),
            "errors": [e for k in kills for e in k["errors"]], "kills": kills}


def run(out_dir: Path | None = None) -> dict:
    from models.tinymodel import build_model

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ls-resume-latency-") as tmp:
        model = build_model(Path(tmp) / "tiny", preset="tiny")
        rows = {name: _config(Path(tmp), model, name, n) for name, n in CONFIGS.items()}
    return {"what": "rank SIGKILL -> first resumed token of its streams, and -> first token "
                    "of a new request sent right after it; tiny preset, one rank per "
                    "deployment, without and with a second replica (module docstring)",
            "kills": KILLS, "streams": STREAMS, "stream_tokens": TOKENS,
            "settings": "defaults otherwise: resume_timeout 120 s, admit_wait 60 s, up polls "
                        "its deployment every 1 s; greedy, EOS biased away",
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "environment": environment_record(), "configs": rows}


if __name__ == "__main__":
    from bench import RESULTS, write_result

    print(write_result(RESULTS, "resume_latency", run(RESULTS)))
