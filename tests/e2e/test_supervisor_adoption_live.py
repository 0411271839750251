"""A supervisor SIGKILLed under a live `lockstep up` (TP=2, real MLX ranks) is restarted
and adopts the running launch (issue 44): the 4 streams decoding at the kill complete
with the unfaulted run's tokens and logprobs, `up` keeps running, the same rank pids
serve the next request, the new supervisor's status names its restart and the adoption,
the cancel epoch keeps rising, and the restarted supervisor refused nothing on its
report socket (ranks hold their reports while the connection is down). Evidence from
outside: psutil, the HTTP API, `admin status`, `up`'s output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from common.home import Paths
from common.procs import identify
from tests.gwutil import free_port, poll_until
from tests.support.processes import REPO, interrupt, kill_group, process_gone, up_argv

READY_S, STREAM_S = 240.0, 180.0
BODY = {"model": "tiny", "prompt": "hello there my friend", "max_tokens": 200,
        "temperature": 0, "stream": True, "logprobs": 1}


def stream(url: str, prompt: str) -> tuple[list[str], list[float], str]:
    """(tokens, logprobs, finish_reason) of one streamed completion."""
    toks, lps, finish = [], [], ""
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "prompt": prompt},
                      timeout=STREAM_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])["choices"][0]
            if c.get("logprobs"):
                toks += c["logprobs"]["tokens"]
                lps += c["logprobs"]["token_logprobs"]
            finish = c.get("finish_reason") or finish
    return toks, lps, finish


def supervisor_pid(home: Path) -> int:
    return json.loads(Paths(home).supervisor_file.read_text())["pid"]


def ranks(home: Path) -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "services.rank" in " ".join(p.info["cmdline"] or [])
            and str(home) in " ".join(p.info["cmdline"] or [])}


def status(home: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "services", "admin",
                          "--home", str(home), "--json", "status"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["data"]


@pytest.fixture
def up(tmp_path):
    port = free_port()
    out = tmp_path / "up.out"
    with open(out, "wb") as log:
        proc = subprocess.Popen(up_argv(tmp_path, port, "--tp", "2"), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        poll_until(lambda: proc.poll() is None and httpx.get(url + "/ready", timeout=5)
                   .status_code == 200, READY_S, "lockstep up to be ready", interval=0.1)
        yield proc, url, tmp_path, out
    finally:
        interrupt(proc, 120)
        kill_group(proc)


def test_a_killed_supervisor_is_restarted_and_adopts_the_running_ranks(up):
    proc, url, home, out = up
    prompts = [f"story number {i}: once upon a time" for i in range(4)]
    unfaulted = [stream(url, p) for p in prompts]
    assert all(f == "length" for _, _, f in unfaulted)
    before_ranks = ranks(home)
    assert len(before_ranks) == 2
    old_sup = supervisor_pid(home)
    epoch_before = status(home)["cancel_epoch"]

    got: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = stream(url, prompts[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # the streams are decoding: rank 0 has active requests
    poll_until(lambda: len(got) == 0 and status(home)["deployments"][0]["ranks"][0]["active"] >= 1,
               60, "the streams to be decoding", interval=0.05)
    os.kill(old_sup, signal.SIGKILL)
    for t in threads:
        t.join(STREAM_S)
    assert not errors, errors
    for i in range(4):
        assert got[i] == unfaulted[i], f"stream {i} differs from the unfaulted run"

    assert proc.poll() is None, out.read_text()[-3000:]
    poll_until(lambda: "adopted by the new supervisor" in out.read_text(), 60, "the adoption")
    new_sup = supervisor_pid(home)
    assert new_sup != old_sup and process_gone(old_sup) and identify(new_sup) is not None
    assert ranks(home) == before_ranks  # the same ranks serve: adopted, not redeployed
    assert stream(url, prompts[0]) == unfaulted[0]  # the next request

    st = status(home)
    names = [e["name"] for e in st["events"]]
    assert "supervisor_restarted" in names and "adopted" in names, names
    assert st["deployments"][0]["state"] == "serving"
    refused = [r for r in st["rejections"] if r["service"] == "supervisor"]
    assert refused == [], refused  # nothing the ranks sent was refused by the new one
    # an abort after the restart: the epoch continues upward
    r = httpx.post(url + "/admin/api/cluster/abort-all", timeout=30,
                   headers={"authorization": "Bearer " + Paths(home).admin_token.read_text().strip()})
    assert r.status_code == 200, r.text
    assert status(home)["cancel_epoch"] > epoch_before
