"""A healthy cluster rejects nothing: the supervisor with real MLX ranks (TP=2 of the
embedded model, ring backend over loopback) deploys, stops and deploys again under the
same id, and after each start every rank's reject counters are empty, so the console's
'Rejected messages' table and /metrics' `lockstep_bus_rejected` show no rank row.

The supervisor publishes leases on the control PUB from the moment ranks are launched,
so a rank can hear one before its report handshake has verified the supervisor. That
lease is authentic: the rank holds it until the proof instead of counting it (issue 30).
The race is made certain here: the supervisor withholds its handshake replies to each
rank until it has published three leases since that rank's first HELLO."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest

from common.messages import Lease
from tests.support.supervisor import RunningSupervisor, fake_settings, poll_for

EARLY_LEASES = 3  # leases a rank's SUB hears before the supervisor answers its HELLO


def hold_handshakes_for_leases(rs: RunningSupervisor) -> Counter:
    """Withhold handshake replies to each rank identity until EARLY_LEASES leases went out
    after its first HELLO (the rank re-sends HELLO, backing off from 0.5 s). Both wrapped calls run
    on the supervisor's event loop. Returns the replies withheld per identity."""
    sockets = rs.sup.sockets
    adm = sockets.admission
    send, publish = adm._send, sockets.publish_control
    leases = [0]
    first_seen: dict[bytes, int] = {}
    withheld: Counter = Counter()

    def counting_publish(deployment_id, channel, body) -> None:
        leases[0] += isinstance(body, Lease)
        publish(deployment_id, channel, body)

    def gated_send(ident: bytes, data: bytes) -> None:
        if leases[0] - first_seen.setdefault(ident, leases[0]) < EARLY_LEASES:
            withheld[ident] += 1
            return
        send(ident, data)

    sockets.publish_control, adm._send = counting_publish, gated_send
    return withheld


def _fresh_ranks(rs: RunningSupervisor, since: float) -> list[dict] | None:
    """Every rank serving, with telemetry received after `since` (wall time)."""
    ranks = rs.ok("status")["deployments"][0]["ranks"]
    return ranks if all(r["phase"] == "serving" and r["last_seen"] > since
                        for r in ranks) else None


def _assert_clean(rs: RunningSupervisor) -> None:
    since = time.time()
    ranks = poll_for(lambda: _fresh_ranks(rs, since), 30, "telemetry after serving")
    assert {r["rank"]: r["rejects"] for r in ranks} == {0: {}, 1: {}}
    rows = [r for r in rs.ok("status")["rejections"] if r["service"] == "rank"]
    assert rows == []  # what the console's table and /metrics show for ranks


@pytest.mark.timeout(300)
def test_clean_start_and_redeploy_reject_nothing(tmp_path):
    settings = replace(fake_settings(tmp_path / "home"), rank_command="", load_timeout=150.0,
                       canary_window_s=1.0, canary_timeout_s=60.0, stop_timeout=10.0,
                       rank_telemetry_interval_s=0.2)
    rs = RunningSupervisor(settings)
    withheld = hold_handshakes_for_leases(rs)
    try:
        for attempt in ("start", "redeploy"):
            before = len(withheld)
            out = rs.ok("deploy", timeout=220, tp=2, deployment_id="clean")
            assert out["state"] == "serving", attempt
            assert len(withheld) - before == 2, attempt  # each rank heard leases first
            _assert_clean(rs)
            stop = rs.ok("stop", deployment_id="clean", timeout=60)
            assert stop["outcome"]["proven"], attempt
    finally:
        rs.close()
