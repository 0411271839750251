"""The operator's tools: `lockstep admin` (cli.py: the supervisor's admin socket from the
shell; status.py: how `status` and `watch` show a deployment) and `lockstep keygen`
(keygen.py: the cluster key)."""
