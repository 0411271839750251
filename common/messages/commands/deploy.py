"""deploy — plan and launch a deployment: reap orphans first (a failed reap or an
unreadable manifest refuses with `reap_blocked`), write the manifest, start the ranks,
wait for the readiness barrier, release serve, pass the canary.

    request  {model_path: str|null (null = the embedded model, built once into
              $LOCKSTEP_HOME/models/tiny), tp: int=1, pp: int=1,
              hosts: [host record]|null (null = this machine only),
              backend: "auto"|"ring"|"jaccl"|"mpi" = "auto", deployment_id: str|null,
              wait: bool=true, envs: ["K=V"]=[],
              sampling: {temperature?, top_p?, ...}|null (one field per deployable
              parameter of common/request_params.py: defaults for requests that name
              none; over the model's generation_config.json),
              replicas: int=1 (N deployments of the model, ids <id>-r<i>, each on the next
              tp*pp rank slots of the hosts: services/supervisor/replicas.py),
              replica: int|null (deploy only that replica of `replicas`)}
    reply    {deployment_id, job_id, state}   (wait=true: state "serving"); with several
             replicas also deployments: [{deployment_id, job_id, state}] (the first above)
    errors   bad_request, conflict (deployment exists), reap_blocked, launch_failed
             (data: {error, rank, teardown, teardown_error?}: the launch error first, a
             failed teardown after it)
    CLI      lockstep admin deploy [--model PATH] [--tp N] [--pp N] [--replicas N]
                                   [--hosts FILE] [--backend B] [--id ID] [--no-wait]
                                   [--temperature T] [--top-p P] ... (each deployable
                                   sampling parameter)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.commands.cli import (
    BACKEND_CHOICES,
    FLATTEN,
    HIDDEN,
    HOSTS_FILE,
    choices,
    flag,
)
from common.messages.vocab import DeploymentState
from common.sampling_defaults import SamplingOverrides


@dataclass
class Args:
    model_path: str | None = field(default=None, metadata=flag("--model"))
    tp: int = 1
    pp: int = 1
    hosts: list[dict[str, object]] | None = field(default=None, metadata=HOSTS_FILE)
    backend: str = field(default="auto", metadata=choices(BACKEND_CHOICES))
    deployment_id: str | None = field(default=None, metadata=flag("--id"))
    wait: bool = True
    envs: list[str] = field(default_factory=list, metadata=HIDDEN)  # from the hosts file
    sampling: SamplingOverrides | None = field(default=None, metadata=FLATTEN)
    replicas: int = 1
    replica: int | None = field(default=None, metadata=HIDDEN)


@dataclass(frozen=True)
class Launched:
    deployment_id: str
    job_id: str
    state: DeploymentState

    def render(self) -> str:
        return f"{self.deployment_id}: {self.state} (job {self.job_id})"


@dataclass(frozen=True)
class Reply(Launched):
    # several replicas: each of them (the first is the one above)
    deployments: list[Launched] = field(default_factory=list)
