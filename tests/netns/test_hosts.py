"""Real separate hosts (network namespaces with sshd): ssh in batch mode, the host
agent's operations over ssh, a pulled cable, MLX's ring backend across two hosts, and a
teardown that leaves nothing behind."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from common import ssh as sshmod
from common.procs import start_time_of
from common.ssh import SshTarget
from tests.netns.hosts import PYTHON, REPO_ROOT, NetnsCluster, leftovers_of
from tests.support.polling import wait_for
from tests.support.processes import netns_of

pytestmark = pytest.mark.netns

A, B = 0, 1
SECRET = "s3cret-value-that-must-not-be-on-a-command-line"


@pytest.mark.timeout(60)
def test_hosts_answer_over_ssh_in_batch_mode(netns_cluster, tmp_path):
    c = netns_cluster
    for i in (A, B):
        cp = c.ssh(i, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], timeout=20)
        assert cp.returncode == 0, cp.stderr
        assert f"inet {c.address(i)}/" in cp.stdout.decode()  # the command ran on host i
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        assert c.ssh(B, ["true"], timeout=20).returncode == 0
        times.append(time.monotonic() - t0)
    print(f"\nnetns cluster, {c.n_hosts} hosts: setup {c.timings['setup_s']:.2f}s")
    print(f"ssh round trip (true): median {statistics.median(times) * 1000:.0f} ms, "
          f"min {min(times) * 1000:.0f} ms")

    # Batch mode: what would prompt fails at once with ssh's own status instead.
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
                   check=True, timeout=30)
    # IdentityFile adds to the config's list rather than replacing it: no config here.
    unknown_key = SshTarget(c.ssh_target(B).target, config_file=os.devnull,
                            options=(f"IdentityFile={stranger}", "IdentitiesOnly=yes",
                                     "IdentityAgent=none", f"UserKnownHostsFile={c.known_hosts}"))
    cp = sshmod.run(unknown_key, ["true"], timeout=20)
    assert cp.returncode == sshmod.SSH_ERROR_STATUS
    assert b"Permission denied" in cp.stderr
    empty_known_hosts = tmp_path / "known_hosts"
    empty_known_hosts.touch()
    unknown_host = SshTarget(c.ssh_target(B).target, config_file=str(c.ssh_config),
                             options=(f"UserKnownHostsFile={empty_known_hosts}",))
    cp = sshmod.run(unknown_host, ["true"], timeout=20)
    assert cp.returncode == sshmod.SSH_ERROR_STATUS
    assert b"Host key verification failed" in cp.stderr


@pytest.mark.timeout(90)
def test_spawn_identify_signal_wait_over_ssh(netns_cluster, remote_procs):
    c = netns_cluster
    home = c.host_dir(B) / "home"
    argv = [PYTHON, "-m", "tests.fakes.sleeper_rank", "--home", str(home),
            "--deployment", "dep1", "--job", "job1", "--rank", "1"]
    info = remote_procs.spawn(B, argv, env={"LOCKSTEP_TEST_SECRET": SECRET},
                              log=str(c.host_dir(B) / "sleeper.log"))
    pid = info["pid"]
    assert info["cmdline"] == argv and info["pgid"] == pid
    assert netns_of(pid) == c.namespaces[B]  # it runs on host B, not here
    assert os.getsid(pid) == pid  # its own session: the agent is gone, it is not
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"LOCKSTEP_TEST_SECRET={SECRET}".encode() in environ
    assert SECRET.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()

    ident = c.agent(B, "identify", str(pid))
    assert ident == {k: info[k] for k in ("pid", "start_time", "cmdline")}
    # Host A has the same pid space here (namespaces share it), so identity, not the
    # host, is what this proves; the markers below are host B's own files.
    scan = wait_for("the sleeper's marker on host B", lambda: c.agent(
        B, "read-markers", "--home", str(home), "--deployment", "dep1")["markers"], 20)
    assert [(m["marker"]["rank"], m["marker"]["pid"]) for m in scan] == [(1, pid)]

    cmdline = json.dumps(info["cmdline"])
    wrong = c.agent(B, "signal", str(pid), repr(info["start_time"] - 5), "KILL",
                    "--cmdline-json", cmdline)
    assert wrong == {"sent": False}
    other = c.agent(B, "signal", str(pid), repr(info["start_time"]), "KILL",
                    "--cmdline-json", json.dumps([*info["cmdline"], "x"]))
    assert other == {"sent": False}
    assert c.agent(B, "identify", str(pid)) is not None  # refused signals did nothing

    assert c.agent(B, "signal", str(pid), repr(info["start_time"]), "TERM",
                   "--cmdline-json", cmdline) == {"sent": True}
    left = c.agent(B, "wait-exit", "--identities-json", json.dumps([ident]), "--timeout", "10")
    assert left == {"survivors": []}
    assert c.agent(B, "identify", str(pid)) is None


@pytest.mark.timeout(60)
def test_write_file_over_ssh_is_0600(netns_cluster):
    c = netns_cluster
    path = c.host_dir(B) / "runtime" / "secrets" / "job1.key"
    secret = os.urandom(32)
    answer = c.agent(B, "write-file", str(path), "--mode", "600", "--parents", input=secret)
    assert answer == {"path": str(path), "bytes": 32, "mode": "600"}
    st = path.stat()
    assert st.st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.read_bytes() == secret
    assert [p.name for p in path.parent.iterdir()] == ["job1.key"]  # no temp file left


@pytest.mark.timeout(90)
def test_link_down_fails_within_connect_timeout_and_link_up_restores(netns_cluster):
    c = netns_cluster
    assert c.ssh(B, ["true"], timeout=20).returncode == 0
    c.link_down(B)
    try:
        t0 = time.monotonic()
        cp = c.ssh(B, ["true"], timeout=c.connect_timeout + 20)
        elapsed = time.monotonic() - t0
        assert cp.returncode == sshmod.SSH_ERROR_STATUS
        assert b"timed out" in cp.stderr
        assert elapsed < c.connect_timeout + 2.0, elapsed
        print(f"\nssh to a host with its link down failed after {elapsed:.2f}s "
              f"(ConnectTimeout {c.connect_timeout:g}s)")
        assert c.ssh(A, ["true"], timeout=20).returncode == 0  # only B is cut off
    finally:
        c.link_up(B)
    t0 = time.monotonic()
    wait_for("ssh to host B after link_up",
             lambda: c.ssh(B, ["true"], timeout=c.connect_timeout + 20).returncode == 0, 20)
    print(f"ssh back {time.monotonic() - t0:.2f}s after link_up")


@pytest.mark.timeout(180)
def test_mlx_ring_all_sum_across_two_hosts(netns_cluster, remote_procs):
    from tests.netns.ring_allsum import expected

    c = netns_cluster
    port = random.randrange(20000, 60000)  # each namespace has its own, empty, port space
    hostfile = json.dumps([[f"{c.address(i)}:{port}"] for i in (A, B)]).encode()
    outs, infos = [], []
    for rank, host in enumerate((A, B)):
        d = c.host_dir(host) / "ring"
        hf = d / "hostfile.json"
        c.agent(host, "write-file", str(hf), "--parents", input=hostfile)
        out = d / f"out-{rank}.json"
        outs.append(out)
        info = remote_procs.spawn(
            host, [PYTHON, str(REPO_ROOT / "tests" / "netns" / "ring_allsum.py"), str(out)],
            env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hf)}, log=str(d / f"rank{rank}.log"))
        infos.append((host, info))

    def logs() -> str:
        return "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(c.run_dir.glob("hosts/*/ring/*.log")))

    t0 = time.monotonic()
    try:
        wait_for("both ranks' results", lambda: all(o.exists() for o in outs), 120, 0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs()}") from None
    print(f"\nring all_sum across 2 hosts: results after {time.monotonic() - t0:.1f}s")
    for rank, out in enumerate(outs):
        result = json.loads(out.read_text())
        # each rank ran inside its own host's network namespace (it may have exited by now,
        # so ask its own record rather than `ip netns identify PID`)
        host = (A, B)[rank]
        netns = os.stat(f"/run/netns/{c.namespaces[host]}").st_ino
        assert result == {"rank": rank, "size": 2, "result": expected(2), "netns": netns}, logs()
    # They exit by themselves after the closing barrier; prove it over ssh.
    for host, info in infos:
        ident = {k: info[k] for k in ("pid", "start_time", "cmdline")}
        left = c.agent(host, "wait-exit", "--identities-json", json.dumps([ident]),
                       "--timeout", "30")
        assert left == {"survivors": []}, logs()


@pytest.mark.timeout(120)
def test_close_removes_everything_it_made(netns_required):
    t0 = time.monotonic()
    cluster = NetnsCluster(1, prefix="lt")
    setup = time.monotonic() - t0
    try:
        assert cluster.ssh(0, ["true"], timeout=20).returncode == 0
        # Left running on purpose: close() must kill it and say so.
        stray = cluster.agent(0, "spawn", "--cwd", "/", "--log", str(cluster.host_dir(0) / "s.log"),
                              "--", "sleep", "600")
        names = (cluster.bridge, *cluster.veths, *cluster.namespaces)
        sshds = [psutil.Process(p) for p in cluster.sshd_pids()]
        run_dir = cluster.run_dir
    except BaseException:
        cluster.close()
        raise
    report = cluster.close()
    print(f"\nnetns cluster, 1 host: setup {setup:.2f}s, teardown {report.seconds:.2f}s")
    assert report.clean, report.errors
    assert any(f"{stray['pid']} sleep 600" in k for k in report.killed), report.killed
    assert cluster.leftovers() == []
    assert not set(names) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                               text=True).stdout.split())
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not [n for n in names if f" {n}:" in links or f" {n}@" in links]
    for p in sshds:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    assert not run_dir.exists()
    stray_proc = None
    try:
        stray_proc = psutil.Process(stray["pid"])
    except psutil.NoSuchProcess:
        pass
    assert (stray_proc is None or stray_proc.status() == psutil.STATUS_ZOMBIE
            or abs(start_time_of(stray_proc) - stray["start_time"]) > 0.01)
    assert cluster.close().killed == []  # idempotent


@pytest.mark.timeout(120)
def test_interpreter_exit_without_close_still_tears_down(netns_required):
    code = ("import json; from tests.netns.hosts import NetnsCluster; "
            "c = NetnsCluster(1, prefix='lx'); "
            "print(json.dumps({'bridge': c.bridge, 'veths': c.veths, "
            "'namespaces': c.namespaces, 'run_dir': str(c.run_dir), "
            "'sshd': c.sshd_pids()}), flush=True)")
    cp = subprocess.run([PYTHON, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=90)
    assert cp.returncode == 0, cp.stderr
    made = json.loads(cp.stdout.splitlines()[-1])
    # The finalizer ran at exit: nothing of that run is left.
    assert leftovers_of(made["bridge"], made["veths"], made["namespaces"],
                        Path(made["run_dir"])) == []
    for pid in made["sshd"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
