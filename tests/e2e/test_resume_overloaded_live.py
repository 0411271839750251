"""A continuation that meets an overloaded survivor (issue 43, item 2), with real ranks:
`lockstep up --replicas 2 --tp 1` (tiny preset) whose rank 0s refuse a third open request
(LOCKSTEP_MAX_OPEN_REQUESTS=2; the gateway's own bound is far above it).

Four long streams, two on each replica; one replica's rank SIGKILLed. Its two streams
resume on the survivor, whose rank 0 already holds two and refuses them in-band
(`overloaded`): that refusal is not an answer for the client. The continuations wait and
are sent again until the survivor (or the redeployed replica) has room, and all four
streams end exactly as an unfaulted run of the same four: text and finish reason, and
no error event. The gateway's own counts prove the path: rank-bound refusals on the
survivor, and exactly two resumes from the killed replica, their re-sends counted on
their own rows of the gateway's resume log (`status.gateway.recent_resumes[].refusals`).

Before the retry (resume.py REFUSED), the two resumed streams ended with an SSE error
`overloaded` ("rank 0 is at its bound") after their partial output.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading

import httpx
import pytest

from tests.support.stream_fault import chat_stream, streams_with_fault
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster

NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: streams run to max_tokens
BOUND = 2  # rank 0's open requests
TOPICS = ["amber fjord", "birch grove", "cedar heath", "delta inlet"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # rank 0 sleeps 10 ms a step (test seam): a 200-token stream is surely mid-stream when
    # the fault comes, and the survivor's own two are still running when the resumed ones
    # reach it
    env = {"LOCKSTEP_MAX_OPEN_REQUESTS": str(BOUND),
           "LOCKSTEP_PEER_ABORT_GRACE": "1", "LOCKSTEP_RANK_TEST_SEAMS": "true",
           "LOCKSTEP_TEST_STEP_DELAY_S": "0.01"}
    with up_cluster(tmp_path_factory.mktemp("resume-overloaded"),
                    UpOptions(tp=1, replicas=2, restarts=4, env=env)) as c:
        yield c


def _serving(c: UpCluster) -> dict[str, dict]:
    deps = httpx.get(c.url + "/admin/api/cluster/deployments", headers=c.hdr,
                     timeout=10).json()["deployments"]
    return {d["deployment_id"]: d for d in deps if d["state"] == "serving"}


def _gateway(c: UpCluster) -> dict:
    return httpx.get(c.url + "/admin/api/cluster/status", headers=c.hdr,
                     timeout=10).json()["gateway"]


def _rank_refusals(c: UpCluster, dep: str) -> float:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    m = re.search(r'^lockstep_gateway_overloaded_total\{[^}]*bound="rank"[^}]*deployment="'
                  + re.escape(dep) + r'"[^}]*\} (\S+)$|^lockstep_gateway_overloaded_total\{[^}]*'
                  r'deployment="' + re.escape(dep) + r'"[^}]*bound="rank"[^}]*\} (\S+)$',
                  text, re.M)
    return float(m.group(1) or m.group(2)) if m else 0.0


def _stream(c: UpCluster, i: int, got: dict, lock: threading.Lock) -> None:
    body = {"model": "tiny", "stream": True, "max_tokens": 200, "temperature": 0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": f"a story of the {TOPICS[i]}"}]}
    chat_stream(c.url, body, i, got, lock)


def _four(c: UpCluster, fault=None) -> dict:
    """Four streams, started one by one so the router spreads them two and two (equal
    loads alternate); `fault` runs once all four stream."""
    return streams_with_fault(4, lambda i, got, lock: _stream(c, i, got, lock), fault,
                              one_by_one=True)


@pytest.mark.timeout(420)
def test_a_continuation_refused_by_a_full_survivor_waits_and_completes(cluster):
    c = cluster
    deps = _serving(c)
    assert len(deps) == 2
    c.pids |= {r["pid"] for d in deps.values() for r in d["ranks"]}
    reference = _four(c)
    for i in range(4):
        assert reference[i][1:] == ("length", []), reference[i]
    assert sorted(collections.Counter(reference["where"].values()).values()) == [2, 2], \
        reference["where"]
    seen = len(_gateway(c)["recent_resumes"])
    killed: dict = {}

    def kill(where: dict) -> None:
        assert sorted(collections.Counter(where.values()).values()) == [2, 2], where
        victim = sorted(set(where.values()))[0]
        killed["id"], killed["other"] = victim, next(d for d in deps if d != victim)
        killed["refusals"] = _rank_refusals(c, killed["other"])
        os.kill(deps[victim]["ranks"][0]["pid"], signal.SIGKILL)

    got = _four(c, kill)
    for i in range(4):
        assert got[i] == reference[i], (i, got[i], reference[i], got["where"])
    resumes = _gateway(c)["recent_resumes"][seen:]
    assert [r["from"] for r in resumes] == [killed["id"]] * 2, resumes
    # the path under test was taken: the survivor's rank 0 refused a continuation, which
    # was sent again (the same resume: its row counts the refusals)
    assert _rank_refusals(c, killed["other"]) > killed["refusals"], resumes
    assert sum(r["refusals"] for r in resumes) > 0, resumes
