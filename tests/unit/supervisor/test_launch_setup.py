"""A launch's setup (job files, keys, channels, endpoints, manifest) reaches its
deployment once, as one `LaunchSetup` (`job_launch.prepare` → `Deployment.launched`), and
the ranks' states from the plan (`Deployment.ranks_planned`); a prepare that fails leaves
no files behind and the deployment without a setup."""

from __future__ import annotations

import pytest

from common.home import Paths, read_manifests
from common.messages import Backend
from services.supervisor import job_launch
from services.supervisor.deployment import Deployment
from services.supervisor.hosts import Member
from services.supervisor.job_launch import SupervisorIdentity
from services.supervisor.plan import DeployPlan


def _dep(n: int = 2) -> Deployment:
    members = [Member(index=i, host_index=0, host="local", ssh="127.0.0.1", ip="127.0.0.1",
                      local=True, rdma_ctl=False, rdma_devices=(), rdma_row=())
               for i in range(n)]
    plan = DeployPlan(model_path="/m/tiny", tp=n, pp=1, backend=Backend.RING,
                      requested_backend=Backend.AUTO, hosts=None, members=members)
    return Deployment("d", "j", plan)


def _me() -> SupervisorIdentity:
    return SupervisorIdentity(pid=1, start_time=2.0, boot_id="boot", sender="sup",
                              control_endpoint="tcp://127.0.0.1:1",
                              report_endpoint="tcp://127.0.0.1:2", kv_key=b"k" * 32)


def test_prepare_sets_the_whole_setup_at_once(tmp_path) -> None:
    paths = Paths(tmp_path)
    paths.ensure()
    dep = _dep()
    job_launch.prepare(dep, paths, _me(), rank_endpoints={1: ("tcp://a:1", "tcp://a:2")})
    assert dep.job_dir == job_launch.job_dir(paths, "j") and dep.job_dir.is_dir()
    assert dep.secret_path == paths.secrets / "j.key" and dep.secret_path.exists()
    assert dep.keys is not None and dep.control is not None and dep.report is not None
    assert dep.plan_endpoint.startswith("tcp://127.0.0.1:")
    assert dep.requests_endpoint.startswith("tcp://127.0.0.1:")
    assert dep.plan_endpoint != dep.requests_endpoint and dep.jaccl_coordinator == ""
    assert dep.rank_endpoints == {1: ("tcp://a:1", "tcp://a:2")}
    assert (dep.job_dir / "hostfile.json").exists()
    assert [m for _, m in read_manifests(paths).manifests] == [dep.manifest]
    assert dep.manifest.ranks == [] and dep.manifest.secret_path == str(dep.secret_path)
    with pytest.raises(AssertionError, match="launched twice"):
        dep.launched(None, dep.manifest)  # type: ignore[arg-type] - a second setup is a bug
    dep.ranks_planned()
    assert sorted(dep.ranks) == [0, 1] and dep.ranks[1].host == "local"


def test_a_prepare_that_fails_leaves_no_files_and_no_setup(tmp_path, monkeypatch) -> None:
    paths = Paths(tmp_path)
    paths.ensure()
    dep = _dep()

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job_launch, "write_manifest", full_disk)
    with pytest.raises(OSError, match="No space"):
        job_launch.prepare(dep, paths, _me())
    assert not job_launch.job_dir(paths, "j").exists()
    assert not (paths.secrets / "j.key").exists()
    assert (dep.keys, dep.job_dir, dep.secret_path, dep.manifest) == (None, None, None, None)
