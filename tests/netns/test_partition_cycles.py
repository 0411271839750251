"""Partition recovery through `lockstep up --hosts FILE` (issue 12), cut, heal and
recover, again and again: TP=2 with rank 0 on host A and rank 1 on host B (two netns
hosts reached over ssh), a stream running, host B's link cut for CUT_S and restored.

Each cycle: the stream ends with the rank_lost error (resume is off); rank 0 gives up on rank 1 within the cut
(peer_lost: the grace is set short, so every cycle takes the same path), the supervisor
marks the deployment `failed` and tears it down by itself, retrying while host B cannot
be reached, until the link is back and the old ranks are proven gone; `up` stops it and
redeploys; then a greedy completion equal to the first one. CYCLES in `make test`,
SOAK_CYCLES under the soak marker. At the end Ctrl-C: `up` exits 0, and every process it
started and every rank of every cycle is gone (psutil: the namespaces share this pid
space), with no manifest left.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from common.procs import identify
from tests.netns.hosts import NetnsCluster
from tests.netns.up_hosts import B, Up, start, stop, wait_banner
from tests.support.polling import poll_for
from tests.support.processes import process_gone

pytestmark = pytest.mark.netns

CYCLES = 2
SOAK_CYCLES = 10
CUT_S = 8.0  # the fault's length, as in the issue
RECOVER_S = 150.0  # link back → a new deployment serving (teardown proof, launch, canary)


def _start(c: NetnsCluster, tmp_path: Path, restarts: int) -> Up:
    # resume off: each cycle's stream ends with the cut (the path under test is the
    # deployment's recovery), not resumed after the heal (test_resume_partition.py)
    return start(c, tmp_path, restarts, resume_timeout=0)


def _stream_cut_heal(c: NetnsCluster, u: Up, model: str) -> tuple[str, float]:
    """A long stream; once it has produced text, host B's link goes down for CUT_S.
    Returns its finish_reason and how long after the cut it came."""
    body = {"model": model, "prompt": "x", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", u.url + "/v1/completions", json=body,
                      timeout=httpx.Timeout(30.0)) as r:
        assert r.status_code == 200, r.read()
        chunks = (json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {"))
        first = next(ch for ch in chunks if ch["choices"] and ch["choices"][0].get("text"))
        assert first["choices"][0].get("finish_reason") is None
        t0 = time.monotonic()
        c.link_down(B)
        try:
            # resume off: the failure ends the stream with the rank_lost error event
            # (502 backend_error, then [DONE]); a finish_reason would be anything else
            finish = next(f"error:{ch['error']['code']}" if "error" in ch
                          else ch["choices"][0]["finish_reason"] for ch in chunks
                          if "error" in ch or (ch["choices"]
                                               and ch["choices"][0].get("finish_reason")))
            ended_s = time.monotonic() - t0
            time.sleep(max(0.0, CUT_S - (time.monotonic() - t0)))  # the fault's length
        finally:
            c.link_up(B)
    return finish, ended_s


def _cycle(c: NetnsCluster, u: Up, model: str, reference: str, i: int) -> str:
    dep = u.serving()
    old = [identify(r["pid"]) for r in dep["ranks"]]
    assert all(old), dep["ranks"]
    u.ranks += old
    banners = u.banners()
    finish, ended_s = _stream_cut_heal(c, u, model)
    assert finish == "error:backend_error", f"cycle {i}: the stream ended {finish!r}"
    t0 = time.monotonic()
    try:
        poll_for(lambda: u.banners() > banners or u.proc.poll() is not None, RECOVER_S,
                 f"cycle {i}: lockstep up to redeploy", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{u.logs()}") from None
    assert u.proc.poll() is None, u.logs()
    redeploy_s = time.monotonic() - t0
    assert all(process_gone(p.pid, p.start_time) for p in old), f"cycle {i}: {u.logs()}"
    new = u.serving()
    assert new["deployment_id"] != dep["deployment_id"]
    got = poll_for(lambda: u.completion(model), 30, f"cycle {i}: a served completion")
    assert got == reference, f"cycle {i}: {got!r} != first {reference!r}"
    return (f"cycle {i}: stream failed {ended_s:.1f}s after the cut, "
            f"{dep['deployment_id']} -> {new['deployment_id']} serving {redeploy_s:.1f}s "
            "after the heal")


def _run(c: NetnsCluster, tmp_path: Path, cycles: int) -> None:
    u = _start(c, tmp_path, restarts=cycles + 1)
    try:
        wait_banner(u, 1, 300)
        model = httpx.get(u.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = poll_for(lambda: u.completion(model), 30, "the first completion")
        report = [_cycle(c, u, model, reference, i) for i in range(cycles)]
        u.ranks += [identify(r["pid"]) for r in u.serving()["ranks"]]
        stop(u)
        print("\n" + "\n".join(report))
    finally:
        c.link_up(B)
        if u.proc.poll() is None:
            os.killpg(u.proc.pid, signal.SIGKILL)
            u.proc.wait()


@pytest.mark.timeout(420)
def test_cut_heal_recover_cycles(netns_cluster, tmp_path):
    _run(netns_cluster, tmp_path, CYCLES)


@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_cut_heal_recover_cycles_soak(netns_cluster, tmp_path):
    _run(netns_cluster, tmp_path, SOAK_CYCLES)
