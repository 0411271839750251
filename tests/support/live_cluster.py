"""One live `lockstep up` shared by the e2e modules that only read it (issue 27): real
supervisor, reaper and gateway processes serving the random-weight "tiny" model at TP=2
(`up`'s own deployment) and, deployed beside it through the admin API, a copy named
"tiny-pp" at PP=2. test_gateway_live, test_console_browser_live, test_messages_live,
test_responses_live, test_structured_live, test_sampling_live, test_cache_index_live,
test_determinism_live and faults/test_rogue_secret_grep use it through the `live_cluster`
fixture (tests/conftest.py), which runs them one after another; most read it through
`live`, its typed view (`LiveView`: url, admin headers, clients, the deployment a test is
about). `up` is started by tests/support/up_cluster.py, the boot helper every live test
uses; tests that kill ranks, unload a deployment, stop `up` or need other settings keep a
cluster of their own.

Each test starts and ends on a clean cluster: the same two deployments serving, nothing
in flight at the gateway or on either rank 0 (`check_idle`). After the last test that uses
it the cluster is stopped with proof (`stop`): Ctrl-C, `up` exits 0 and says so, every
process it started is gone, nothing listens on any port they listened on, every launch
secret file is removed and no file under its home holds a launch secret."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import httpx
import psutil
import zmq
from anthropic import Anthropic
from openai import OpenAI

from common.atomic_json import read_json
from common.bus import Channel, new_request_id
from common.home import Paths
from common.keys import load_cluster_key, read_secret_file, requests_key_of
from common.messages import REQUESTS_OUT, Stats, StatsRequest
from common.procs import ProcessIdentity, snapshot_children
from common.rpc_client import SyncRpcClient
from services.rank.removals import read_removals, removals_path
from tests.gwutil import GaveUp, poll_until
from tests.support.processes import kill_group, process_gone
from tests.support.requests import supervisor_record
from tests.support.up_cluster import UpOptions, up_cluster

TP_MODEL, PP_MODEL = "tiny", "tiny-pp"
READY_S = 240.0
IDLE_S = 30.0  # for a test's streams to drain after it (rank 0 answers aborts within a step)
STOP_S = 120.0
UP_OPTIONS = UpOptions(tp=2, ready="started", stop="test")  # `up`'s own deployment: TP=2
CLIENT_TIMEOUT_S = 120.0  # the `openai` and `anthropic` clients of LiveView


@dataclass
class LiveCluster:
    home: Path
    port: int
    proc: subprocess.Popen
    url: str
    out: Path
    ready_body: dict = field(default_factory=dict)  # /ready, the first time it said 200
    burst: list[tuple[int, str]] = field(default_factory=list)  # the first requests ever
    token: str = ""
    link: str = ""  # the console login link `up` printed
    deps: dict[str, dict] = field(default_factory=dict)  # model -> DeploymentInfo at boot
    stopped: bool = False
    _stop_error: BaseException | None = None
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # up_cluster's

    @property
    def hdr(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    # --- boot ---------------------------------------------------------------------

    @classmethod
    def start(cls, home: Path) -> LiveCluster:
        # Started by the one boot helper, but waited for and stopped here: the first
        # requests ever go right after /ready, and the stop proves more (ports, secrets).
        stack = contextlib.ExitStack()
        up = stack.enter_context(up_cluster(home, UP_OPTIONS, home=home))
        c = cls(home, up.port, up.proc, up.url, up.out, _exit=stack)
        try:
            c._boot()
        except BaseException:
            kill_group(up.proc)
            stack.close()
            raise
        return c

    def _boot(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise GaveUp(f"lockstep up exited: {self.text()[-3000:]}")
            return httpx.get(self.url + "/ready", timeout=5).status_code == 200

        poll_until(ready, READY_S, "lockstep up to be ready", interval=0.05)
        self.ready_body = httpx.get(self.url + "/ready", timeout=5).json()
        self.burst = first_burst(self.url)  # the first requests ever, right after /ready
        poll_until(lambda: "Press Ctrl-C" in self.text(), 10, "the banner")
        self.token = (self.home / "admin.token").read_text().strip()
        # the login link `lockstep up` prints (to the terminal only, not to up.log)
        self.link = poll_until(lambda: next((ln.split(": ", 1)[1] for ln in
                                             self.text().splitlines()
                                             if "cluster console: " in ln), None), 10,
                               "the console's login link")
        # The same weights under another name, deployed at PP=2 beside the TP=2 one.
        pp_model = self.home / "pp-model" / PP_MODEL
        shutil.copytree(Paths(self.home).models / TP_MODEL, pp_model)
        r = httpx.post(self.url + "/admin/api/cluster/deployments", headers=self.hdr,
                       timeout=300, json={"model_path": str(pp_model), "tp": 1, "pp": 2,
                                          "wait": True})
        assert r.status_code == 200, r.text
        self.deps = poll_until(lambda: (lambda s: s if set(s) == {TP_MODEL, PP_MODEL} else None)(
            self.serving()), READY_S, "both deployments to serve", interval=0.2)

    # --- what the tests read -------------------------------------------------------

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def deployments(self) -> list[dict]:
        return httpx.get(self.url + "/admin/api/cluster/deployments", headers=self.hdr,
                         timeout=10).json()["deployments"]

    def serving(self) -> dict[str, dict]:
        """model -> its serving deployment, as the gateway's admin API shows it now."""
        return {d["model"]: d for d in self.deployments() if d["state"] == "serving"}

    def gateway_active(self) -> int:
        st = httpx.get(self.url + "/admin/api/cluster/status", headers=self.hdr, timeout=10)
        return st.json()["gateway"]["active"]

    def rank0_stats(self, model: str = TP_MODEL) -> Stats:
        return rank0_stats(self.home, self.deps[model])

    def removals(self, model: str, rid: str) -> dict[int, dict]:
        return removals(self.home, self.deps[model], rid)

    # --- between tests -------------------------------------------------------------

    def check_idle(self, when: str, timeout: float) -> None:
        """The two deployments of the boot still serving, nothing in flight at the
        gateway nor on either rank 0 (within `timeout`: a test's aborted streams drain)."""
        assert not self.stopped, f"{when}: the shared cluster was stopped"
        assert self.proc.poll() is None, f"{when}: lockstep up exited: {self.text()[-3000:]}"
        ids = {m: d["deployment_id"] for m, d in self.serving().items()}
        assert ids == {m: d["deployment_id"] for m, d in self.deps.items()}, (when, ids)

        def idle() -> bool:
            return self.gateway_active() == 0 and all(
                self.rank0_stats(m).active == 0 for m in self.deps)

        poll_until(idle, timeout, f"{when}: nothing in flight on the shared cluster",
                   interval=0.1)

    # --- the end -------------------------------------------------------------------

    def stop(self) -> None:
        """Ctrl-C, then the proof: see the module's docstring. Raises (once) what is
        missing; a second call only repeats that verdict."""
        if self.stopped:
            if self._stop_error is not None:
                raise AssertionError(f"the shared cluster's stop failed: {self._stop_error}")
            return
        self.stopped = True
        try:
            self._stop_with_proof()
        except BaseException as exc:
            self._stop_error = exc
            raise
        finally:
            if self.proc.poll() is None:
                kill_group(self.proc)
            self._exit.close()

    def _stop_with_proof(self) -> None:
        tree = snapshot_children(self.proc.pid)
        ranks = [ProcessIdentity(rk["pid"], rk["start_time"], ()) for m in
                 (read_json(p) for p in Paths(self.home).manifests.glob("*.json"))
                 for rk in m["ranks"]]
        secrets = {Path(read_json(p)["secret_path"]) for p in
                   Paths(self.home).manifests.glob("*.json")}
        needles = [read_secret_file(p).hex().encode() for p in secrets]
        ports = {self.port} | {c.laddr.port for i in tree for c in _listening(i.pid)}
        assert len(tree) >= 4 + 2 * len(self.deps), tree  # up, supervisor, reaper, gateway, ranks
        assert len(secrets) == len(self.deps), secrets
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(STOP_S) == 0, self.text()[-3000:]
        poll_until(lambda: all(process_gone(i.pid, i.start_time) for i in [*tree, *ranks]), 10,
                   "every process of lockstep up and every rank to be gone")
        assert "every process stopped" in self.text()
        poll_until(lambda: not (ports & {c.laddr.port for c in
                                         psutil.net_connections("tcp")
                                         if c.status == psutil.CONN_LISTEN}),
                   10, f"nothing listening on {sorted(ports)}")
        assert not [p for p in secrets if p.exists()], "launch secret files left"
        left = [str(f) for f in self.home.rglob("*") if f.is_file()
                and any(n in f.read_bytes() for n in needles)]
        assert left == [], f"files holding a launch secret after the stop: {left}"


@dataclass(frozen=True)
class LiveView:
    """The shared cluster as a test on it reads it (the `live` fixture, tests/conftest.py),
    about one of its two deployments: `model`, TP_MODEL unless the test asks for PP_MODEL.
    Built by `live_view`; what else the cluster holds (its process, `up`'s output, the
    boot's /ready and first requests) is on `cluster`."""

    cluster: LiveCluster
    model: str  # the deployment the test is about
    url: str  # the gateway's
    home: Path
    token: str  # the admin token
    hdr: dict[str, str]  # admin headers (the bearer token)
    link: str  # the console login link `up` printed
    deps: dict[str, dict]  # model -> DeploymentInfo at boot, both deployments
    dep_ids: dict[str, str]  # model -> its deployment id
    dep: dict  # deps[model]

    @property
    def dep_id(self) -> str:
        return self.dep["deployment_id"]

    @cached_property
    def openai(self) -> OpenAI:
        """The `openai` client on the gateway's /v1 (no retries, CLIENT_TIMEOUT_S)."""
        return openai_client(self.url, CLIENT_TIMEOUT_S)

    @cached_property
    def anthropic(self) -> Anthropic:
        """The `anthropic` client on the gateway (no retries, CLIENT_TIMEOUT_S)."""
        return Anthropic(base_url=self.url, api_key="none", max_retries=0,
                         timeout=CLIENT_TIMEOUT_S)

    def rank0_stats(self) -> Stats:
        """STATS straight from rank 0 of `model`'s deployment."""
        return self.cluster.rank0_stats(self.model)

    def removals(self, rid: str) -> dict[int, dict]:
        """rank -> its removal record of `rid`, on `model`'s deployment."""
        return self.cluster.removals(self.model, rid)

    def gateway_active(self) -> int:
        return self.cluster.gateway_active()


def live_view(cluster: LiveCluster, model: str = TP_MODEL) -> LiveView:
    """The typed view of the shared cluster about `model`'s deployment."""
    return LiveView(cluster=cluster, model=model, url=cluster.url, home=cluster.home,
                    token=cluster.token, hdr=cluster.hdr, link=cluster.link,
                    deps=cluster.deps,
                    dep_ids={m: d["deployment_id"] for m, d in cluster.deps.items()},
                    dep=cluster.deps[model])


def openai_client(url: str, timeout: float) -> OpenAI:
    """An `openai` client on the gateway at `url` (its /v1), without retries."""
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def _listening(pid: int) -> list:
    try:
        return [c for c in psutil.Process(pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def first_burst(url: str, n: int = 8) -> list[tuple[int, str]]:
    """n concurrent first requests (chat and completions mixed): (status, body) each."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    go = threading.Barrier(n)
    out: list[tuple[int, str]] = []

    def one(i: int) -> None:
        body = ({"messages": [{"role": "user", "content": f"hi {i}"}]} if i % 2
                else {"prompt": f"hello {i}"})
        go.wait(10)
        r = httpx.post(url + ("/v1/chat/completions" if i % 2 else "/v1/completions"), timeout=120,
                       json={"model": model, "max_tokens": 4, **body})
        out.append((r.status_code, r.text))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return out


def rank0_stats(home: Path, dep: dict) -> Stats:
    """STATS straight from rank 0 of `dep` (a deployment as the gateway's admin API shows
    it), signed with its requests key as a gateway would."""
    dep = supervisor_record(dep)  # without the gateway's own fields
    ch = Channel("test", "requests", sender="test", accept=REQUESTS_OUT,
                 send_key=requests_key_of(dep, load_cluster_key(home / "keys" / "cluster.key")))
    c = SyncRpcClient(zmq.Context.instance(), dep["requests_endpoint"], ch)
    try:
        return c.call(StatsRequest(request_id=new_request_id()), 5.0).body
    finally:
        c.close()


def removals(home: Path, dep: dict, rid: str) -> dict[int, dict]:
    """rank -> its removal record of `rid`, for the ranks of `dep` that wrote one."""
    d = Paths(home).markers / dep["deployment_id"]
    out = {}
    for r in range(dep["world_size"]):
        p = d / f"rank-{r}.removals.jsonl"
        if p.exists():
            for line in p.read_text().splitlines():
                rec = json.loads(line)
                if rec["request_id"] == rid:
                    out[r] = rec
    return out


def ranks_agree(home: Path, dep_id: str, rid: str, world: int = 2) -> list[dict]:
    """Every rank's removal records of `rid` (polled: a rank writes one when it removes
    the request), equal in every field the ranks share; rank by rank, the first."""
    paths = Paths(home)

    def records():
        got = [[r for r in read_removals(removals_path(paths, dep_id, k)) if r["request_id"] == rid]
               for k in range(world)]
        return got if all(got) else None

    recs = poll_until(records, 30, f"every rank's removal record of {rid}")
    keys = ("uid", "step", "reason", "n_tokens", "tokens_sha")
    shared = [[{k: r[k] for k in keys} for r in per_rank] for per_rank in recs]
    assert all(s == shared[0] for s in shared), recs
    return [per_rank[0] for per_rank in recs]
