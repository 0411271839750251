"""`lockstep up`'s admin link reads the two records it shares with the supervisor through
their one strict reader each: runtime/supervisor.json (SupervisorRecord) to find its
supervisor, DeploymentInfo in the `deployments` reply to follow and tear down. Driven
against the fake supervisor's real admin socket (signed envelopes, port 0)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from common.atomic_json import write_json_atomic
from common.deployment_info import DeploymentInfo
from common.envelope import BOOT_ID
from common.home import Paths, write_supervisor_record
from common.keys import ensure_cluster_key
from common.messages import AdminReply
from common.records import SupervisorRecord
from services.up.admin import AdminLink, UpError
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor


@pytest.fixture
def cluster(tmp_path):
    paths = Paths(tmp_path / "home").ensure()
    key = ensure_cluster_key(paths.cluster_key)
    rank = FakeRank0(key).start()
    sup = FakeSupervisor(key, rank, str(tmp_path / "model")).start()
    link = AdminLink(paths, key, sup_pid=os.getpid())
    yield paths, sup, link
    if link.client is not None:
        link.client.close()
    link.ctx.term()
    sup.stop()
    rank.stop()


def _record(sup: FakeSupervisor, pid: int) -> SupervisorRecord:
    return SupervisorRecord(pid=pid, boot_id=BOOT_ID, start_time=time.time(),
                            admin=sup.admin_endpoint, events=sup.events_endpoint,
                            control="tcp://127.0.0.1:1", report="tcp://127.0.0.1:2")


@pytest.mark.timeout(60)
def test_up_takes_only_a_strict_record_naming_its_own_supervisor(cluster):
    paths, sup, link = cluster
    never = threading.Event()
    # The spelling an old reader accepted and nothing writes: refused, so up keeps waiting.
    legacy = {**_record(sup, os.getpid()).to_dict(), "admin_endpoint": sup.admin_endpoint}
    del legacy["admin"]
    write_json_atomic(paths.supervisor_file, legacy)
    with pytest.raises(UpError, match="did not come up"):
        link.wait_endpoints(1.0, never, lambda: None)
    write_supervisor_record(paths.supervisor_file, _record(sup, os.getpid() + 1))  # not ours
    with pytest.raises(UpError, match="did not come up"):
        link.wait_endpoints(1.0, never, lambda: None)
    assert not sup.commands  # neither file made up talk to anyone

    write_supervisor_record(paths.supervisor_file, _record(sup, os.getpid()))
    assert link.wait_endpoints(10.0, never, lambda: None) == \
        (sup.admin_endpoint, sup.events_endpoint)
    assert [c.command for c in sup.commands] == ["ping"]


@pytest.mark.timeout(60)
def test_up_follows_and_tears_down_deployments_read_strictly(cluster):
    paths, sup, link = cluster
    write_supervisor_record(paths.supervisor_file, _record(sup, os.getpid()))
    link.wait_endpoints(10.0, threading.Event(), lambda: None)

    dep = link.deployment("dep-fake")
    assert isinstance(dep, DeploymentInfo) and dep.state == "serving"
    assert [(r.rank, r.pid, r.remote) for r in dep.ranks] == [(0, 1, False)]
    pids: set[int] = set()
    logs: list[str] = []
    assert link.abort_and_teardown(logs.append, pids)
    assert pids == {1} and sup.state == "gone"
    assert any("deployment dep-fake torn down (graceful" in line for line in logs)

    # A deployment the supervisor would never send is an error naming the field, not a guess.
    sup.replies["deployments"] = AdminReply(
        request_id="-", ok=True, code="ok",
        data={"deployments": [{"deployment_id": "odd", "state": "serving"}]})
    with pytest.raises(UpError, match=r"deployments reply: missing_field: deployments\[\]\.job_id"):
        link.deployments(5.0)
    assert link.deployment("odd") is None  # progress() polls through this: no answer yet
