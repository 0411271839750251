"""Backend selection (DESIGN.md 5.1): jaccl only when every member has RDMA control and a
device (and a link to every other host when a matrix is given); each blocker named;
fewer than two members is a single rank with no distributed init."""

from __future__ import annotations

import json

import pytest

from services.supervisor.errors import AdminError
from services.supervisor.hosts import (
    HostsError,
    jaccl_devices,
    members_from_host_records,
    read_hosts_file,
    select_backend,
)
from services.supervisor.plan import make_plan, selection_for, signature

READY = {"ssh": "localhost", "rdma_ctl": True, "rdma_devices": ["rdma_en3"]}


def _members(*hosts, slots=None):
    return members_from_host_records([dict(h) for h in hosts], slots=slots)


def test_all_rdma_ready_gives_jaccl():
    sel = select_backend(_members(dict(READY, name="a"), dict(READY, name="b")))
    assert sel.backend == "jaccl" and sel.blockers == []


def test_one_blocker_is_named_with_its_reason():
    sel = select_backend(_members(dict(READY, name="a"),
                                  dict(READY, name="b", rdma_devices=[])))
    assert sel.backend == "ring"
    assert sel.blockers == [{"member": "b", "reason": "no RDMA device"}]


def test_every_blocker_is_listed():
    sel = select_backend(_members({"ssh": "h1", "name": "a"}, dict(READY, name="b")))
    assert sel.backend == "ring"
    assert [(b["member"], b["reason"]) for b in sel.blockers] == [
        ("a", "RDMA control is not enabled (rdma_ctl false)"), ("a", "no RDMA device")]


def test_rdma_connectivity_matrix():
    a = {"ssh": "localhost", "name": "a", "rdma_ctl": True, "rdma": [None, "rdma_en5"]}
    b = {"ssh": "127.0.0.1", "name": "b", "rdma_ctl": True, "rdma": ["rdma_en4", None]}
    assert select_backend(_members(a, b)).backend == "jaccl"
    cut = dict(b, rdma=[None, None])
    sel = select_backend(_members(a, cut))
    assert sel.backend == "ring"
    assert {"member": "b", "reason": "no RDMA link to host 0"} in sel.blockers


def test_jaccl_device_file_is_indexed_by_rank():
    # One device per host and no matrix: that device toward every other host.
    assert jaccl_devices(_members(dict(READY, rdma_devices=["en3"]),
                                  dict(READY, rdma_devices=["en4"]))) == [[None, "en3"],
                                                                        ["en4", None]]
    a = {"ssh": "localhost", "rdma_ctl": True, "rdma": [None, "en5", "en6"]}
    b = {"ssh": "localhost", "rdma_ctl": True, "rdma": ["en7", None, "en8"]}
    c = {"ssh": "localhost", "rdma_ctl": True, "rdma": ["en9", "en10", None]}
    assert jaccl_devices(_members(a, b, c)) == [[None, "en5", "en6"], ["en7", None, "en8"],
                                                ["en9", "en10", None]]


def test_jaccl_blockers_for_what_the_device_file_cannot_express():
    sel = select_backend(_members(dict(READY, name="a", rdma_devices=["en3", "en4"]),
                                  dict(READY, name="b")))
    assert sel.backend == "ring" and sel.blockers[0]["member"] == "a"
    assert "no connectivity matrix" in sel.blockers[0]["reason"]
    sel = select_backend(_members(dict(READY, name="a", ranks_per_host=2), dict(READY, name="b")))
    assert sel.backend == "ring"
    assert {"member": "a", "reason": "2 ranks on one host: jaccl runs one per host"} in sel.blockers


def test_fewer_than_two_members_is_single_rank():
    sel = select_backend(_members(READY))
    assert sel.backend == "none" and "fewer than two" in sel.blockers[0]["reason"]
    assert selection_for(None, "auto", 1).backend == "none"
    assert selection_for(None, "auto", 2).backend == "ring"  # two ranks on this machine


def test_placement_ranks_per_host_and_too_few_slots():
    ms = _members(dict(READY, name="a", ranks_per_host=2), dict(READY, name="b"), slots=3)
    assert [(m.index, m.host) for m in ms] == [(0, "a"), (1, "a"), (2, "b")]
    with pytest.raises(HostsError, match="2 rank slot"):
        _members(READY, READY, slots=3)


def test_mlx_launch_hostfile_is_read_as_is(tmp_path):
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({"backend": "ring", "envs": ["A=1"],
                             "hosts": [{"ssh": "localhost", "ips": ["127.0.0.1"]},
                                       {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]}))
    doc = read_hosts_file(f)
    assert doc.backend == "ring" and doc.envs == ["A=1"] and len(doc.hosts) == 2
    assert doc.backend_for("auto") == "ring" and doc.backend_for("mpi") == "mpi"
    f.write_text(json.dumps({"hosts": [{"ssh": "x", "colour": "red"}]}))
    with pytest.raises(HostsError, match="colour"):
        read_hosts_file(f)


def test_plan_rules_and_signature(tmp_path):
    # the shape only: topology is checked from config.json (services/supervisor/topology.py)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "num_hidden_layers": 4}))
    with pytest.raises(AdminError, match="not supported"):
        make_plan(str(tmp_path), 2, 2, None, "auto")
    with pytest.raises(AdminError, match="jaccl is blocked"):
        make_plan(str(tmp_path), 2, 1, None, "jaccl")
    with pytest.raises(AdminError, match="safetensors.index"):
        make_plan(str(tmp_path), 1, 2, None, "auto")
    remote = make_plan(str(tmp_path), 2, 1, [READY, {"ssh": "user@far", "ips": ["10.0.0.9"],
                                                     "python": "/opt/py/bin/python"}], "ring")
    assert [m.local for m in remote.members] == [True, False]
    assert remote.members[1].ip == "10.0.0.9" and remote.members[1].python == "/opt/py/bin/python"
    with pytest.raises(AdminError, match="absolute path"):
        make_plan(str(tmp_path), 2, 1, [READY, {"ssh": "user@far", "home": "rel/dir"}], "ring")
    with pytest.raises(AdminError, match="invalid ssh target"):
        make_plan(str(tmp_path), 2, 1, [READY, {"ssh": "-oProxyCommand=x"}], "ring")
    with pytest.raises(AdminError, match="mpirun"):
        make_plan(str(tmp_path), 2, 1, None, "mpi")
    plan = make_plan(str(tmp_path), 2, 1, None, "auto")
    assert plan.backend == "ring" and plan.world_size == 2
    single = make_plan(str(tmp_path), 1, 1, None, "ring")
    assert single.backend == "none"
    key = b"k" * 32
    s1 = signature(key, "d", "j1", plan)
    assert s1 == signature(key, "d", "j1", plan)
    assert s1 != signature(key, "d", "j2", plan) != signature(key, "d", "j1", single)
