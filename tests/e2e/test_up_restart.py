"""`lockstep up` (real supervisor, reaper, gateway and TP=2 MLX ranks) after a rank dies,
on a cluster of its own (the tests change it; the read-only ones share
tests/support/live_cluster.py). Tests run in file order: a follower SIGKILLed → the
failed deployment torn down with proof and redeployed, watched live on the operator
console (/admin/, headless chromium) when it is installed; the console's incidents;
`lockstep admin watch`; an unload refused while a request runs, then forced; Ctrl-C
stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from common.procs import snapshot_children
from tests.gwutil import poll_until
from tests.support import live_cluster as lc
from tests.support.console_browser import (
    CHROMEDRIVER,
    CHROMIUM,
    cells,
    kinds,
    needs_chromium,
    open_browser,
    ranks_serving,
    shot,
)
from tests.support.processes import REPO, process_gone
from tests.support.up_cluster import UpCluster, UpOptions, up_fixture

READY_S = 240.0
# the last test stops `up` with Ctrl-C and proves the stop itself
up = up_fixture(UpOptions(restarts=1, ready_s=READY_S, stop="test"))


@pytest.fixture(scope="module")
def first(up: UpCluster) -> dict:
    """The deployment `up` brought up first, serving."""
    return serving(up)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def serving(up: UpCluster) -> dict:
    return next(d for d in up.deployments() if d["state"] == "serving")


@pytest.fixture(scope="module")
def page(up: UpCluster, first: dict):
    """The console logged in from `up`'s link, showing the first deployment serving (None
    without chromium: the tests that need the page are skipped, the others run)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        yield None
        return
    with open_browser() as drv:
        dep = first
        # the login link `up` printed
        drv.get(next(ln.split(": ", 1)[1] for ln in up.text().splitlines()
                     if "cluster console: " in ln))
        poll_until(lambda: ranks_serving(drv, dep["deployment_id"], 2), 30,
                   "both ranks serving on the page")
        yield drv


@pytest.mark.timeout(300)
def test_a_follower_killed_is_torn_down_and_redeployed(up, first, page):
    pids = [r["pid"] for r in first["ranks"]]
    os.kill(pids[1], signal.SIGKILL)
    poll_until(lambda: process_gone(pids[1]), 10, "the follower gone")
    if page is not None:  # seen live on the page, as an operator watching it would
        poll_until(lambda: "rank_lost" in kinds(page), 20, "the rank_lost incident on the page")
        poll_until(lambda: "redeploy" in kinds(page), 30, "the redeploy on the page")
    poll_until(lambda: up.running() and up.banners() == 2, 240, "the redeploy's banner", 0.5)
    assert "redeploying (1 of 1 within 600s)" in up.text()
    poll_until(lambda: all(process_gone(p) for p in pids), 30,
               "the failed launch's ranks to be gone")
    r = httpx.post(up.url + "/v1/completions", timeout=60,
                   json={"model": first["model"], "prompt": "a", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert serving(up)["deployment_id"] != first["deployment_id"]


@needs_chromium
@pytest.mark.timeout(120)
def test_the_console_shows_the_incident_and_the_redeploy(up, first, shots, page):
    new = serving(up)
    pid = first["ranks"][1]["pid"]
    poll_until(lambda: ranks_serving(page, new["deployment_id"], 2), 20,
               "the new deployment's ranks serving on the page")
    poll_until(lambda: (cells(page, "#deployments", new["deployment_id"]) or [""] * 6)[5]
               == "serving", 15, "the new deployment serving on the page")
    ks = kinds(page)
    # newest first: the redeploy is above the loss, the teardown of the old one between
    assert ks.index("redeploy") < ks.index("rank_lost"), ks
    text = page.find_element("css selector", "#incidents").text
    assert f"rank 1 (pid {pid})" in text, text
    # the teardown after the failure, with its ladder path (the follower was gone already)
    assert ks.index("teardown") < ks.index("rank_lost"), ks
    assert "teardown shutdown" in text or "teardown sigterm" in text, text
    shot(shots, page, "incident")


@pytest.mark.timeout(60)
def test_admin_watch_redraws_and_exits_0_on_ctrl_c(up):
    """`lockstep admin watch` against the same cluster: redrawn in place (a screen clear
    per refresh), the last incidents shown, Ctrl-C (SIGINT) exits 0 — also when it was
    started with SIGINT ignored, as a shell's background job is (it is started so here,
    whatever disposition this test run inherited)."""
    out = up.home / "watch.out"
    with open(out, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "services", "admin", "--home", str(up.home),
                              "watch"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            poll_until(lambda: out.read_bytes().count(b"\x1b[H\x1b[2J") >= 2, 20, "two redraws")
            p.send_signal(signal.SIGINT)
            assert p.wait(10) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    last = out.read_text().split("\x1b[H\x1b[2J")[-1]
    assert "last incidents (newest first):" in last and "rank_lost" in last, last
    assert "redeploy" in last and "steps/s" in last, last
    assert serving(up)["deployment_id"] + "  serving up " in last, last


@pytest.mark.timeout(180)
def test_unload_refused_then_forced_live(up):
    dep = serving(up)
    dep_id = dep["deployment_id"]
    res: dict = {}
    t = threading.Thread(target=lambda: res.update(r=httpx.post(
        up.url + "/v1/completions", timeout=120,
        json={"model": dep["model"], "prompt": "the library", "max_tokens": 3000})))
    t.start()
    poll_until(lambda: lc.rank0_stats(up.home, dep).active >= 1, 30, "an active request")
    url = f"{up.url}/admin/api/cluster/deployments/{dep_id}/unload"
    r = httpx.post(url, headers=up.hdr, json={}, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "active_requests"
    assert lc.rank0_stats(up.home, dep).active >= 1  # refused: still serving
    r = httpx.post(url, headers=up.hdr, json={"force": True}, timeout=180)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["evidence"]["zero_active"] is True
    assert all(v == 0 for v in body["evidence"]["ranks"].values())
    assert body["teardown"]["outcome"]["proven"] is True
    t.join(60)
    assert res["r"].json()["choices"][0]["finish_reason"] == "abort"
    for rk in dep["ranks"]:
        assert not psutil.pid_exists(rk["pid"]) or psutil.Process(rk["pid"]).status() == "zombie"
    r = httpx.get(up.url + "/ready", timeout=10)
    assert r.status_code == 503


@pytest.mark.timeout(120)
def test_sigint_stops_everything(up):
    proc = up.proc
    tree = snapshot_children(proc.pid)
    assert len(tree) >= 4  # up, supervisor, reaper, gateway
    proc.send_signal(signal.SIGINT)
    assert proc.wait(90) == 0, up.text()[-3000:]
    poll_until(lambda: all(process_gone(i.pid, i.start_time) for i in tree), 10,
               "every process of lockstep up to be gone")
    assert "every process stopped" in up.text()
