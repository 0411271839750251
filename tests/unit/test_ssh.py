"""common.ssh without a network: the argv it builds, quoting through a real shell,
local targets, deadlines (with a stand-in ssh binary), and JSON answers."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time

import psutil
import pytest

from common import ssh
from common.ssh import SshError, SshTarget, SshTimeout


def test_argv_has_batch_mode_timeouts_keepalives_and_ends_options():
    t = SshTarget("root@10.0.0.2", config_file="/run/x/ssh_config", connect_timeout=2.5,
                  options=("Port=2222",))
    argv = ssh.ssh_argv(t, ["python", "-m", "services.hostagent", "identify", "12"])
    assert argv[:3] == ["ssh", "-F", "/run/x/ssh_config"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts[0] == "Port=2222"  # caller's options come first: ssh keeps the first value
    assert {"BatchMode=yes", "ConnectTimeout=3", "ServerAliveInterval=5",
            "ServerAliveCountMax=3"} <= set(opts)
    i = argv.index("root@10.0.0.2")
    assert argv[i + 1] == "--"
    assert argv[i + 2:] == ["python", "-m", "services.hostagent", "identify", "12"]


@pytest.mark.parametrize("arg", ["a b", "x;touch /tmp/pwned", "$(id)", "'q'", '"', "", "*",
                                 "--flag", "new\nline", "-"])
def test_remote_args_survive_the_remote_shell(arg):
    # ssh joins the remote argv with spaces and the remote shell splits it again.
    argv = ssh.ssh_argv("h", ["printf", "%s\\0", arg, "end"])
    joined = " ".join(argv[argv.index("--") + 1:])
    out = subprocess.run(["sh", "-c", joined], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [arg.encode(), b"end"]


@pytest.mark.parametrize("bad", ["", "-oProxyCommand=touch /tmp/x", "a b", "host\n"])
def test_targets_that_ssh_would_misread_are_refused(bad):
    with pytest.raises(ValueError):
        SshTarget(bad)


def test_options_must_be_key_value():
    with pytest.raises(ValueError):
        SshTarget("h", options=("-oProxyCommand=x",))
    with pytest.raises(ValueError):
        SshTarget("h", options=("BatchMode",))


def test_empty_remote_command_is_refused():
    with pytest.raises(ValueError):
        ssh.ssh_argv("h", [])


@pytest.mark.parametrize("target,local", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("me@localhost", True), ("root@127.0.0.1", True), ("10.0.0.2", False),
    ("root@10.213.4.2", False), ("localhost.example.com", False), ("rank-a", False),
])
def test_is_local(target, local):
    assert ssh.is_local(target) is local
    assert ssh.command_argv(target, ["true"]) == (["true"] if local else ssh.ssh_argv(target, ["true"]))


def test_local_run_is_direct_with_stdin():
    cp = ssh.run("localhost", [sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"],
                 input=b"abc", timeout=30)
    assert cp.returncode == 0 and cp.stdout == b"cba\n"
    assert cp.args[0] == sys.executable  # no ssh in between


@pytest.fixture
def fake_ssh(tmp_path):
    """A stand-in ssh binary: records its argv, then behaves as FAKE_SSH_MODE says."""
    path = tmp_path / "ssh"
    path.write_text(f"""#!{sys.executable}
import json, os, sys, time
open({str(tmp_path / "argv.json")!r}, "w").write(json.dumps(sys.argv))
open({str(tmp_path / "pid")!r}, "w").write(str(os.getpid()))
mode = os.environ.get("FAKE_SSH_MODE", "ok")
if mode == "hang":
    time.sleep(600)
if mode == "refused":
    sys.stderr.write("root@h: Permission denied (publickey).\\n"); sys.exit(255)
if mode == "noise":
    print("motd line from a login script")
print(json.dumps({{"stdin": sys.stdin.read()}}))
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_timeout_kills_ssh_and_names_the_target(fake_ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "hang")
    t = SshTarget("root@10.9.9.9", ssh_binary=str(fake_ssh))
    t0 = time.monotonic()
    with pytest.raises(SshTimeout) as err:
        ssh.run(t, ["sleep", "600"], timeout=1.0)
    assert time.monotonic() - t0 < 5
    assert "root@10.9.9.9" in str(err.value) and "1.0s" in str(err.value)
    pid = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_run_json_reads_the_last_line_and_passes_stdin(fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "noise")
    t = SshTarget("root@10.9.9.9", ssh_binary=str(fake_ssh))
    assert ssh.run_json(t, ["agent"], input=b"secret", timeout=30) == {"stdin": "secret"}


def test_run_json_turns_ssh_failure_into_an_error_naming_the_host(fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "refused")
    t = SshTarget("root@10.9.9.9", ssh_binary=str(fake_ssh))
    with pytest.raises(SshError) as err:
        ssh.run_json(t, ["agent"], timeout=30)
    assert err.value.returncode == 255
    assert "root@10.9.9.9" in str(err.value) and "Permission denied" in str(err.value)


def test_run_json_reports_a_command_failure_with_its_answer():
    code = "import json; print(json.dumps({'error': 'no such thing'})); raise SystemExit(1)"
    with pytest.raises(SshError) as err:
        ssh.run_json("localhost", [sys.executable, "-c", code], timeout=30)
    assert err.value.returncode == 1 and "no such thing" in str(err.value)


def test_secret_input_never_reaches_the_command_line(fake_ssh, tmp_path):
    t = SshTarget("root@10.9.9.9", ssh_binary=str(fake_ssh))
    assert ssh.run_json(t, ["agent", "spawn"], input=b"TOPSECRET", timeout=30) == {
        "stdin": "TOPSECRET"}
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert "TOPSECRET" not in " ".join(argv)
    assert argv[-3:] == ["--", "agent", "spawn"]


def test_ssh_that_cannot_start_is_an_ssh_error(tmp_path):
    t = SshTarget("root@10.9.9.9", ssh_binary=str(tmp_path / "no-such-ssh"))
    with pytest.raises(SshError, match="cannot start"):
        ssh.run(t, ["true"], timeout=5)
