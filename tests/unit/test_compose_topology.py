"""docker-compose.test.yml (no Docker engine runs here) against the code: every
`lockstep` subcommand it names exists, and it describes the same topology as the netns
harness (tests/netns/hosts.py): one control host running supervisor, reaper and
gateway, DEFAULT_TOPOLOGY["rank_hosts"] rank hosts with sshd, the same names and the
same address plan, and a hosts file the supervisor accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.__main__ import COMMANDS
from services.supervisor.hosts import read_hosts_file
from tests.netns.hosts import DEFAULT_TOPOLOGY, address_plan, host_name, hosts_document

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.test.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# `lockstep SUB` at the start of a command or after a shell separator.
LOCKSTEP_RE = re.compile(r"(?:^|[\s;&|(`'\"])lockstep\s+([A-Za-z][\w-]*)")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def argv_of(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def lockstep_subcommands(text: str) -> list[str]:
    return LOCKSTEP_RE.findall(text)


def role(svc: dict[str, Any]) -> str:
    return svc.get("labels", {}).get("lockstep.role", "")


def hosts_of(compose: dict[str, Any]) -> dict[str, list[str]]:
    """Host (the service owning a network namespace) → every service running on it."""
    services = compose["services"]
    hosts: dict[str, list[str]] = {}
    for name, svc in services.items():
        mode = svc.get("network_mode", "")
        if mode.startswith("service:"):
            owner = mode.split(":", 1)[1]
            assert owner in services, f"{name}: network_mode names unknown service {owner}"
            assert svc.get("pid") == mode, f"{name}: shares the network but not the pids of {owner}"
            hosts.setdefault(owner, []).append(name)
        elif role(svc) != "setup":
            hosts.setdefault(name, []).insert(0, name)
    return hosts


def docker_workdir() -> str:
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), re.M)
    assert workdirs, "the Dockerfile sets no WORKDIR"
    return workdirs[-1]


def in_repo(container_path: str) -> Path:
    """A path inside the image's copy of the repository → the file here."""
    rel = Path(container_path).relative_to(docker_workdir())
    return ROOT / rel


def test_every_lockstep_subcommand_in_the_compose_file_exists(compose):
    seen = []
    for name, svc in compose["services"].items():
        for key in ("entrypoint", "command"):
            argv = argv_of(svc.get(key))
            if argv and Path(argv[0]).name == "lockstep":
                assert len(argv) > 1 and argv[1] in COMMANDS, f"{name}.{key}: {argv}"
            found = lockstep_subcommands(" ".join(argv))
            assert set(found) <= set(COMMANDS), f"{name}.{key}: unknown {found}"
            seen += found
        for test in argv_of(svc.get("healthcheck", {}).get("test")):
            assert set(lockstep_subcommands(test)) <= set(COMMANDS), name
    assert {"supervisor", "reaper", "gateway"} <= set(seen)


def test_every_lockstep_subcommand_in_the_docker_scripts_exists():
    for script in sorted((ROOT / "docker").glob("*.sh")):
        for n, line in enumerate(script.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for sub in lockstep_subcommands(code):
                assert sub in COMMANDS, f"{script.name}:{n}: lockstep {sub}"


def test_control_host_runs_supervisor_reaper_and_gateway(compose):
    services = compose["services"]
    hosts = hosts_of(compose)
    control = [h for h in hosts if role(services[h]) == "control"]
    assert len(control) == DEFAULT_TOPOLOGY["control"]
    members = hosts[control[0]]
    assert all(role(services[m]) == "control" for m in members)
    subs = sorted(s for m in members for s in lockstep_subcommands(
        " ".join(argv_of(services[m].get("command")))))
    assert subs == ["gateway", "reaper", "supervisor"]


def test_rank_hosts_match_the_netns_harness(compose):
    services = compose["services"]
    hosts = hosts_of(compose)
    ranks = [h for h in hosts if role(services[h]) == "rank-host"]
    n = DEFAULT_TOPOLOGY["rank_hosts"]
    assert len(ranks) == n
    assert ranks == [host_name(i) for i in range(n)]
    for r in ranks:
        svc = services[r]
        assert hosts[r] == [r], f"{r} must be a host of its own"
        assert svc.get("hostname") == r
        assert argv_of(svc["command"])[0] == "/usr/sbin/sshd"
        assert svc["environment"]["LOCKSTEP_HOST_NAME"] == r
    # Exactly the hosts: control, the rank hosts and the test runner; nothing else.
    assert sorted(role(services[h]) for h in hosts) == sorted(
        ["control"] * DEFAULT_TOPOLOGY["control"] + ["rank-host"] * n + ["tests"])


def test_addresses_follow_the_harness_address_plan(compose):
    services = compose["services"]
    (subnet_cfg,) = compose["networks"]["cluster"]["ipam"]["config"]
    n = DEFAULT_TOPOLOGY["rank_hosts"]
    control_ip, rank_ips = address_plan(subnet_cfg["subnet"], n)
    assert subnet_cfg["gateway"] not in (control_ip, *rank_ips)

    def ip(svc: str) -> str:
        return services[svc]["networks"]["cluster"]["ipv4_address"]

    assert ip("control") == control_ip
    assert [ip(host_name(i)) for i in range(n)] == rank_ips
    assert services["control"]["environment"]["LOCKSTEP_RANK_HOST"] == control_ip
    # The keys service makes host keys for exactly these names and addresses.
    keys = services["keys"]
    assert argv_of(keys["command"])[1:] == [f"{host_name(i)}={a}" for i, a in enumerate(rank_ips)]


def test_hosts_file_is_accepted_and_describes_the_rank_hosts(compose):
    services = compose["services"]
    hosts_file = in_repo(services["control"]["environment"]["LOCKSTEP_HOSTS"])
    doc = read_hosts_file(hosts_file)  # the supervisor's own parser
    n = DEFAULT_TOPOLOGY["rank_hosts"]
    names = [host_name(i) for i in range(n)]
    _, ips = address_plan(compose["networks"]["cluster"]["ipam"]["config"][0]["subnet"], n)
    expected = hosts_document(names, ips, python=f"{docker_workdir()}/.venv/bin/python")
    assert doc.backend == expected["backend"]
    got = [(h["name"], h["ips"], h["python"], h["rdma_ctl"]) for h in doc.hosts]
    want = [(h["name"], h["ips"], h["python"], h["rdma_ctl"]) for h in expected["hosts"]]
    assert got == want
    # Over ssh by name (the compose DNS name, which known_hosts lists too), as root.
    assert [h["ssh"] for h in doc.hosts] == [f"root@{name}" for name in names]


def test_the_image_has_the_entrypoint_and_tools_the_compose_file_uses(compose):
    text = DOCKERFILE.read_text()
    for pkg in ("openssh-server", "openssh-client", "iproute2"):
        assert pkg in text
    entry = re.search(r'^ENTRYPOINT\s+\["([^"]+)"', text, re.M)
    assert entry and in_repo(entry.group(1)).is_file()
    keys_entry = argv_of(compose["services"]["keys"]["entrypoint"])[0]
    assert in_repo(keys_entry).is_file()
