"""Real separate hosts on this machine: network namespaces on a bridge, each running
its own sshd, for tests of remote ranks (issue 8).

    cluster = NetnsCluster(2, prefix="ls")      # needs root, iproute2, openssh-server
    cluster.ssh(0, ["hostname"])                # CompletedProcess, over real ssh
    cluster.agent(1, "identify", "1234")        # services.hostagent on host 1, as JSON
    cluster.link_down(1); cluster.link_up(1)    # cut / restore host 1's cable
    cluster.close()                             # everything it made is gone

Layout of one run (random token T, random free /24 10.213.X.0/24):
- bridge `<prefix>T` in the root namespace with 10.213.X.1 — the "control" host (the
  supervisor, reaper and gateway run in the root namespace and reach every rank host);
- host i: namespace `<prefix>hT-i`, a veth pair `<prefix>Tv<i>` (root side, on the
  bridge) / `eth0` (inside) with 10.213.X.(2+i)/24, loopback up, and its own sshd
  listening on that address only, with a host key generated for this run;
- a run directory (0700) with the host keys, one client key (the only authorized key),
  a known_hosts file holding the generated host keys, and an ssh client config
  (`ssh -F`) with batch mode, connect timeout and keep-alives.

A namespace shares the file system and the pid space with the root: the repository and
its interpreter are at the same paths on every "host" (`PYTHON`, `REPO_ROOT`), and
psutil sees every process. Processes started in a namespace inherit it.

`close()` is idempotent and also runs at interpreter exit (a `weakref.finalize` that
does not hold the cluster): it stops the sshds, kills whatever still runs in the
namespaces (and reports it: a test should have cleaned up itself), deletes the veths,
the namespaces and the bridge, removes the run directory, and then checks, with a
deadline (namespace teardown in the kernel is asynchronous), that nothing is left.
That teardown is tests/netns/hosts_teardown.py; running `ip` and picking the subnet,
tests/netns/iproute.py.
"""

from __future__ import annotations

import contextlib
import getpass
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from common import ssh as sshmod
from common.ssh import SshTarget
from services.hostagent import agent_argv
from tests.netns.hosts_teardown import Made, TeardownReport, leftovers_of, teardown
from tests.netns.iproute import NetnsError, die_with_parent, ip, pick_subnet

__all__ = ["DEFAULT_TOPOLOGY", "PYTHON", "REPO_ROOT", "NetnsCluster", "NetnsError",
           "TeardownReport", "address_plan", "host_name", "hosts_document", "leftovers_of",
           "missing_requirements"]

# The topology the harness builds by default, and the one docker-compose.test.yml
# describes: one control host (supervisor + reaper + gateway), two rank hosts.
DEFAULT_TOPOLOGY = {"control": 1, "rank_hosts": 2}
REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the same interpreter (and venv) on every namespace "host"
SSHD = "/usr/sbin/sshd"  # sshd refuses to start unless run by its absolute path
REQUIRED_TOOLS = ("ip", "ssh", "ssh-keygen")
SSH_PORT = 22
MAX_HOSTS = 26
SSHD_READY_S = 10.0
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,3}")


def host_name(i: int) -> str:
    """rank-a, rank-b, ... — the same names docker-compose.test.yml gives its rank hosts."""
    if not 0 <= i < MAX_HOSTS:
        raise ValueError(f"host index {i} out of range 0..{MAX_HOSTS - 1}")
    return f"rank-{chr(ord('a') + i)}"


def address_plan(subnet: str, n_hosts: int) -> tuple[str, list[str]]:
    """(control address, rank host addresses) in a /24: control .1, rank host i .(2+i).
    docker-compose.test.yml uses the same plan (its network gateway moved to .254)."""
    hosts = list(ipaddress.ip_network(subnet).hosts())
    if n_hosts > len(hosts) - 2:
        raise ValueError(f"{subnet} has no room for {n_hosts} hosts")
    return str(hosts[0]), [str(hosts[1 + i]) for i in range(n_hosts)]


def missing_requirements() -> list[str]:
    """Why these tests cannot run here (empty: they can). `make test` installs the
    tools (iproute2, openssh-server, openssh-client) and CI runs as root."""
    missing = []
    if os.geteuid() != 0:
        missing.append("not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` not found (apt-get install iproute2 openssh-client)")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} not found (apt-get install openssh-server)")
    return missing


def hosts_document(names: list[str], addresses: list[str], *, user: str = "root",
                   python: str = PYTHON, backend: str = "ring") -> dict[str, Any]:
    """An `mlx.launch` hostfile (DESIGN "Hosts file") for these rank hosts: what a
    supervisor would be given with --hosts (plus the client config, for ssh -F)."""
    if len(names) != len(addresses):
        raise ValueError("names and addresses differ in length")
    return {"backend": backend, "envs": [],
            "hosts": [{"name": n, "ssh": f"{user}@{a}", "ips": [a], "python": python,
                       "rdma_ctl": False, "rdma_devices": []}
                      for n, a in zip(names, addresses, strict=True)]}


class NetnsCluster:
    """n rank hosts as network namespaces with sshd, plus the root namespace as the
    control host. See the module doc."""

    def __init__(self, n_hosts: int = DEFAULT_TOPOLOGY["rank_hosts"], *, prefix: str = "ls",
                 connect_timeout: float = 3.0) -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be within 1..{MAX_HOSTS}")
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r}: 1-4 of [a-z0-9], starting with a letter "
                             "(interface names are at most 15 characters)")
        missing = missing_requirements()
        if missing:
            raise NetnsError("cannot build network-namespace hosts: " + "; ".join(missing))
        self.n_hosts = n_hosts
        self.connect_timeout = connect_timeout
        self.user = getpass.getuser()
        self.token = secrets.token_hex(3)
        self.bridge = f"{prefix}{self.token}"
        self.namespaces = [f"{prefix}h{self.token}-{i}" for i in range(n_hosts)]
        self.veths = [f"{prefix}{self.token}v{i}" for i in range(n_hosts)]
        self.names = [host_name(i) for i in range(n_hosts)]
        self.timings: dict[str, float] = {}
        self._made = Made()
        # Runs at close() or at interpreter exit, whichever is first; holds no `self`.
        self._finalizer = weakref.finalize(self, teardown, self._made)
        t0 = time.monotonic()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.timings["setup_s"] = time.monotonic() - t0

    # --- building ---------------------------------------------------------------

    def _build(self) -> None:
        made = self._made
        made.run_dir = Path(tempfile.mkdtemp(prefix=f"lockstep-netns-{self.token}-"))
        self.run_dir = made.run_dir
        self.subnet = pick_subnet(random.Random(secrets.randbits(32)))
        # .1 is the bridge in the root namespace (the control host), .2+i host i.
        self.control_address, self.addresses = address_plan(str(self.subnet), self.n_hosts)
        plen = self.subnet.prefixlen

        self.client_key = self.run_dir / "client_ed25519"
        self._keygen(self.client_key, "lockstep-netns-client")
        self.authorized_keys = self.run_dir / "authorized_keys"
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())

        ip("link", "add", self.bridge, "type", "bridge")
        made.bridge = self.bridge
        ip("addr", "add", f"{self.control_address}/{plen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.veths, self.addresses,
                                                 strict=True)):
            ip("netns", "add", ns)
            made.namespaces.append(ns)
            # The inner end is created inside the namespace: "eth0" there, no clash here.
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            made.veths.append(veth)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{addr}/{plen}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            self._start_sshd(i)
        self._write_client_files()
        for i in range(self.n_hosts):
            self._wait_sshd(i)

    def _keygen(self, path: Path, comment: str) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                        "-f", str(path)], check=True, capture_output=True, timeout=30)

    def host_dir(self, i: int) -> Path:
        return self.run_dir / "hosts" / self.names[i]

    def _start_sshd(self, i: int) -> None:
        d = self.host_dir(i)
        d.mkdir(mode=0o700, parents=True)
        host_key = d / "ssh_host_ed25519_key"
        self._keygen(host_key, f"lockstep-netns-{self.names[i]}")
        config = d / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {self.addresses[i]}:{SSH_PORT}",
            f"HostKey {host_key}",
            f"PidFile {d / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            f"AllowUsers {self.user}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # sshd checks every directory above AuthorizedKeysFile; /tmp is world-writable
            # (1777), so StrictModes would refuse the key. The run dir itself is 0700.
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "PermitUserEnvironment no",
            "X11Forwarding no",
            "AllowAgentForwarding no",
            "AllowTcpForwarding no",
            "ClientAliveInterval 5",
            "ClientAliveCountMax 3",
            "LoginGraceTime 20",
            "MaxStartups 64:30:128",  # tests open many connections at once
            "LogLevel INFO",
            "",
        ]))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        check = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True,
                               timeout=30)
        if check.returncode != 0:
            raise NetnsError(f"sshd config for {self.names[i]} rejected: {check.stderr.strip()}")
        log = d / "sshd.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[i], SSHD, "-D", "-f", str(config),
                 "-E", str(log)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent)
        self._made.sshds.append(proc)

    def _wait_sshd(self, i: int) -> None:
        """Until sshd accepts TCP connections on the host's address, from the root
        namespace (which also proves the bridge path)."""
        deadline = time.monotonic() + SSHD_READY_S
        proc = self._made.sshds[i]
        while True:
            if proc.poll() is not None:
                raise NetnsError(f"sshd for {self.names[i]} exited with {proc.returncode}: "
                                 f"{self._log_tail(i)}")
            with contextlib.suppress(OSError), socket.create_connection(
                    (self.addresses[i], SSH_PORT), timeout=0.5):
                return
            if time.monotonic() >= deadline:
                raise NetnsError(f"sshd for {self.names[i]} not reachable at "
                                 f"{self.addresses[i]}:{SSH_PORT} after {SSHD_READY_S}s: "
                                 f"{self._log_tail(i)}")
            time.sleep(0.02)

    def _log_tail(self, i: int) -> str:
        try:
            return (self.host_dir(i) / "sshd.log").read_text(errors="replace")[-800:].strip()
        except OSError:
            return "(no sshd log)"

    def _write_client_files(self) -> None:
        self.known_hosts = self.run_dir / "known_hosts"
        lines = []
        for i, addr in enumerate(self.addresses):
            keytype, key = (self.host_dir(i) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            lines.append(f"{addr} {keytype} {key}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        self.ssh_config = self.run_dir / "ssh_config"
        blocks = [f"Host {name} {addr}\n  HostName {addr}\n"
                  for name, addr in zip(self.names, self.addresses, strict=True)]
        blocks.append("\n".join([
            "Host *",
            f"  User {self.user}",
            f"  IdentityFile {self.client_key}",
            "  IdentitiesOnly yes",
            "  IdentityAgent none",
            f"  UserKnownHostsFile {self.known_hosts}",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            # The default post-quantum kex (sntrup761) costs ~0.25 s of CPU per connection
            # here (0.6 s vs 0.4 s a round trip); these hosts live for one test run.
            "  KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org",
            "  UpdateHostKeys no",
            "  BatchMode yes",
            f"  ConnectTimeout {max(1, round(self.connect_timeout))}",
            "  ServerAliveInterval 5",
            "  ServerAliveCountMax 3",
            "  ControlMaster no",
            "  ForwardAgent no",
            "  LogLevel ERROR",
            "",
        ]))
        self.ssh_config.write_text("\n".join(blocks))

    # --- using ------------------------------------------------------------------

    def address(self, i: int) -> str:
        return self.addresses[i]

    def ssh_target(self, i: int) -> SshTarget:
        """`user@address` of host i, with this run's client config (keys, known hosts)."""
        return SshTarget(f"{self.user}@{self.addresses[i]}", config_file=str(self.ssh_config),
                         connect_timeout=self.connect_timeout)

    def ssh(self, i: int, argv: list[str], *, input: bytes | None = None,
            timeout: float = 30.0) -> subprocess.CompletedProcess[bytes]:
        """Run argv on host i over real ssh (common.ssh.run)."""
        return sshmod.run(self.ssh_target(i), argv, input=input, timeout=timeout)

    def agent(self, i: int, command: str, *args: str, input: bytes | None = None,
              timeout: float = 30.0) -> Any:
        """`python -m services.hostagent COMMAND ARGS` on host i over ssh; its JSON answer."""
        return sshmod.run_json(self.ssh_target(i), agent_argv(PYTHON, command, *args),
                               input=input, timeout=timeout)

    def netns_exec_argv(self, i: int, argv: list[str]) -> list[str]:
        """argv run inside host i's namespace directly (no ssh), e.g. for probes."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def link_down(self, i: int) -> None:
        """Pull host i's cable: its root-side veth goes down, nothing reaches it."""
        ip("link", "set", self.veths[i], "down")

    def link_up(self, i: int) -> None:
        """Plug it back in; returns once both ends report the link up."""
        ip("link", "set", self.veths[i], "up")
        deadline = time.monotonic() + 5.0
        while True:
            outer = json.loads(ip("-j", "link", "show", self.veths[i]).stdout)[0]
            inner = json.loads(ip("-n", self.namespaces[i], "-j", "link", "show",
                                   "eth0").stdout)[0]
            if outer.get("operstate") == "UP" and inner.get("operstate") == "UP":
                return
            if time.monotonic() >= deadline:
                raise NetnsError(f"link of {self.names[i]} not up after 5s")
            time.sleep(0.02)

    def hosts_document(self) -> dict[str, Any]:
        """This cluster as an mlx.launch hostfile (see `hosts_document`)."""
        return hosts_document(self.names, self.addresses, user=self.user)

    def sshd_pids(self) -> list[int]:
        return [p.pid for p in self._made.sshds]

    @property
    def closed(self) -> bool:
        return self._made.closed

    def close(self) -> TeardownReport:
        """Remove everything this run made (see the module doc). Idempotent: a second
        call returns an empty report."""
        report = self._finalizer() if self._finalizer.alive else TeardownReport()
        if report.seconds:
            self.timings["teardown_s"] = report.seconds
        return report

    def leftovers(self) -> list[str]:
        """What of this run still exists (empty after a clean close)."""
        return leftovers_of(self.bridge, self.veths, self.namespaces,
                            getattr(self, "run_dir", None))

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
