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
from dataclasses import replace
from pathlib import Path

import httpx
import psutil

from common.home import Paths
from common.procs import identify
from tests.gwutil import poll_until
from tests.support.processes import REPO, process_gone
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster, up_fixture

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


TP2 = UpOptions(tp=2, ready="ready", ready_s=READY_S)

up = up_fixture(TP2, scope="function")


def manifests(home: Path) -> list[Path]:
    return list(Paths(home).manifests.glob("*.json"))


def test_a_killed_supervisor_is_restarted_and_adopts_the_running_ranks(up: UpCluster):
    proc, url, home, out = up.proc, up.url, up.home, up.out
    prompts = [f"story number {i}: once upon a time" for i in range(4)]
    unfaulted = [stream(url, p) for p in prompts]
    assert all(f == "length" for _, _, f in unfaulted)
    before_ranks = ranks(home)
    up.pids |= before_ranks
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


def test_with_restarts_disabled_the_ranks_end_by_their_watchdog_and_are_reaped(tmp_path):
    """--supervisor-restarts 0: nobody adopts. The ranks notice their supervisor (their
    parent) is gone and, with no lease after the adopt window, exit on their own; the
    reaper then removes the launch; `up`, the gateway and the reaper keep running until
    Ctrl-C, which still ends everything with proof."""
    opts = replace(TP2, extra=("--supervisor-restarts", "0", "--adopt-window", "3"))
    with up_cluster(tmp_path, opts) as u:
        proc, url, home, out = u.proc, u.url, u.home, u.out
        rank_pids = ranks(home)
        u.pids |= rank_pids
        assert len(rank_pids) == 2 and len(manifests(home)) == 1
        sup = supervisor_pid(home)
        os.kill(sup, signal.SIGKILL)
        poll_until(lambda: all(process_gone(p) for p in rank_pids), 90,
                   "the ranks to end by their own watchdog")
        poll_until(lambda: not manifests(home), 90, "the reaper to remove the launch")
        assert "supervisor restarts disabled (--supervisor-restarts 0)" in out.read_text()
        assert proc.poll() is None, out.read_text()[-3000:]  # up keeps running
        assert process_gone(sup) and not (set(ranks(home)) - rank_pids)  # nothing new started
        r = httpx.get(url + "/ready", timeout=10)
        assert r.status_code == 503, r.text
        logs = Paths(home).logs
        for rank in (0, 1):  # each rank's own record: it left because nobody adopted it
            log = next(logs.glob(f"*-rank{rank}.log")).read_text(errors="replace")
            assert "launcher_lost" in log, log[-2000:]
        reaper = (logs / "reaper.log").read_text(errors="replace")
        assert "reaped" in reaper, reaper[-2000:]
        # leaving: Ctrl-C, exit 0, every process gone (the helper's stop proof)


def test_a_launch_whose_proof_fails_is_not_adopted_but_torn_down_and_redeployed(tmp_path):
    """The launch's secret file replaced before the supervisor is killed (a forged secret
    on disk): the ranks' proofs, made with the real secret, do not verify under it, so the
    restarted supervisor does not adopt them: it counts the rejection, tears the launch
    down with proof and `up` redeploys; the next request is served by new ranks."""
    opts = replace(TP2, extra=("--adopt-window", "30"), env={"LOCKSTEP_ADOPT_TIMEOUT": "5"})
    with up_cluster(tmp_path, opts) as u:
        proc, url, home, out = u.proc, u.url, u.home, u.out
        unfaulted = stream(url, "a forged proof")
        old_ranks = ranks(home)
        u.pids |= old_ranks
        [manifest] = manifests(home)
        secret_path = Path(json.loads(manifest.read_text())["secret_path"])
        secret_path.write_text(secret_path.read_text()[::-1])  # same shape, another secret
        os.kill(supervisor_pid(home), signal.SIGKILL)

        poll_until(lambda: all(process_gone(p) for p in old_ranks), 120,
                   "the unproven ranks to be torn down")
        poll_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200 and
                   len(ranks(home) - old_ranks) == 2, READY_S, "the redeploy to serve")
        u.pids |= ranks(home)
        assert stream(url, "a forged proof") == unfaulted  # new ranks, the same answer
        st = status(home)
        rows = {(r["socket"], r["reason"]): r["count"] for r in st["rejections"]
                if r["service"] == "supervisor"}
        assert rows.get(("adoption", "not_proven")) == 1, rows
        names = [e["name"] for e in st["events"]]
        assert "adoption_failed" in names and "adopted" not in names, names
        assert proc.poll() is None, out.read_text()[-3000:]  # up kept running throughout
