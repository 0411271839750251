"""Suite-wide settings. Hypothesis runs derandomized and without its example database, so
`make test` draws the same examples on every machine and every run (a failure prints
its reproduction blob). HYPOTHESIS_PROFILE=explore draws new examples each run. The live
cluster the read-only e2e modules share: `live_cluster` (tests/support/live_cluster.py), and
`live`, its typed view (LiveView)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from common import ports
from tests.support.ports import TEST_RANGE_ENV

settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


# --- the shared live cluster (tests/support/live_cluster.py) ------------------------------

SHARED = "live_cluster"
BOOT_BUDGET_S = 600  # added to the first user's timeout: up's boot and the PP deploy (240 s each)
STOP_BUDGET_S = 240  # added to the last user's: the stop with proof


def _module_of(item: pytest.Item | str) -> str:
    """The test module's path of an item or a node id."""
    return (item if isinstance(item, str) else item.nodeid).split("::")[0]


# --- two workers (pytest-xdist, `make test`) ------------------------------------------------
# `--dist loadgroup` hands a worker one group at a time, whole (`ByGroup` below). A module
# is a group: its module-scoped cluster, and the tests that read what earlier ones did,
# stay together. The modules on the shared cluster are one group (one cluster, booted
# once). The netns tests are one group too, and first: they share the host's bridge and
# the session's namespaces, and they are the longest and mostly wait on real timers, so
# they overlap well with the CPU-bound rest. The scheduler sees only node ids, hence the
# list; collection checks it against the fixture.
NETNS_DIR = "tests/netns/"
SHARED_CLUSTER_MODULES = frozenset({
    "tests/e2e/test_cache_index_live.py", "tests/e2e/test_console_browser_live.py",
    "tests/e2e/test_determinism_live.py",
    "tests/e2e/test_gateway_live.py", "tests/e2e/test_messages_live.py",
    "tests/e2e/test_responses_live.py", "tests/e2e/test_sampling_live.py",
    "tests/e2e/test_structured_live.py", "tests/faults/test_rogue_secret_grep.py",
})


def group_of(nodeid: str) -> str:
    mod = _module_of(nodeid)
    if mod.startswith(NETNS_DIR):
        return "netns"
    return "shared-cluster" if mod in SHARED_CLUSTER_MODULES else mod


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """Groups in collection order (with --no-loadscope-reorder): netns first."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """Each worker draws ports from its own slice of the range (common/ports.py): between
    a draw and the bind, the other worker could draw the same one. The slice is halved
    again: the test's own draws (tests/support/ports.py) take the lower half, and its
    subprocesses (up, supervisor, host agents) inherit the upper as LOCKSTEP_PORT_RANGE,
    so a supervisor never hands a rank the port a test drew for a gateway not yet bound."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        if getattr(config.option, "numprocesses", None):
            return  # xdist's controller: its workers inherit its environment, so not here
        worker = "gw0"  # one process (-n0): the whole range is its own
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = ports.listen_range(ports.ephemeral_range())
    if ports.RANGE_ENV in os.environ or span is None:
        return
    width = (span[1] - span[0] + 1) // count
    low = span[0] + int(worker[2:]) * width
    half = width // 2
    os.environ[TEST_RANGE_ENV] = f"{low}-{low + half - 1}"
    os.environ[ports.RANGE_ENV] = f"{low + half}-{low + width - 1}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The netns tests first; the modules that use the shared cluster one after another
    (where the first of them stood), so it is alive only while they run (its first and
    last users' timeouts include its boot and its stop)."""
    shared = {_module_of(it) for it in items if SHARED in getattr(it, "fixturenames", ())}
    if not shared <= SHARED_CLUSTER_MODULES:
        raise pytest.UsageError("tests/conftest.py: add to SHARED_CLUSTER_MODULES (the "
                                f"shared cluster's users): {sorted(shared - SHARED_CLUSTER_MODULES)}")
    items.sort(key=lambda it: not _module_of(it).startswith(NETNS_DIR))  # stable
    if shared:
        group = [it for it in items if _module_of(it) in shared]
        first = next(i for i, it in enumerate(items) if _module_of(it) in shared)
        rest = [it for it in items if _module_of(it) not in shared]
        items[:] = rest[:first] + group + rest[first:]


def _users(session: pytest.Session) -> list[pytest.Item]:
    return [it for it in session.items if SHARED in getattr(it, "fixturenames", ())]


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    users = _users(session)  # after deselection (-k, -m)
    if users:
        for it, extra in ((users[0], BOOT_BUDGET_S), (users[-1], STOP_BUDGET_S)):
            m = it.get_closest_marker("timeout")
            own = (m.args[0] if m.args else m.kwargs.get("timeout")) if m is not None else None
            own = own if own is not None else session.config.getini("timeout")
            it.add_marker(pytest.mark.timeout(float(own or 300) + extra), append=False)


@pytest.fixture(scope="session")
def _live_cluster_session(tmp_path_factory):
    from tests.support.live_cluster import LiveCluster

    cluster = LiveCluster.start(tmp_path_factory.mktemp("shared-up"))
    try:
        yield cluster
    finally:
        cluster.stop()  # a no-op when its last user stopped it


@pytest.fixture
def live_cluster(_live_cluster_session, request):
    """The shared cluster, idle before and after the test; stopped with proof after the
    last test that uses it."""
    c = _live_cluster_session
    c.check_idle(f"before {request.node.name}", 10)
    yield c
    try:
        c.check_idle(f"after {request.node.name}", 30)
    finally:
        if request.node is _users(request.session)[-1]:
            c.stop()


@pytest.fixture
def live(live_cluster):
    """The shared cluster as its tests read it: typed (LiveView), about its TP=2 deployment.
    A module about both deployments overrides it, parametrized (test_sampling_live); a
    module on a cluster of its own defines its own `live`."""
    from tests.support.live_cluster import live_view

    return live_view(live_cluster)
