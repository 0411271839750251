"""`lockstep up --replicas N`: N deployments of one model behind the one gateway, each on
its own tp×pp rank slots (services/supervisor/replicas.py places them), served under one
model name and routed between by the gateway (services/gateway/core/router.py).

A replica that fails on its own is torn down with proof and redeployed here, while the
others serve: the gateway has already resumed its in-flight requests on them
(services/gateway/core/resume.py) and routes new ones around it; it rejoins once its canary
passed. The restarts budget (--restarts within --restart-window, with its backoff:
services/up/restart_budget.py) is shared by the replicas; past it a failed replica stays
down (said once) while the others serve. One replica that cannot be torn down
(teardown_failed: a host unreachable) has its teardown retried while the others serve,
as with one (services/up/run.py `teardown_until_proven`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from common.messages import FAILED_STATES, DeploymentState
from common.messages.commands import deploy
from common.model_ref import model_id
from services.up.admin import UpError
from services.up.banner import print_banner
from services.up.restart_budget import Exhausted
from services.up.single import Up, wait_http_ready
from services.up.supervisor_keeper import SupervisorGone


@dataclass
class Replica:
    index: int
    dep_id: str
    serving: bool = False  # its canary passed (since its last (re)deploy)
    given_up: bool = False  # failed past the restart budget: left down


class ReplicaSet:
    def __init__(self, up: Up, model: str, hosts, envs: list[str], backend: str) -> None:
        self.up, self.model, self.hosts, self.envs, self.backend = up, model, hosts, envs, backend
        self.n = up.s.replicas
        self.budget = up.restart_budget()
        self.replicas: list[Replica] = []

    def deploy(self, r: int) -> str:
        s = self.up.s
        dep_id = f"d-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}-r{r}"
        self.up.admin.ask(deploy.Args(
            model_path=self.model, tp=s.tp, pp=s.pp, hosts=self.hosts, backend=self.backend,
            wait=False, envs=self.envs, sampling=self.up.sampling, deployment_id=dep_id,
            replicas=self.n, replica=r), timeout=120.0)
        self.up.log(f"deploying replica {r} of {model_id(self.model)} as {dep_id} "
                    f"(tp={s.tp}, pp={s.pp}, backend={self.backend})")
        return dep_id

    def run(self) -> int:
        up, s = self.up, self.up.s
        self.replicas = [Replica(r, self.deploy(r)) for r in range(self.n)]
        deadline = time.monotonic() + s.ready_timeout
        while not all(r.serving for r in self.replicas):  # every replica's canary first
            if up.stop_flag.wait(0.25):
                return 0
            self.check(starting=True)
            if time.monotonic() > deadline:
                slow = [r.dep_id for r in self.replicas if not r.serving]
                raise UpError(f"replica(s) {', '.join(slow)} not serving after "
                              f"{s.ready_timeout:.0f}s")
        url = up.local_url()
        wait_http_ready(url + "/ready", max(1.0, deadline - time.monotonic()), up.stop_flag,
                        lambda: self.check(starting=True))
        if up.stop_flag.is_set():
            return 0
        first = up.admin.deployment(self.replicas[0].dep_id)
        print_banner(up, url, model_id(self.model),
                     f"{self.n} replicas: " + ", ".join(r.dep_id for r in self.replicas),
                     first)
        while not up.stop_flag.wait(1.0):
            self.check(starting=False)
        return 0

    def check(self, *, starting: bool) -> None:
        """Every replica's state: note its ranks, redeploy the failed ones (and, after a
        supervisor restart, the ones it did not adopt)."""
        restarted = False
        try:
            self.up.check_children()
        except SupervisorGone as gone:
            if not self.up.keeper.restart(gone):
                return  # up is stopping
            restarted = True
        for rep in self.replicas:
            dep = self.up.admin.deployment(rep.dep_id)
            if dep is None:
                if restarted and not rep.given_up:  # not adopted, and reaped: gone
                    self.redeploy(rep, DeploymentState.FAILED, "not adopted by the restarted "
                                  "supervisor", torn_down=True)
                continue
            self.up.note_ranks(dep)
            if dep.state == DeploymentState.SERVING and not rep.serving:
                rep.serving = True
                if not starting:
                    self.up.log(f"replica {rep.index} serving again as {rep.dep_id}")
            elif dep.state in FAILED_STATES and not rep.given_up:
                self.redeploy(rep, dep.state, dep.error)

    def redeploy(self, rep: Replica, state: DeploymentState, error: str | None, *,
                 torn_down: bool = False) -> None:
        proven = state == DeploymentState.TEARDOWN_FAILED
        if proven and not self.up.teardown_until_proven(rep.dep_id, f"{state}: {error}"):
            return  # up is stopping
        decision = self.budget.decide(time.monotonic())
        if isinstance(decision, Exhausted):
            rep.given_up = True
            self.up.log(f"replica {rep.index}: deployment {rep.dep_id} is {state}: {error}; "
                        f"{decision.reason()}: left down, the others serve on", err=True)
            return
        self.up.log(f"replica {rep.index}: deployment {rep.dep_id} is {state}: {error}; the "
                    f"others serve on; redeploying it ({decision.used} of {self.up.s.restarts}"
                    f" within {self.up.s.restart_window:g}s)")
        if not proven and not torn_down and not self.up.teardown_until_proven(
                rep.dep_id, f"{state}: {error}"):
            return
        if self.up.stop_flag.wait(decision.delay_s):
            return
        self.budget.record(time.monotonic())
        rep.dep_id, rep.serving = self.deploy(rep.index), False
