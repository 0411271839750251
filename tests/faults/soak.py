"""The fault soak driver (issue 8): a live cluster on loopback — `lockstep supervisor`,
`lockstep reaper` (service, 1 s interval) and `lockstep gateway` as separate processes,
a TP=2 deployment of real MLX ranks (ring backend) with short watchdog settings — under
concurrent streaming clients, hit by a seeded random schedule of faults. After every
fault the driver restores service if the fault took it down, then checks the invariants
(the schedule: every fault kind once, in a seeded order, then weighted random draws):

- no process of a stopped (or killed) deployment is alive (psutil; a zombie has exited);
- no manifest without a live supervisor (pid + start time);
- once quiescent, the gateway's active count equals every rank's reported active count;
- every client stream ended with content, `abort` or an OpenAI-shaped error, within a
  deadline — never a hang, never a broken transfer;
- and at the end, per fault kind, the outcomes of the requests that overlapped its
  windows (in the summary): none refused and none ended in error for a supervisor kill
  (adopted), a rank SIGKILL or a follower SIGSTOP (streams resume, new requests wait for
  the redeploy: the harness plays `lockstep up`'s part, its adoption record and its
  redeploy promise).

The seed is printed and settable with LOCKSTEP_SOAK_SEED; every failure names it. The
short soaks of `make test` use FIXED_SEED (the same schedule every run); only the full
soaks of `make soak` draw a new one (`run_soak(..., random_seed=True)`).
Partitions need hosts with links to pull: tests/netns/test_soak_netns.py runs this same
driver with the ranks on two network-namespace hosts and adds partition faults. The clients are in tests/faults/soak_clients.py,
the faults in tests/faults/soak_faults.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from common.atomic_json import read_json
from common.envelope import Key
from common.home import Paths, manifest_path, write_adoption_record, write_redeploy_record
from common.keys import generate_key_file, load_cluster_key
from common.procs import identify
from common.records import AdoptionRecord, LaunchManifest, RedeployRecord
from services.admin.cli import AdminClient
from tests.faults.soak_clients import READ_TIMEOUT_S, Clients, Waits
from tests.faults.soak_faults import ADOPT_WINDOW_S, FAULTS, GRACE_S, WEIGHTS, Faults
from tests.support.polling import poll_for
from tests.support.ports import free_port
from tests.support.processes import REPO, lockstep_env, process_gone
from tests.support.supervisor import runtime_names


class SoakFailure(AssertionError):
    pass


@dataclass
class Budget:
    faults: int
    seconds: float
    waits: Waits = field(default_factory=Waits.short)


@dataclass
class Stats:
    faults: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    redeploys: int = 0
    supervisor_restarts: int = 0
    adopted: int = 0
    # (fault kind, began, restored): each fault's window, monotonic
    windows: list[tuple[str, float, float]] = field(default_factory=list)
    # (began, ended, outcome) of every client request, monotonic
    requests: list[tuple[float, float, str]] = field(default_factory=list)

    def outcomes_during(self, kind: str) -> Counter:
        """Outcomes of the requests that overlapped a window of fault `kind`."""
        out: Counter = Counter()
        for b, e, outcome in self.requests:
            if any(k == kind and b <= t1 and e >= t0 for k, t0, t1 in self.windows):
                out[outcome] += 1
        return out
    invariant_checks: int = 0
    bad: list[str] = field(default_factory=list)


class Soak(Faults):
    def __init__(self, tmp: Path, model: Path, seed: int, budget: Budget) -> None:
        self.tmp, self.model, self.seed, self.budget = tmp, model, seed, budget
        self.rng = random.Random(seed)
        self.home = tmp / "home"
        self.paths = Paths(self.home)
        generate_key_file(self.paths.cluster_key)
        self.key: Key = load_cluster_key(self.paths.cluster_key)
        self.token = secrets.token_urlsafe(24)
        self.paths.admin_token.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.paths.admin_token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self.ports = {n: free_port() for n in ("admin", "events", "control", "report", "http")}
        self.url = f"http://127.0.0.1:{self.ports['http']}"
        self.admin_ep = f"tcp://127.0.0.1:{self.ports['admin']}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.all_procs: list[subprocess.Popen] = []
        self.jobs: dict[str, LaunchManifest] = {}  # every launch seen, by job id
        self.dead_jobs: set[str] = set()  # launches that must have no process left
        self.dep: dict | None = None  # the serving deployment's info
        self.n_deploys = 0
        self.stats = Stats()
        self.log: list[str] = []
        self.logs: dict[str, Path] = {}  # each service's latest log
        self.clients = Clients(self.url, seed, self.stats,
                               lambda: (self.dep or {}).get("model", "tiny"), budget.waits)
        self.zctx = zmq.Context()

    # --- what a topology changes (tests/netns/test_soak_netns.py) ------------------------

    faults: tuple[str, ...] = FAULTS
    weights: tuple[int, ...] = WEIGHTS
    # The harness plays `lockstep up`'s part in restarting the supervisor: an adoption
    # record, ranks that wait ADOPT_WINDOW_S for it. The netns soak keeps the old
    # behaviour (remote ranks: their adoption is not exercised there).
    adopts: bool = True

    def write_adoption_record(self, restarting_until: float | None) -> None:
        me = identify(os.getpid())
        self.paths.runtime.mkdir(parents=True, exist_ok=True)
        write_adoption_record(self.paths.adoption_file, AdoptionRecord(
            up_pid=me.pid, up_start_time=me.start_time, window_s=ADOPT_WINDOW_S,
            restarting_until=restarting_until, reason="the soak killed it"))

    def supervisor_env(self) -> dict[str, str]:
        return {}

    def deploy_args(self) -> dict:
        return {}

    def rank0_spec(self, job_id: str) -> Path:
        return self.paths.runtime / "jobs" / job_id / "rank-0.spec.json"

    # --- processes ---------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        path = self.tmp / f"{name}-{len(self.all_procs)}.log"
        self.logs[name] = path
        log = open(path, "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO,
                             env=lockstep_env(self.home, **env),
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        log.close()
        self.procs[name] = p
        self.all_procs.append(p)
        return p

    def start_supervisor(self) -> None:
        runtime = self.paths.runtime / "supervisor.json"
        runtime.unlink(missing_ok=True)
        p = self._spawn("supervisor", ["services.supervisor", "--home", str(self.home)],
                        LOCKSTEP_ADMIN_PORT=str(self.ports["admin"]),
                        LOCKSTEP_EVENTS_PORT=str(self.ports["events"]),
                        LOCKSTEP_CONTROL_PORT=str(self.ports["control"]),
                        LOCKSTEP_REPORT_PORT=str(self.ports["report"]),
                        LOCKSTEP_LOAD_TIMEOUT="150", LOCKSTEP_GRACEFUL_TIMEOUT="2",
                        LOCKSTEP_STOP_TIMEOUT="3", LOCKSTEP_KILL_TIMEOUT="3",
                        LOCKSTEP_CANARY_WINDOW_S="0.3", LOCKSTEP_CANARY_RUNS="2",
                        LOCKSTEP_LEASE_INTERVAL="0.5", LOCKSTEP_LEASE_TTL="10",
                        LOCKSTEP_PEER_ABORT_GRACE=str(GRACE_S),
                        LOCKSTEP_PROGRESS_STALL_TIMEOUT="15",
                        LOCKSTEP_SIGNAL_CLEAR_TIMEOUT="5",
                        LOCKSTEP_RANK_TELEMETRY_INTERVAL_S="0.3",
                        LOCKSTEP_ABORT_ALL_TIMEOUT="10", LOCKSTEP_RANK_TEST_SEAMS="true",
                        LOCKSTEP_ADOPT_WINDOW_S=str(ADOPT_WINDOW_S if self.adopts else 0),
                        **self.supervisor_env())
        self._poll("the supervisor's runtime file",
                   lambda: p.poll() is not None or runtime_names(runtime, p), 60)
        if p.poll() is not None:
            raise SoakFailure(self._why(f"supervisor exited {p.returncode}"))

    def start(self) -> None:
        if self.adopts:
            self.write_adoption_record(restarting_until=None)
        self.start_supervisor()
        self._spawn("reaper", ["services.reaper", "--home", str(self.home), "--interval", "1",
                               "--term-timeout", "2", "--kill-timeout", "2"])
        self._spawn("gateway", ["services.gateway", "--home", str(self.home), "--port",
                                str(self.ports["http"]), "--admin-endpoint", self.admin_ep,
                                "--events-endpoint", f"tcp://127.0.0.1:{self.ports['events']}",
                                "--request-read-timeout", str(READ_TIMEOUT_S)],
                    LOCKSTEP_ORPHAN_GRACE_S="2", LOCKSTEP_KEEPALIVE_S="2",
                    # within the clients' stream deadline: a stream whose deployment
                    # failed resumes on the next one the soak deploys, or ends rank_lost
                    **self.budget.waits.env())
        self._poll("the gateway", lambda: self._running("gateway") and self._http_ok("/health"),
                   60, log_of="gateway")
        self.deploy()
        self.clients.start()

    def admin(self, command: str, timeout: float = 60.0, **args):
        c = AdminClient(self.admin_ep, self.key, ctx=self.zctx)
        try:
            return c.call(command, timeout, **args)
        finally:
            c.close()

    def deploy(self) -> None:
        self.n_deploys += 1
        dep_id = f"soak-{self.n_deploys}"
        reply = self.admin("deploy", 400, model_path=str(self.model), tp=2,
                           deployment_id=dep_id, envs=["LOCKSTEP_TEST_STEP_DELAY_S=0.01"],
                           **self.deploy_args())
        if not reply.ok:
            raise SoakFailure(self._why(f"deploy failed: {reply.code} {reply.message}"))
        job = reply.data["job_id"]
        self.jobs[job] = LaunchManifest.from_dict(read_json(manifest_path(self.paths, job)))
        self.dep = self._dep_info(dep_id)
        self._poll("/ready", lambda: self._http_ok("/ready"), 60)
        if self.adopts:  # as `up` promises once serving: a failure is redeployed
            me = identify(os.getpid())
            write_redeploy_record(self.paths.redeploy_file, RedeployRecord(
                up_pid=me.pid, up_start_time=me.start_time, model=self.dep["model"]))

    def _dep_info(self, dep_id: str) -> dict | None:
        reply = self.admin("deployments", 20)
        if not reply.ok:
            return None
        return next((d for d in reply.data["deployments"] if d["deployment_id"] == dep_id), None)

    def _running(self, name: str) -> bool:
        """True while service `name` runs; once it has exited, a SoakFailure with its
        exit code and its log's last lines (waiting on cannot help)."""
        rc = self.procs[name].poll()
        if rc is None:
            return True
        raise SoakFailure(self._why(f"{name} exited {rc}:\n{self._tail(name)}"))

    def _tail(self, name: str, lines: int = 30) -> str:
        try:
            text = self.logs[name].read_text(errors="replace")
        except (KeyError, OSError) as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def _http_ok(self, path: str) -> bool:
        try:
            return httpx.get(self.url + path, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    # --- restore and invariants --------------------------------------------------------

    def restore(self) -> None:
        """Service back: a live supervisor and one serving deployment."""
        if self.procs["supervisor"].poll() is not None:
            raise SoakFailure(self._why("the supervisor died without being killed"))
        if self.dep is not None:
            info = self._dep_info(self.dep["deployment_id"])
            if info is not None and info["state"] == "serving":
                self.dep = info
                return
            self.dead_jobs.add(self.dep["job_id"])
            if info is not None:
                self._stop(info["deployment_id"])
            self.dep = None
        # old deployments (e.g. from before a supervisor kill) must be gone: reaped
        for d in self.admin("deployments", 20).data["deployments"]:
            self.dead_jobs.add(d["job_id"])
            self._stop(d["deployment_id"])
        self.stats.redeploys += 1
        self.deploy()

    def _stop(self, dep_id: str) -> None:
        def attempt():
            reply = self.admin("stop", 120, deployment_id=dep_id, force=True)
            if reply.ok or reply.code == "not_found":
                return True
            if reply.code in ("conflict", "teardown_failed"):
                return False  # busy with its own teardown, or retry the proof
            raise SoakFailure(self._why(f"stop {dep_id}: {reply.code} {reply.message}"))
        self._poll(f"a verified stop of {dep_id}", attempt, 60, interval=0.5)

    def check_invariants(self) -> None:
        self.stats.invariant_checks += 1
        # 1. no process of a stopped deployment alive
        def dead_ranks_gone():
            return not [(j, r.rank, r.pid) for j in self.dead_jobs if j in self.jobs
                        for r in self.jobs[j].ranks if not process_gone(r.pid, r.start_time)]
        self._poll("every rank of a stopped deployment to be gone", dead_ranks_gone, 30)
        # 2. no manifest without a live supervisor
        def manifests_owned():
            for f in self.paths.manifests.glob("*.json"):
                try:
                    m = read_json(f)
                except (OSError, ValueError):
                    continue  # being rewritten; an unreadable one shows up in the reaper
                if process_gone(m["supervisor_pid"], m["supervisor_start_time"]):
                    return False
            return True
        self._poll("every manifest to have a live supervisor", manifests_owned, 30)
        # 3. client streams: none hangs; then quiescent counts agree
        self.clients.paused.set()
        try:
            self._poll("every client stream to end", lambda: not self.clients.in_flight,
                       self.budget.waits.deadline_s + 15)
            self._poll("gateway active == ranks' active", self._counts_agree, 30, interval=0.2)
        finally:
            self.clients.paused.clear()
        # 4. every stream so far ended with content, abort or a clear error
        if self.stats.bad:
            raise SoakFailure(self._why(f"bad client outcomes: {self.stats.bad[:5]}"))

    def _counts_agree(self) -> bool:
        r = httpx.get(self.url + "/admin/api/cluster/status", timeout=10,
                      headers={"authorization": f"Bearer {self.token}"})
        if r.status_code != 200:
            return False
        st = r.json()
        gw = st["gateway"]["active"]
        dep = next((d for d in st["deployments"]
                    if self.dep and d["deployment_id"] == self.dep["deployment_id"]), None)
        if dep is None:
            return gw == 0
        ranks = [x["active"] for x in dep["ranks"]]
        self._last_counts = (gw, ranks)
        return all(a == gw for a in ranks)

    # --- run ---------------------------------------------------------------------------

    def run(self) -> Stats:
        t0 = time.monotonic()
        self.start()
        self.check_invariants()
        n = 0
        # every kind once first, in a seeded order (a short soak covers them all), then
        # weighted draws
        first = self.rng.sample(self.faults, len(self.faults))
        while n < self.budget.faults and time.monotonic() - t0 < self.budget.seconds:
            kind = first[n] if n < len(first) else self.rng.choices(self.faults, self.weights)[0]
            time.sleep(self.rng.uniform(0.2, 1.5))  # let the clients get streams going
            began = time.monotonic()
            self.fault(kind)
            n += 1
            self.restore()
            self.stats.windows.append((kind, began, time.monotonic()))
            self.check_invariants()
        # A supervisor restart is invisible to clients: its deployment is adopted, so no
        # request overlapping one is refused or ends in error (issue 44).
        # Nor is a rank's death: requests in flight resume, new ones wait for the redeploy
        # (issue 43): none refused, none ended in error.
        for kind in ("kill_supervisor", "sigkill_rank", "sigstop_long", "sigstop_short"):
            during = self.stats.outcomes_during(kind)
            failed = {o: n for o, n in during.items() if o not in ("content", "disconnect")}
            if self.adopts and failed:
                raise SoakFailure(self._why(f"requests overlapping {kind}: {failed}"))
        self.paths.redeploy_file.unlink(missing_ok=True)  # the end: nothing comes back
        # the end: a verified stop of the last deployment, then the invariants again
        if self.dep:
            self.dead_jobs.add(self.dep["job_id"])
            self._stop(self.dep["deployment_id"])
            self.dep = None
        self.clients.stop.set()
        for t in self.clients.workers:
            t.join(self.budget.waits.deadline_s + 10)
            if t.is_alive():
                raise SoakFailure(self._why(f"{t.name} still in a request"))
        self.check_invariants()
        left = list(self.paths.manifests.glob("*.json"))
        if left:
            raise SoakFailure(self._why(f"manifests left after the final stop: {left}"))
        self.elapsed = time.monotonic() - t0
        return self.stats

    def close(self) -> None:
        self.clients.stop.set()
        self.clients.paused.clear()
        sup = self.procs.get("supervisor")
        if sup is not None and sup.poll() is None and self.dep:
            with contextlib.suppress(Exception):
                self.admin("stop", 60, deployment_id=self.dep["deployment_id"], force=True)
        for p in self.all_procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.all_procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for m in self.jobs.values():
            for r in m.ranks:
                if not process_gone(r.pid, r.start_time):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.pid, signal.SIGKILL)
        for t in self.clients.workers:
            t.join(self.budget.waits.deadline_s + 10)
        self.zctx.term()

    # --- helpers -----------------------------------------------------------------------

    def _why(self, what: str) -> str:
        return (f"{what} [LOCKSTEP_SOAK_SEED={self.seed}; faults {dict(self.stats.faults)}; "
                f"last events {self.log[-6:]}; logs in {self.tmp}]")

    def _poll(self, what: str, fn, timeout: float, interval: float = 0.1,
              log_of: str | None = None):
        def failure(message: str) -> SoakFailure:
            extra = f" (counts {getattr(self, '_last_counts', None)})" if "active" in what else ""
            if log_of is not None:  # the log is on the machine that ran it: quote it
                extra += f"\n{log_of}'s log ends:\n{self._tail(log_of)}"
            return SoakFailure(self._why(message + extra))
        return poll_for(fn, timeout, what, interval, error=failure)


def run_soak(make: Callable[[int], Soak], label: str = "soak", *,
             random_seed: bool = False) -> Soak:
    """Build a soak with the seed (printed first: a failure names it), run it, always
    close it and print its summary; it must have streamed some content. The seed is
    LOCKSTEP_SOAK_SEED if set, else a new random one with `random_seed`, else FIXED_SEED."""
    seed = seed_from_env(random_seed)
    print(f"\nLOCKSTEP_SOAK_SEED={seed}")
    soak = make(seed)
    try:
        soak.run()
    finally:
        soak.close()
        print(f"{label}:", summary(soak))
    assert soak.stats.outcomes["content"] > 0, summary(soak)
    return soak


FIXED_SEED = 1201  # `make test`: every run replays the same fault schedule


def seed_from_env(random_seed: bool = False) -> int:
    raw = os.environ.get("LOCKSTEP_SOAK_SEED")
    if raw:
        return int(raw)
    return secrets.randbelow(2**31) if random_seed else FIXED_SEED


def summary(s: Soak) -> str:
    return json.dumps({"seed": s.seed, "elapsed_s": round(getattr(s, "elapsed", 0.0), 1),
                       "faults": dict(s.stats.faults), "outcomes": dict(s.stats.outcomes),
                       "errors": dict(s.stats.errors),
                       "redeploys": s.stats.redeploys,
                       "supervisor_restarts": s.stats.supervisor_restarts,
                       "adopted": s.stats.adopted,
                       "outcomes_by_fault": {k: dict(s.stats.outcomes_during(k))
                                             for k in sorted(set(s.stats.faults))},
                       "invariant_checks": s.stats.invariant_checks})
