"""The live tests' boot options (tests/support/up_cluster.py): the command line and the
environment `lockstep up` gets from them, checked without starting it."""

from __future__ import annotations

from pathlib import Path

from services.up.__main__ import _parser
from tests.support.up_cluster import INHERITED, UpOptions

HOME = Path("/h")


def parsed(opts: UpOptions):
    argv = opts.argv(HOME, 8123)
    assert argv[1:4] == ["-m", "services", "up"]
    return _parser().parse_args(argv[4:])


def test_the_typed_options_reach_ups_own_parser():
    a = parsed(UpOptions(tp=2, pp=1, replicas=2, restarts=4, hosts=Path("/x/hosts.json"),
                         extra=("--restart-window", "15")))
    assert (a.home, a.port, a.model, a.tp, a.pp, a.replicas, a.restarts, a.hosts,
            a.restart_window) == (HOME, 8123, "tiny", 2, 1, 2, 4, Path("/x/hosts.json"), 15.0)


def test_none_leaves_a_flag_to_ups_default():
    argv = UpOptions(model=None).argv(HOME, 8123)
    assert not {"--model", "--tp", "--pp", "--replicas", "--restarts", "--hosts"} & set(argv)
    assert {"--admin-port", "--events-port", "--control-port", "--report-port",
            "--reaper-events-port"} <= set(argv)  # internal sockets on free ports


def test_the_environment_has_no_lockstep_setting_of_the_callers_shell(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_TP", "3")
    monkeypatch.setenv("LOCKSTEP_PORT_RANGE", "40000-40999")
    monkeypatch.setenv("HF_HUB_CACHE", "/somewhere")
    env = UpOptions(env={"LOCKSTEP_ADMIT_WAIT": "0", "HF_HUB_CACHE": None}).environ()
    assert "LOCKSTEP_TP" not in env and "HF_HUB_CACHE" not in env
    assert env["LOCKSTEP_PORT_RANGE"] == "40000-40999"  # the worker's slice (conftest)
    assert env["LOCKSTEP_ADMIT_WAIT"] == "0"
    assert {k for k in env if k.startswith("LOCKSTEP_")} <= INHERITED | {"LOCKSTEP_ADMIT_WAIT"}
