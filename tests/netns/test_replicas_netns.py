"""Replicas across hosts (issue 31): `lockstep up --hosts FILE --tp 2 --replicas 2` over
two netns hosts reached by ssh, the hosts file listing A, B, A, B: each replica's TP=2
spans both hosts (replica r takes the next two rank slots). Four seeded streams spread
over both replicas; rank 1 (on host B) of one replica is SIGKILLed mid-stream: every
stream completes with its unfaulted text, the killed replica's ones resumed on the other
replica (the gateway's own record) without waiting for its redeploy; the replica serves
again afterwards, and Ctrl-C leaves no process of either replica on either host.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import threading

import httpx
import pytest

from common.procs import identify
from tests.netns.up_hosts import A, B, start, stop, wait_banner
from tests.support.polling import poll_for

pytestmark = pytest.mark.netns

NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: streams run to max_tokens
STREAMS = 4


def _stream(url: str, model: str, i: int, got: dict, lock: threading.Lock) -> None:
    body = {"model": model, "stream": True, "max_tokens": 80, "temperature": 0.8,
            "seed": 40 + i, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": f"tale {i} of two hosts"}]}
    text, finish = [], None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(60.0)) as r:
            assert r.status_code == 200, r.read()
            with lock:
                got.setdefault("where", {})[i] = r.headers["x-lockstep-deployment"]
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                assert '"error"' not in line, line
                for ch in json.loads(line[6:])["choices"]:
                    text.append(ch["delta"].get("content") or "")
                    finish = ch.get("finish_reason") or finish
                with lock:
                    got.setdefault("chunks", {})[i] = len(text)
        result = ("".join(text), finish)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        result = ("error", repr(exc))
    with lock:
        got[i] = result


def _run(url: str, model: str, fault=None) -> dict:
    got: dict = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=_stream, args=(url, model, i, got, lock), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    if fault is not None:
        def streaming() -> bool:
            with lock:
                done = [i for i in range(STREAMS) if i in got]
                counts = dict(got.get("chunks") or {})
            assert not done, f"finished before the fault: {done}"
            return len(counts) == STREAMS and min(counts.values()) >= 3
        poll_for(streaming, 60, "every stream streaming")
        with lock:
            fault(dict(got["where"]))
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a stream never ended"
    return got


@pytest.mark.timeout(900)
def test_two_tp2_replicas_across_hosts_fail_over_token_for_token(netns_cluster, tmp_path):
    c = netns_cluster
    u = start(c, tmp_path, restarts=2, resume_timeout=120, hosts=(A, B, A, B),
              extra=("--replicas", "2"))
    try:
        wait_banner(u, 1, 420)
        deps = u.all_serving()
        assert [d["replica"] for d in deps] == [0, 1], deps
        for d in deps:  # each replica spans both hosts
            assert [r["remote"] for r in d["ranks"]] == [True, True], d["ranks"]
            assert len({r["host"] for r in d["ranks"]}) == 2, d["ranks"]
        u.ranks += [identify(r["pid"]) for d in deps for r in d["ranks"]]
        model = httpx.get(u.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run(u.url, model)
        assert all(reference[i][1] == "length" for i in range(STREAMS)), reference
        assert len(set(reference["where"].values())) == 2, reference["where"]
        seen = len(u.admin_get("status")["gateway"]["recent_resumes"])
        by_id = {d["deployment_id"]: d for d in deps}
        killed: dict = {}

        def kill(where: dict) -> None:
            counts = collections.Counter(where.values())
            victim = max(sorted(counts), key=lambda d: counts[d])
            killed.update(id=victim, n=counts[victim])
            os.kill(by_id[victim]["ranks"][1]["pid"], signal.SIGKILL)  # rank 1, on host B

        got = _run(u.url, model, kill)
        for i in range(STREAMS):
            assert got[i] == reference[i], (i, got[i], reference[i], killed, u.logs())
        other = next(d for d in by_id if d != killed["id"])
        resumes = u.admin_get("status")["gateway"]["recent_resumes"][seen:]
        assert sorted((r["from"], r["to"]) for r in resumes) == \
            [(killed["id"], other)] * killed["n"], resumes
        back = poll_for(lambda: (lambda s: s if len(s) == 2 and killed["id"] not in
                                 {d["deployment_id"] for d in s} else None)(u.all_serving()),
                        300, "the killed replica serving again")
        u.ranks += [identify(r["pid"]) for d in back for r in d["ranks"]]
        stop(u)
    finally:
        if u.proc.poll() is None:
            os.killpg(u.proc.pid, signal.SIGKILL)
            u.proc.wait()
