"""The gateway fails a dead rank 0's streams itself, at once, without the supervisor:
`lockstep up` (real supervisor, reaper, gateway, TP=2 MLX ranks), a stream and a
non-streamed request running, the supervisor frozen (SIGSTOP) so that it cannot tell the
gateway anything, then rank 0 SIGKILLed. Both requests end with the typed error within a
bound measured from the kill; new requests get 503 until the supervisor (SIGCONT) has
redeployed; then they are served again.

Every premise is proven before the kill, not assumed from timing: both requests are in
flight at the gateway with tokens generated (a plain request admitted only after the
loss would get 503, not the 502 under test), and the supervisor is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from services.gateway.core.rank_link import HEARTBEAT_TIMEOUT_MS
from tests.gwutil import poll_until, sse_lines
from tests.support.processes import process_gone
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster

FAIL_WITHIN_S = 5.0  # from the kill to the error at the client: the supervisor has no part
# Only the link's close event is this fast: ZMTP heartbeats alone would take their timeout.
assert FAIL_WITHIN_S < HEARTBEAT_TIMEOUT_MS / 1000, "the bound must tell the close from heartbeats"


def _supervisor_pid(up: subprocess.Popen) -> int:
    for p in psutil.Process(up.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:  # a child that exited meanwhile is not the supervisor
            continue
        if cmd[2:4] == ["services", "supervisor"]:
            return p.pid
    raise AssertionError("no supervisor under lockstep up")


def _generating(url: str, hdr: dict, dep_id: str) -> int:
    """How many requests the gateway has in flight on `dep_id` with tokens generated."""
    rows = httpx.get(url + "/admin/api/requests", headers=hdr, timeout=10).json()["requests"]
    return sum(1 for r in rows if r["deployment_id"] == dep_id and r["generated_tokens"] > 0)


class Gone:
    """When `pid` was first seen gone (monotonic), polled in a thread: says, when the bound
    fails, how much of it the kernel took to end rank 0 (its sockets close with it)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.at = pid, None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process_gone(self.pid):
                self.at = time.monotonic()
                return
            time.sleep(0.01)


class Running:
    """One request in a thread: for a stream, the chunks and the first error event; for
    a plain request, the response. `ended_at` (monotonic) is when it ended."""

    def __init__(self, url: str, body: dict) -> None:
        self.url, self.body = url, body
        self.chunks = 0
        self.error: dict | None = None
        self.done = False
        self.status: int | None = None
        self.json: dict | None = None
        self.ended_at: float | None = None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.body.get("stream"):
                with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                    self.status = r.status_code
                    for kind, data in sse_lines(r):
                        if kind != "data":
                            continue
                        if data == "[DONE]":
                            self.done = True
                            break
                        if "error" in data:
                            self.error = data["error"]
                        else:
                            self.chunks += 1
            else:
                r = httpx.post(self.url, json=self.body, timeout=120)
                self.status, self.json = r.status_code, r.json()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        self.ended_at = time.monotonic()


@pytest.mark.timeout(420)
def test_rank0_killed_with_the_supervisor_frozen_fails_streams_at_once(tmp_path):
    # the fail path under test: no resume (LOCKSTEP_RESUME_TIMEOUT=0) and no wait for the
    # redeploy (LOCKSTEP_ADMIT_WAIT=0): the in-band failure and the 503 at once
    opts = UpOptions(restarts=1, env={"LOCKSTEP_RESUME_TIMEOUT": "0", "LOCKSTEP_ADMIT_WAIT": "0"})
    with up_cluster(tmp_path, opts) as c:
        _rank0_lost(c)


def _rank0_lost(c: UpCluster) -> None:
    up, url, hdr, text = c.proc, c.url, c.hdr, c.text
    sup: int | None = None
    try:
        assert c.banners() == 1, text()[-3000:]
        deps = httpx.get(url + "/admin/api/cluster/deployments", headers=hdr,
                         timeout=10).json()["deployments"]
        first = next(d for d in deps if d["state"] == "serving")
        rank0 = next(r["pid"] for r in first["ranks"] if r["rank"] == 0)
        c.pids |= {r["pid"] for r in first["ranks"]}
        model = first["model"]
        sup = _supervisor_pid(up)

        body = {"model": model, "prompt": "the library of", "max_tokens": 3000,
                "temperature": 0}
        stream = Running(url + "/v1/completions", {**body, "stream": True})
        plain = Running(url + "/v1/completions", body)
        # Both running, proven at the gateway: rank 0 sent tokens for each.
        poll_until(lambda: (stream.chunks >= 3 and _generating(url, hdr, first["deployment_id"]) == 2)
                   or stream.ended_at or plain.ended_at, 60, "both requests to generate")
        assert stream.ended_at is None, (stream.status, stream.error, stream.failure)
        assert plain.ended_at is None, (plain.status, plain.json, plain.failure)

        os.kill(sup, signal.SIGSTOP)  # from now on the supervisor can tell nobody anything
        poll_until(lambda: psutil.Process(sup).status() == psutil.STATUS_STOPPED, 10,
                   "the supervisor to stop")
        os.kill(rank0, signal.SIGKILL)
        killed_at = time.monotonic()
        gone = Gone(rank0)
        poll_until(lambda: stream.ended_at and plain.ended_at, FAIL_WITHIN_S + 5,
                   "both requests to end")
        assert stream.failure is None and plain.failure is None, (stream.failure, plain.failure)
        # The stream: an OpenAI-shaped error event, then [DONE].
        assert stream.status == 200 and stream.done, (stream.status, stream.done)
        assert stream.error is not None and stream.error["code"] == "backend_error", stream.error
        assert "connection to rank 0" in stream.error["message"], stream.error
        # The plain request: 502 backend_error, the same typed cause.
        assert plain.status == 502, (plain.status, plain.json)
        assert plain.json["error"]["code"] == "backend_error", plain.json
        for r in (stream, plain):
            assert r.ended_at - killed_at < FAIL_WITHIN_S, (
                f"ended {r.ended_at - killed_at:.3f}s after the kill; rank 0 gone after "
                f"{None if gone.at is None else round(gone.at - killed_at, 3)}s")
        # Not routed to any more: 503 at once, and not ready, the supervisor still frozen.
        r = httpx.post(url + "/v1/completions", timeout=10, json={**body, "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_not_ready", r.text
        assert r.headers["retry-after"] == "5"
        ready = httpx.get(url + "/ready", timeout=10)
        assert ready.status_code == 503, ready.text
        assert psutil.Process(sup).status() == psutil.STATUS_STOPPED  # it had no part

        os.kill(sup, signal.SIGCONT)
        sup = None
        poll_until(lambda: c.running() and c.banners() == 2, 240, "the redeploy's banner", 0.5)
        poll_until(lambda: process_gone(rank0), 30, "the killed rank 0 to be reaped")
        r = httpx.post(url + "/v1/completions", timeout=60, json={**body, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        if sup is not None:
            os.kill(sup, signal.SIGCONT)
