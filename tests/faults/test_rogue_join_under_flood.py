"""A legitimate rank's handshake under attack (real MLX ranks, tests/e2e/rank_harness.py):
before the ranks even start, rogues flood rank 0's plan and requests sockets with random
bytes and hold 1000 half-open handshakes, half *with the launch's plan key* (an insider's
attack: each claims rank 1 and never answers the challenge; the responder is stateless,
common/handshake.py, so they hold nothing and evict nothing). Rank 1 must still authenticate within a bounded time, and the deployment serve
exactly as without the flood."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.e2e.rank_harness import REPO, Deployment

AUTH_LINE = re.compile(r"plan: authenticated both ways in (\d+) ms")
HANDSHAKE_BOUND_S = 5.0


def rogue(plan: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "tests.faults.rogue"], cwd=REPO,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdin.write(json.dumps(plan))
    p.stdin.close()
    return p


def plan_auth_ms(d: Deployment) -> int:
    found = AUTH_LINE.findall(d.log(1))
    assert found, d.log(1)[-2000:]
    return int(found[0])


@pytest.mark.timeout(300)
def test_follower_joins_under_garbage_and_half_open_flood(tmp_path):
    # Undisturbed: how long the plan handshake and the whole start take.
    t0 = time.monotonic()
    with Deployment(tmp_path / "quiet", mode="tp") as d:
        quiet_start = time.monotonic() - t0
        quiet_ms = plan_auth_ms(d)
        reference = d.generate([3, 1, 4, 1, 5], 40)

    d = Deployment(tmp_path / "flood", mode="tp")
    target = {"deployment_id": d.deployment_id, "job_id": d.job_id}
    plan_t = {**target, "name": "plan", "endpoint": d.plan_endpoint, "auth_rank": 1,
              "key": d.keys.plan.secret.hex(), "cap": 65536}
    req_t = {**target, "name": "requests", "endpoint": d.requests_endpoint, "body": "generate",
             "cap": 4 << 20}
    garbage = rogue({"seconds": 2.0, "phases": ["garbage"] * 10, "targets": [plan_t, req_t]})
    halfopen = rogue({"seconds": 15.0, "phases": ["halfopen"], "targets": [plan_t]})
    try:
        time.sleep(1.0)  # the flood is on (DEALERs connect as soon as rank 0 binds)
        t0 = time.monotonic()
        d.start(timeout=120)
        flood_start = time.monotonic() - t0
        flood_ms = plan_auth_ms(d)
        got = d.generate([3, 1, 4, 1, 5], 40)
        assert got.tokens == reference.tokens
        rejects = d.fresh_telemetry(0).rejects
        print(f"\nplan handshake: {quiet_ms} ms quiet, {flood_ms} ms under flood; start "
              f"{quiet_start:.1f}s quiet, {flood_start:.1f}s under flood; rank 0 rejects "
              f"{rejects}")
        assert flood_ms / 1000 <= HANDSHAKE_BOUND_S
        # The keyed half-open HELLOs really reached the handshake: each was challenged
        # (the rogue received it: a pending entry, were the responder not stateless) or,
        # once rank 1 was in, refused as a duplicate.
        halfopen.wait(timeout=60)
        halfopen_out = halfopen.stdout.read()
        challenged = json.loads(halfopen_out.splitlines()[-1])["received"]
        rejects = d.fresh_telemetry(0).rejects  # now that every half-open HELLO was read
        assert challenged + rejects.get("plan.duplicate_rank", 0) > 0, (halfopen_out, rejects)
        assert rejects.get("plan.bad_magic", 0) + rejects.get("plan.too_short", 0) > 0
    finally:
        for p in (garbage, halfopen):
            if p.poll() is None:
                p.kill()
            p.wait()
        d.teardown()
