"""Held ZMTP connections against every listener of a supervisor (admin, report) and of
a real rank 0 (plan, requests), each a separate process: hundreds per socket that
complete the ZMTP handshake and then sit silent, some that send part of a greeting and
stall, and some that push frames just under the socket's cap as fast as it takes them,
none ever authenticating
(tests/faults/zmtp_hold.py). Measured with psutil:

- while the flood is on, each process's RSS grows by at most what common.bus
  `configure_listener` bounds per connection (frames held + libzmq's fixed cost), and a
  signed admin ping / a completion still succeed;
- once the attacker is gone, RSS comes back to within MARGIN_MB of the baseline within
  RETURN_S (common/memtrim.py), and both still serve.
Without the bound, 80 frame-pushing connections took the supervisor to 2 GB; without
the trim it kept 85 MB (of 38) after 2000 held connections closed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from common.bus import listener_rcvhwm
from common.envelope import DEFAULT_MAX_SIZE
from common.keys import load_cluster_key
from services.admin.cli import AdminClient
from services.rank.io import PLAN_IN_MAX
from services.supervisor.report_gate import REPORT_MAX
from services.supervisor.sockets import ADMIN_MAX
from tests.e2e.rank_harness import REPO, Deployment
from tests.support.polling import poll_for
from tests.support.supervisor import ensure_key, supervisor_argv

HELD = 600  # silent connections per listener
PARTIAL = 100  # connections per listener that send part of a greeting (libzmq drops them at 5 s)
PUSHING = 30  # connections per listener that push frames as fast as they are taken
FLOOD_S = 8.0
MARGIN_MB = 15.0  # RSS after the flood, over the baseline
RETURN_S = 20.0
FIXED_COST = 64 * 1024  # libzmq's pipes and codec buffers per connection (measured ~25 KB)
SLACK_MB = 60.0  # allocator rounding, the reader's own frames in flight, Python objects


def frame_size(cap: int) -> int:
    return min(cap, 1 << 20) - 4096  # under the cap: delivered, then rejected unread


def bound_mb(cap: int) -> float:
    """What configure_listener lets one listener buffer for HELD + PUSHING connections."""
    per_pushing = (listener_rcvhwm(cap) + 2) * frame_size(cap) + FIXED_COST
    return (PUSHING * per_pushing + (HELD + PARTIAL + PUSHING) * FIXED_COST) / 2**20


def rss_mb(p: psutil.Process) -> float:
    return p.memory_info().rss / 2**20


def targets(endpoint: str, cap: int) -> list[dict]:
    return [{"endpoint": endpoint, "connections": HELD, "mode": "held"},
            {"endpoint": endpoint, "connections": PARTIAL, "mode": "greeting"},
            {"endpoint": endpoint, "connections": PUSHING, "mode": "frames",
             "frame": frame_size(cap), "frames": 10_000}]


@pytest.mark.timeout(300)
def test_held_connections_are_bounded_and_their_memory_comes_back(tmp_path):
    home = tmp_path / "home"
    ensure_key(home)
    sup = subprocess.Popen(supervisor_argv(home, "--log-level", "WARNING"), cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    d = Deployment(tmp_path / "rank", mode="single")
    attacker = None
    try:
        eps = json.loads(sup.stdout.readline())
        admin = AdminClient(eps["admin"], load_cluster_key(home / "keys" / "cluster.key"))
        d.start(timeout=120)
        reference = d.generate([3, 1, 4, 1, 5], 8).tokens

        def serving() -> None:
            assert admin.call("ping", 30).ok
            assert d.generate([3, 1, 4, 1, 5], 8, timeout=60).tokens == reference

        serving()
        procs = {"supervisor": psutil.Process(sup.pid), "rank 0": psutil.Process(d.procs[0].pid)}
        base = {name: rss_mb(p) for name, p in procs.items()}
        caps = {"supervisor": [(eps["admin"], ADMIN_MAX), (eps["report"], REPORT_MAX)],
                "rank 0": [(d.plan_endpoint, PLAN_IN_MAX), (d.requests_endpoint, DEFAULT_MAX_SIZE)]}
        plan = {"seconds": FLOOD_S,
                "targets": [t for sockets in caps.values() for ep, cap in sockets
                            for t in targets(ep, cap)]}
        attacker = subprocess.Popen([sys.executable, "-m", "tests.faults.zmtp_hold"], cwd=REPO,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        attacker.stdin.write(json.dumps(plan))
        attacker.stdin.close()
        ready = json.loads(attacker.stdout.readline())["ready"]
        assert list(ready.values()) == [HELD + PARTIAL + PUSHING] * 4, ready

        peak = dict(base)
        serving()  # during the flood
        while attacker.poll() is None:
            for name, p in procs.items():
                peak[name] = max(peak[name], rss_mb(p))
            time.sleep(0.2)
        sent = json.loads(attacker.stdout.read())["done"]
        assert attacker.returncode == 0
        assert min(sent.values()) > 0, sent  # every listener took frames

        def back() -> dict | None:
            now = {name: rss_mb(p) for name, p in procs.items()}
            return now if all(now[n] <= base[n] + MARGIN_MB for n in now) else None

        t0 = time.monotonic()
        after = poll_for(back, RETURN_S, "RSS back within the margin of its baseline", 0.25)
        returned_s = time.monotonic() - t0
        serving()  # after the flood
        bounds = {name: sum(bound_mb(cap) for _, cap in sockets) + SLACK_MB
                  for name, sockets in caps.items()}
        report = {n: {"base": round(base[n], 1), "peak": round(peak[n], 1),
                      "after": round(after[n], 1), "bound_growth": round(bounds[n], 1)}
                  for n in procs}
        print(f"\nRSS MB under {HELD} held + {PUSHING} pushing connections per listener "
              f"(back in {returned_s:.1f}s):", json.dumps(report))
        for n in procs:
            assert peak[n] - base[n] <= bounds[n], report
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait(10)
        d.teardown()
        sup.terminate()
        sup.wait(30)
