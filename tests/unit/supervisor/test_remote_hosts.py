"""Remote host records: what counts as local (one definition, common.ssh.is_local), the
defaults a remote host inherits from the supervisor, and the endpoints ranks there get."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.supervisor.hosts import HostsError, members_from_host_records
from services.supervisor.process_launcher import ROOT
from services.supervisor.remote import SshLauncher
from services.supervisor.sockets import _with_host, source_address


@pytest.mark.parametrize(("ssh", "local"), [
    ("", True), ("localhost", True), ("127.0.0.1", True), ("me@127.0.0.1", True),
    ("::1", True), ("user@10.0.0.2", False), ("rank-b", False),
])
def test_is_local_is_common_ssh_s(ssh, local):
    (m,) = members_from_host_records([{"ssh": ssh, "ips": ["10.0.0.9"]}])
    assert m.local is local


def test_remote_member_defaults_come_from_the_supervisor(tmp_path):
    (m,) = members_from_host_records([{"ssh": "u@10.0.0.2"}])
    assert m.ip == "10.0.0.2"  # no ips: the ssh host
    launcher = SshLauncher(home=tmp_path / "h", ssh_config="/cfg", connect_timeout=2.0,
                           command_timeout=10.0)
    host = launcher.host(m)
    assert host.python == sys.executable and host.home == str((tmp_path / "h").absolute())
    assert host.cwd == str(ROOT) and host.target.config_file == "/cfg"
    assert host.target.connect_timeout == 2.0 and host.timeout == 12.0
    (own,) = members_from_host_records([{"ssh": "u@10.0.0.2", "python": "/py", "home": "/rh",
                                         "cwd": "/src", "ssh_config": "/own"}])
    host = launcher.host(own)
    assert (host.python, host.home, host.cwd, host.target.config_file) == (
        "/py", "/rh", "/src", "/own")
    assert host.paths.secrets == Path("/rh/runtime/secrets")


def test_bad_remote_fields_are_refused():
    with pytest.raises(HostsError, match="absolute"):
        members_from_host_records([{"ssh": "u@h", "python": "python3"}])
    with pytest.raises(HostsError, match="invalid ssh target"):
        members_from_host_records([{"ssh": "u@h -oProxyCommand=x"}])


def test_endpoint_helpers():
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert _with_host("tcp://0.0.0.0:7712", "10.0.0.1") == "tcp://10.0.0.1:7712"
