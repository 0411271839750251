"""`lockstep up` serving one deployment of its model (replicas: services/up/replicas.py):
deploy it, wait for it to serve (then the banner), watch it, and when it fails redeploy
it at the rate `--restarts` / `--restart-window` allows, telling the gateway a
redeploy is on its way (services/up/redeploy_notice.py). A supervisor that dies is
restarted (services/up/supervisor_keeper.py) and what it did not adopt is redeployed;
past the rate, `up` waits for an operator's deploy."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import httpx

from common.messages import FAILED_STATES, DeploymentState
from common.messages.commands import deploy
from common.model_ref import model_id
from common.sampling_defaults import SamplingOverrides
from services.up import banner
from services.up.admin import AdminLink, DeploymentDown, UpError
from services.up.banner import print_banner
from services.up.progress import UpProgress
from services.up.redeploy_notice import RedeployNotice
from services.up.restart_budget import Exhausted, RestartBudget
from services.up.supervisor_keeper import SupervisorGone, SupervisorKeeper


class Up(banner.Up, Protocol):
    """What a deployment's watch uses of `lockstep up` (services/up/run.py's Up; also
    replicas.py's): declared here, so this module needs nothing above it."""

    admin: AdminLink | None
    stop_flag: threading.Event
    sampling: SamplingOverrides  # type: ignore[valid-type]
    keeper: SupervisorKeeper
    shown: UpProgress
    notice: RedeployNotice

    def check_children(self) -> None: ...

    def restart_budget(self) -> RestartBudget: ...

    def progress(self, dep_id: str) -> Any: ...

    def note_ranks(self, dep: Any) -> None: ...

    def local_url(self) -> str: ...

    def teardown_until_proven(self, dep_id: str, why: str) -> bool: ...

def wait_http_ready(url: str, timeout: float, stop: threading.Event, progress) -> None:
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        progress()
        try:
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise UpError(f"not ready after {timeout:.0f}s ({url})")
        stop.wait(0.5)


class SingleDeployment:
    def __init__(self, up: Up, model: str, hosts, envs, backend: str) -> None:
        self.up, self.model, self.hosts, self.envs, self.backend = up, model, hosts, envs, backend

    def run(self) -> int:
        up, s = self.up, self.up.s
        model, hosts, envs, backend = self.model, self.hosts, self.envs, self.backend
        budget = up.restart_budget()
        dep_id: str | None = None  # the deployment `up` watches
        redeploy = True  # a (re)deploy is due (one that fails before serving counts too)
        awaiting = False  # dep_id not yet seen serving (its banner not shown)
        served = False  # some deployment of ours has served
        while True:
            try:
                if redeploy:
                    redeploy, dep_id = False, self.deploy(model, hosts, envs, backend)
                    awaiting = True
                if awaiting:
                    if not self.await_serving(model, dep_id):
                        return 0  # stopped while waiting
                    awaiting, served = False, True
                while not up.stop_flag.wait(1.0):
                    dep = up.progress(dep_id)
                    if dep is not None and dep.state == DeploymentState.STOPPED:
                        up.notice.clear()  # an operator's unload: not ours to undo
                return 0
            except SupervisorGone as gone:
                # at any point, the first deploy included: a restarted supervisor adopts
                # what was serving, and what was not is deployed again
                if not up.keeper.restart(gone):
                    return 0
                dep = up.admin.deployment(dep_id) if dep_id else None
                if dep is not None and dep.state == DeploymentState.SERVING:
                    up.log(f"{dep_id} adopted by the new supervisor: serving on")
                    continue
                self.announce_redeploy(model, budget, "its deployment was not adopted")
                up.log(f"{dep_id or 'the deployment being made'} was not adopted "
                       f"({dep.state if dep else 'not found'}"
                       f"{': ' + dep.error if dep and dep.error else ''}); redeploying")
                if dep is not None and dep.state in FAILED_STATES:
                    if not up.teardown_until_proven(dep_id, "not adopted"):
                        return 0
                decision = budget.decide(time.monotonic())
                if isinstance(decision, Exhausted):
                    dep_id = self.wait_for_a_deploy(model, DeploymentDown(
                        dep_id, DeploymentState.FAILED, "not adopted"), decision)
                    continue
                if up.stop_flag.wait(decision.delay_s):
                    return 0
                budget.record(time.monotonic())
                redeploy = True
            except DeploymentDown as down:
                if not served:  # the first deployment failing is the user's to see: exit
                    raise
                self.announce_redeploy(model, budget, str(down))
                # A rank died or a peer was lost: the ranks are gone (the supervisor proves
                # it). Redeploy at a bounded rate instead of leaving no service.
                dep_id = down.dep_id
                proven = down.state == DeploymentState.TEARDOWN_FAILED
                if proven and not up.teardown_until_proven(dep_id, str(down)):
                    return 0  # stopped meanwhile
                decision = budget.decide(time.monotonic())
                if isinstance(decision, Exhausted):
                    dep_id = self.wait_for_a_deploy(model, down, decision)
                    continue
                up.log(f"{down}; redeploying ({decision.used} of {s.restarts} within "
                       f"{s.restart_window:g}s{f', in {decision.delay_s:.1f}s' if decision.delay_s else ''})")
                if not proven and not up.teardown_until_proven(dep_id, str(down)):
                    return 0
                if up.stop_flag.wait(decision.delay_s):
                    return 0
                budget.record(time.monotonic())
                redeploy = True

    def announce_redeploy(self, model: str, budget: RestartBudget, why: str) -> None:
        """The gateway holds requests for `model` while a redeploy the rate allows is on
        its way (services/up/redeploy_notice.py); past the rate it refuses them at once.
        (The promise stands from the first serving on: this only updates or ends it.)"""
        if isinstance(budget.decide(time.monotonic()), Exhausted):
            self.up.notice.clear()
        else:
            self.up.notice.promise(model_id(model), why)

    def wait_for_a_deploy(self, model: str, down: DeploymentDown, why: Exhausted) -> str | None:
        """Past the redeploy rate: everything but the model keeps running (/ready 503,
        requests 503 naming the failed deployment) until an operator deploys the model
        again; that deployment is then ours to watch. None: stopped meanwhile."""
        self.up.notice.clear()
        self.up.log(f"{down}; {why.reason()}: not redeploying. The gateway, supervisor and "
                    f"reaper keep running; deploy {model_id(model)} again to serve it "
                    "(lockstep admin deploy, or POST /admin/api/cluster/deployments)", err=True)
        while not self.up.stop_flag.wait(1.0):
            self.up.check_children()
            for d in self.up.admin.deployments(10.0):
                if d.state == DeploymentState.SERVING and d.model == model_id(model):
                    self.up.log(f"{model_id(model)} serving again as {d.deployment_id} "
                                "(deployed by the operator); watching it")
                    self.up.notice.promise(model_id(model))
                    return d.deployment_id
        return None

    def deploy(self, model: str, hosts, envs, backend: str) -> str:
        s = self.up.s
        args = deploy.Args(model_path=model, tp=s.tp, pp=s.pp, hosts=hosts, backend=backend,
                           wait=False, envs=envs, sampling=self.up.sampling)
        dep_id = self.up.admin.ask(args, timeout=120.0).deployment_id
        self.up.log(f"deploying {model_id(model)} as {dep_id} (tp={s.tp}, pp={s.pp}, "
                    f"backend={backend})")
        return dep_id

    def await_serving(self, model: str, dep_id: str) -> bool:
        """`dep_id` serving and the gateway ready, then the banner. False: stopped first."""
        s = self.up.s
        url = self.up.local_url()
        deadline = time.monotonic() + s.ready_timeout
        while not self.up.stop_flag.is_set():  # this deployment serving, not a stale /ready
            self.up.progress(dep_id)
            dep = self.up.admin.deployment(dep_id)
            self.up.shown.update(dep)
            if dep is not None and dep.state == DeploymentState.SERVING:
                break
            if time.monotonic() > deadline:
                raise UpError(f"deployment {dep_id} not serving after {s.ready_timeout:.0f}s")
            self.up.stop_flag.wait(0.25)
        try:
            wait_http_ready(url + "/ready", max(1.0, deadline - time.monotonic()),
                            self.up.stop_flag, lambda: self.up.progress(dep_id))
        finally:
            self.up.shown.end()
        if self.up.stop_flag.is_set():
            return False
        self.up.notice.promise(model_id(model))  # from now on, a failure is redeployed
        print_banner(self.up, url, model_id(model), dep_id, dep)
        return True
