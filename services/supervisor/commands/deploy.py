"""deploy — plan and launch a deployment: reap orphans first (a failed reap or an
unreadable manifest refuses with `reap_blocked`), write the manifest, start the ranks,
wait for the readiness barrier, release serve, pass the canary.

    request  {model_path: str|null (null = the embedded model, built once into
              $LOCKSTEP_HOME/models/tiny), tp: int=1, pp: int=1,
              hosts: [host record]|null (null = this machine only),
              backend: "auto"|"ring"|"jaccl"|"mpi" = "auto", deployment_id: str|null,
              wait: bool=true, envs: ["K=V"]=[],
              sampling: {temperature?, top_p?, top_k?, min_p?, repetition_penalty?}|null
              (defaults for requests that name none; over the model's generation_config.json),
              replicas: int=1 (N deployments of the model, ids <id>-r<i>, each on the next
              tp*pp rank slots of the hosts: services/supervisor/replicas.py),
              replica: int|null (deploy only that replica of `replicas`)}
    reply    {deployment_id, job_id, state}   (wait=true: state "serving"); with several
             replicas also deployments: [{deployment_id, job_id, state}] (the first above)
    errors   bad_request, conflict (deployment exists), reap_blocked, launch_failed
             (data: {error, rank, teardown, teardown_error?}: the launch error first, a
             failed teardown after it)
    CLI      lockstep admin deploy [--model PATH] [--tp N] [--pp N] [--hosts FILE]
                                   [--backend B] [--id ID] [--no-wait]
                                   [--temperature T] [--top-p P] [--top-k K] [--min-p P]
                                   [--repetition-penalty R]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.sampling_defaults import SamplingOverrides
from services.supervisor import lifecycle
from services.supervisor.deployment_state import DeploymentState as S

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    model_path: str | None = None
    tp: int = 1
    pp: int = 1
    hosts: list[dict[str, object]] | None = None
    backend: str = "auto"
    deployment_id: str | None = None
    wait: bool = True
    envs: list[str] = field(default_factory=list)
    sampling: SamplingOverrides | None = None
    replicas: int = 1
    replica: int | None = None


async def run(sup: CommandHost, args: Args) -> dict:
    result = await sup.deploy(model_path=args.model_path, tp=args.tp, pp=args.pp,
                              hosts=args.hosts, backend=args.backend,
                              deployment_id=args.deployment_id, wait=args.wait, envs=args.envs,
                              sampling=args.sampling, replicas=args.replicas,
                              replica=args.replica)
    if args.wait and "deployments" not in result:
        dep = sup.deployments.get(result["deployment_id"])
        if dep is not None and dep.job_id == result["job_id"] and dep.state != S.SERVING:
            raise lifecycle.launch_failure(dep)
    return result
