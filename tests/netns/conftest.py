"""The session's network-namespace hosts (tests/netns/hosts.py).

Skipped, with the reason, only where they cannot exist: not root, or `ip`/`ssh`/`sshd`
missing (`make test` installs iproute2 and openssh-server/-client; CI runs as root).
Anything else that goes wrong while building them is an error, not a skip.
"""

from __future__ import annotations

import json

import pytest

from tests.netns.hosts import DEFAULT_TOPOLOGY, REPO_ROOT, NetnsCluster, missing_requirements


def skip_unless_possible() -> None:
    missing = missing_requirements()
    if missing:
        pytest.skip("network-namespace hosts unavailable: " + "; ".join(missing))


@pytest.fixture
def netns_required() -> None:
    """For tests that build their own NetnsCluster."""
    skip_unless_possible()


@pytest.fixture(scope="session")
def netns_cluster():
    """The default topology: the root namespace as control host + DEFAULT_TOPOLOGY
    rank hosts with sshd. Torn down at the end of the session, which must leave
    nothing behind (processes left in a namespace are an error: tests clean up)."""
    skip_unless_possible()
    cluster = NetnsCluster(DEFAULT_TOPOLOGY["rank_hosts"], prefix="ls")
    try:
        yield cluster
    finally:
        report = cluster.close()
        problems = report.errors + [f"left running by a test: {k}" for k in report.killed
                                    if "sshd" not in k]
        assert not problems, f"netns teardown: {problems}"


class RemoteProcs:
    """Processes a test starts on the netns hosts through `hostagent spawn`; `cleanup`
    stops them the way a supervisor would (identity-checked signals over ssh, then
    proof of exit over ssh) and returns whatever survived."""

    def __init__(self, cluster: NetnsCluster) -> None:
        self.cluster = cluster
        self.started: list[tuple[int, dict]] = []

    def spawn(self, host: int, argv: list[str], *, env: dict[str, str | None], log: str,
              cwd: str = str(REPO_ROOT)) -> dict:
        info = self.cluster.agent(host, "spawn", "--cwd", cwd, "--log", log,
                                  "--env-json-stdin", "--", *argv,
                                  input=json.dumps(env).encode())
        self.started.append((host, info))
        return info

    def cleanup(self) -> list[str]:
        survivors = []
        by_host: dict[int, list[dict]] = {}
        for host, info in self.started:
            by_host.setdefault(host, []).append(
                {k: info[k] for k in ("pid", "start_time", "cmdline")})
        for host, idents in by_host.items():
            # One ssh for the common case (all gone already), then the ladder.
            left = self._wait(host, idents, 0.0)
            for sig in ("TERM", "KILL"):
                if not left:
                    break
                for ident in left:
                    self.cluster.agent(host, "signal", str(ident["pid"]),
                                       repr(ident["start_time"]), sig,
                                       "--cmdline-json", json.dumps(ident["cmdline"]))
                left = self._wait(host, left, 5.0)
            survivors += [f"{self.cluster.names[host]}: pid {i['pid']}" for i in left]
        self.started.clear()
        return survivors

    def _wait(self, host: int, idents: list[dict], timeout: float) -> list[dict]:
        return self.cluster.agent(host, "wait-exit", "--identities-json", json.dumps(idents),
                                  "--timeout", str(timeout))["survivors"]


@pytest.fixture
def remote_procs(netns_cluster):
    procs = RemoteProcs(netns_cluster)
    yield procs
    survivors = procs.cleanup()
    assert not survivors, f"still running after SIGKILL: {survivors}"
