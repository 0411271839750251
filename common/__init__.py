"""What every Lockstep process shares: the wire, the keys, the settings, the state files.

Records that cross a process boundary, each one typed and versioned, with one writer and
one strict reader that every process uses (a record is refused, naming its file or its
deployment, on another schema version, a missing field or an unknown key):

| record | where | writer | reader |
|---|---|---|---|
| `SupervisorRecord` (records.py) | `runtime/supervisor.json` | supervisor (service.py) | `home.read_supervisor_record`: up (run.py, preflight.py), admin CLI, home lock, gateway |
| `LaunchManifest` (records.py) | `runtime/manifests/<job>.json` | supervisor (launch, stop); reaper (its teardown failures) | `home.read_manifests`: the reaper's sweep (in the reaper, and in the supervisor at start) |
| `RankMarker` (records.py) | `runtime/markers/<dep>/rank-<r>.json` | rank | `home.read_markers`: supervisor (readiness, teardown), reaper, host agent |
| `RankSpec` (rankspec.py) | the job directory's `rank-<r>.spec.json` | supervisor (launch) | `RankSpec.load`: rank |
| `DeploymentInfo` (deployment_info.py) | admin `status` / `deployments` replies | supervisor (deployment.py `to_wire`) | `read_deployment_info`: gateway, up, admin CLI; `keys.requests_key_of` opens its sealed requests key |

Files: `atomic_json.py` writes and reads any state file (atomic, 0600, `schema_version`),
`records.py` holds the on-disk record types, `home.py` the `$LOCKSTEP_HOME` layout
(`Paths`) and each on-disk record's reader and writer. Other modules: `envelope.py`
(signing, caps, replay), `schema.py` + `messages/` (typed bodies), `bus.py` (sockets,
RPC), `frame_budget.py` (what unauthenticated frames may cost a listener),
`handshake.py` (session auth), `procs.py` (process identity, the teardown ladder),
`launcher_watch.py` (services watching `lockstep up`), `config.py` (settings).
"""
