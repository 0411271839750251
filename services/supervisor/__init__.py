"""`lockstep supervisor`: owns deployments — plan, launch, readiness barrier, canary,
cancel broadcasts, supervisor lease, verified teardown, launch manifests and the signed
ZeroMQ admin socket (DESIGN.md sections 1, 5, 6; docs/protocol.md)."""
