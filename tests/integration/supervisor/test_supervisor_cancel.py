"""Cancel broadcasts and abort_all against fake ranks: epochs acked by every rank and
persisted across a supervisor restart; abort_all's zero-active evidence; unloading with
active requests is refused unless forced (then abort_all evidence, then teardown)."""

from __future__ import annotations

import json

import pytest

from common.home import Paths
from common.messages import CancelScope, commands
from tests.support.requests import RequestsClient
from tests.support.supervisor import pid_gone, poll_for


def _dep(rs, dep_id):
    return next(d for d in rs.ok("deployments")["deployments"] if d["deployment_id"] == dep_id)


@pytest.mark.timeout(60)
def test_cancel_epochs_persist_across_supervisor_restart(start_supervisor, home, model_dir):
    rs = start_supervisor()  # typed: each reply decoded once into its command's Reply
    rs.ask(commands.deploy.Args(model_path=str(model_dir), tp=2, deployment_id="c1"))
    first = rs.ask(commands.cancel.Args("c1", CancelScope.ALL, reason="test"))
    second = rs.ask(commands.cancel.Args("c1", CancelScope.REQUESTS, ["nope"]))
    assert (first.epoch, second.epoch) == (1, 2)
    assert sorted(second.acked) == ["0", "1"] and second.missing == []
    ranks = rs.ask(commands.deployments.Args()).get("c1").ranks
    assert {r.acked_epoch for r in ranks} == {2}
    state = json.loads((Paths(home).state / "cancel_epoch.json").read_text())
    assert state["epoch"] == 2
    assert rs.ask(commands.stop.Args("c1")).outcome.proven
    rs.close()

    rs2 = start_supervisor()  # same home: a restarted supervisor
    assert rs2.ask(commands.status.Args()).cancel_epoch == 2
    rs2.ask(commands.deploy.Args(model_path=str(model_dir), tp=2, deployment_id="c2"))
    third = rs2.ask(commands.cancel.Args("c2", CancelScope.ALL))
    assert third.epoch == 3 and sorted(third.acked) == ["0", "1"]
    status = rs2.ask(commands.status.Args())
    assert status.cancel_epoch == 3
    assert [r.acked_epoch for r in status.deployments[0].ranks] == [3, 3]


@pytest.mark.timeout(60)
def test_abort_all_evidence_and_forced_unload(start_supervisor, model_dir):
    rs = start_supervisor()
    rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="busy")
    client = RequestsClient(_dep(rs, "busy"))
    try:
        rids = [client.generate([5, 6, 7], 1_000_000) for _ in range(3)]
        poll_for(lambda: (client.pump(), _dep(rs, "busy")["ranks"][0]["active"] == 3)[1], 10,
                 "rank 0 telemetry showing 3 active requests")
        refused = rs.call("stop", deployment_id="busy")
        assert refused.code == "active_requests" and refused.data["active"] == 3
        ev = rs.ok("abort_all", deployment_id="busy", timeout_s=10.0)
        assert ev["zero_active"] is True and ev["ranks"] == {"0": 0, "1": 0}, ev
        assert sorted(ev["acked"]) == ["0", "1"] and ev["missing"] == []
        assert sorted(ev["acked"]["0"]["cancelled"]) == sorted(rids)
        assert set(client.wait_finished(rids, 5).values()) == {"abort"}

        # Unload with active requests, forced: abort_all evidence first, then teardown.
        more = [client.generate([1], 1_000_000) for _ in range(2)]
        poll_for(lambda: (client.pump(), _dep(rs, "busy")["ranks"][0]["active"] == 2)[1], 10,
                 "two new active requests")
        pids = [r["pid"] for r in _dep(rs, "busy")["ranks"]]
        stop = rs.ok("stop", deployment_id="busy", force=True)
        assert stop["abort"]["zero_active"] and stop["abort"]["epoch"] > ev["epoch"]
        assert stop["outcome"]["proven"]
        assert set(client.wait_finished(more, 5).values()) == {"abort"}
        assert all(pid_gone(p) for p in pids)
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_stop_counts_a_request_admitted_since_the_last_telemetry(start_supervisor, model_dir):
    """Telemetry every 30 s: it still says 0 active when the request is running, so only a
    fresh count from rank 0 can refuse the unforced stop."""
    rs = start_supervisor(rank_telemetry_interval_s=30.0)
    rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="fresh")
    client = RequestsClient(_dep(rs, "fresh"))
    try:
        rid = client.generate([5, 6, 7], 1_000_000)
        poll_for(lambda: (client.pump(), client.tokens(rid))[1], 10, "the request's first tokens")
        assert _dep(rs, "fresh")["ranks"][0]["active"] == 0  # telemetry has not caught up
        refused = rs.call("stop", deployment_id="fresh")
        assert refused.code == "active_requests" and refused.data["active"] == 1
        assert rs.ok("stop", deployment_id="fresh", force=True)["outcome"]["proven"]
        assert client.wait_finished([rid], 5)[rid] == "abort"
    finally:
        client.close()
