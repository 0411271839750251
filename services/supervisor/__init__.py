"""`lockstep supervisor`: owns deployments — plan, launch, readiness barrier, canary,
cancel broadcasts, supervisor lease, verified teardown, launch manifests and the signed
ZeroMQ admin socket (DESIGN.md sections 1, 5, 6; docs/protocol.md).

Where each behaviour lives. The process (sockets, deployment table, report handling,
lease and monitor loops, events, the reap gate) is `service.Supervisor`; the rest see it
through `interfaces` (CommandHost for the admin commands; TeardownHost ⊂ LaunchHost ⊂
LifecycleHost for the orchestration, each function typed with the narrowest it needs), and
only `__main__` imports `service`. A deployment's fields, and the methods that change
them (a launch's setup arrives once, as a `LaunchSetup`), are `deployment`, its states
and their allowed edges (and the one claim a launch, stop or teardown holds)
`deployment_state`. The lifecycle — deploy (reap → plan → launch →
barrier → serve → canary), stop, replan, the bookkeeping after a teardown — is
`lifecycle` (§5); plans and their signatures `plan`, hosts files `hosts`. A job's launch
files, manifest and rank starts are `job_launch`; how one rank process is started is
`process_launcher` (local) and `remote` (ssh, with `remote_ops` and `remote_watch` for
the remote half of a launch and its liveness). Readiness barrier and serve release:
`readiness`; canary: `canary`. Cancellation (§6): `broadcast` (cancel and abort-all
epochs, acks) with `epochs` (the persisted epoch). Teardown: `teardown` (verified: the
shutdown → SIGTERM → SIGKILL ladder and sweep), `teardown_remote` (over ssh); after a
rank is lost: `after_failure` (bounded, retried teardown). Reaping orphans at start and
before every launch: `service.Supervisor.reap` calling `services.reaper`. Rank report
admission (keys, replay): `admission`, `sockets`. One supervisor per home: `homelock`.
Admin commands, one module each with its protocol doc: `commands/`; error codes
`errors`; settings `settings`."""
