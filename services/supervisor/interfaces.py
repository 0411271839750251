"""What the parts of the supervisor see of it, each the members it uses and nothing else
(`service.Supervisor` provides both; tests/unit/supervisor/test_host_interfaces.py checks
the uses against the declarations):

- `CommandHost`, for the admin commands (commands/*): the deployment table and the
  supervisor's identity read, and a deploy, stop, replan, reap, cancel or cache clear
  asked; never the sockets, the launchers or a deployment's mutable fields.
- for the orchestration, three, each inside the next, so each function is typed with the
  narrowest it needs:
  - `TeardownHost` (9 members), for a verified teardown and its bookkeeping
    (lifecycle.teardown, record_unproven; remote_ops.remove_remote_files; after_failure):
    the settings and home, the kill seams, the ssh launcher, dropping a report route,
    the shutdown published, the state changes and events;
  - `LaunchHost` (15), for a launch (lifecycle._launch, remote_ops.launch_remote): also
    the launchers, the identity and endpoints, the epoch floor, the zmq context (canary)
    and a task spawned (a failed launch tears down);
  - `LifecycleHost` (21), for deploy, stop and replan (lifecycle): also the deployment
    table, the default hosts and model, the reap gate, the abort broadcaster and the
    cluster key (a replan's signature)."""

from __future__ import annotations

import collections
from collections.abc import Coroutine, Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

    import zmq.asyncio

    from common.bus import Channel
    from common.envelope import Key
    from common.home import Paths
    from common.messages import EventName, EventTopic
    from common.sampling_defaults import SamplingOverrides
    from services.supervisor.broadcast import Broadcaster
    from services.supervisor.cache_clears import CacheClears
    from services.supervisor.deployment import Deployment
    from services.supervisor.deployment_state import DeploymentState
    from services.supervisor.epochs import EpochStore
    from services.supervisor.hosts import HostsFile
    from services.supervisor.job_launch import SupervisorIdentity
    from services.supervisor.process_launcher import Launcher
    from services.supervisor.remote import SshLauncher
    from services.supervisor.settings import SupervisorSettings
    from services.supervisor.teardown import TeardownSeams


class Endpoints(Protocol):
    """The supervisor's bound sockets, as `status` shows them."""

    @property
    def admin_endpoint(self) -> str: ...
    @property
    def events_endpoint(self) -> str: ...
    @property
    def control_endpoint(self) -> str: ...
    @property
    def report_endpoint(self) -> str: ...


class CommandHost(Protocol):
    @property
    def version(self) -> str: ...
    @property
    def settings(self) -> SupervisorSettings: ...
    @property
    def paths(self) -> Paths: ...
    @property
    def me(self) -> SupervisorIdentity: ...
    @property
    def started_at(self) -> float: ...
    @property
    def cluster_key(self) -> Key: ...
    @property
    def sockets(self) -> Endpoints: ...
    @property
    def epochs(self) -> EpochStore: ...
    @property
    def broadcaster(self) -> Broadcaster: ...
    @property
    def cache_clears(self) -> CacheClears: ...
    @property
    def deployments(self) -> Mapping[str, Deployment]: ...
    @property
    def last_reap(self) -> dict[str, Any] | None: ...
    @property
    def adoption_rejections(self) -> Mapping[str, int]: ...  # launches not adopted, by why
    @property
    def journal(self) -> Iterable[dict[str, Any]]: ...

    def get(self, deployment_id: str) -> Deployment:
        """The deployment, or AdminError not_found."""
        ...

    async def reap(self) -> dict[str, Any]: ...

    async def deploy(self, *, model_path: str | None, tp: int, pp: int,
                     hosts: list[dict[str, object]] | None, backend: str,
                     deployment_id: str | None, wait: bool, envs: list[str],
                     sampling: SamplingOverrides | None = None, replicas: int = 1,
                     replica: int | None = None) -> dict[str, Any]: ...

    async def stop_deployment(self, deployment_id: str, *, force: bool) -> dict[str, Any]: ...

    async def replan(self, deployment_id: str, backend: str, sig: str | None,
                     force: bool = False) -> dict[str, Any]: ...


class ReportRoutes(Protocol):
    """The supervisor's sockets as a launch uses them: where ranks report, and to whom a
    launch's reports go."""

    def rank_endpoints_toward(self, address: str) -> tuple[str, str]: ...
    def add_report_route(self, key: Key, channel: Channel, route: Any) -> None: ...
    def drop_report_route(self, key: Key) -> None: ...


class TeardownHost(Protocol):
    @property
    def settings(self) -> SupervisorSettings: ...
    @property
    def paths(self) -> Paths: ...
    @property
    def seams(self) -> TeardownSeams: ...
    @property
    def remote_launcher(self) -> SshLauncher: ...
    @property
    def sockets(self) -> ReportRoutes: ...

    def publish_dep(self, dep: Deployment, body: Any) -> None: ...
    def set_state(self, dep: Deployment, state: DeploymentState, reason: str = "") -> None: ...
    def incident(self, dep: Deployment, name: EventName, reason: str,
                 data: dict[str, Any] | None = None) -> None: ...
    def emit(self, topic: EventTopic, name: EventName, dep: Deployment, reason: str = "",
             data: dict[str, Any] | None = None) -> None: ...


class LaunchHost(TeardownHost, Protocol):
    @property
    def me(self) -> SupervisorIdentity: ...
    @property
    def ctx(self) -> zmq.asyncio.Context: ...
    @property
    def epochs(self) -> EpochStore: ...
    @property
    def launcher(self) -> Launcher: ...
    @property
    def rank_env(self) -> dict[str, str]: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class LifecycleHost(LaunchHost, Protocol):
    @property
    def cluster_key(self) -> Key: ...
    @property
    def default_hosts(self) -> HostsFile | None: ...
    @property
    def model_lock(self) -> asyncio.Lock: ...
    @property
    def deployments(self) -> MutableMapping[str, Deployment]: ...
    @property
    def broadcaster(self) -> Broadcaster: ...

    async def reap(self) -> dict[str, Any]: ...


class AdoptionSockets(ReportRoutes, Protocol):
    def bind_rank_endpoints(self, control: str, report: str) -> None: ...


class AdoptionHost(LifecycleHost, Protocol):
    """What services/supervisor/adoption.py needs: a launch's host, plus the endpoints a
    dead predecessor gave remote ranks and the count of launches not adopted."""

    @property
    def sockets(self) -> AdoptionSockets: ...
    @property
    def adoption_rejections(self) -> collections.Counter[str]: ...
