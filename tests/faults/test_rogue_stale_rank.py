"""A rank process started with a stale secret (or as a second copy of a live rank) cannot
join a live TP=2 deployment (real `python -m services.rank` processes, ring backend,
tests/e2e/rank_harness.py playing the supervisor).

The intruder is the real rank program with rank 1's spec, in its own $LOCKSTEP_HOME (its
own marker files):
- stale secret: the spec of this launch, but another launch's secret in the secret file;
- old launch: the spec *and* secret of an earlier launch of the same deployment id;
- duplicate: this launch's own secret (an insider), started while rank 1 is serving.
Each one never sees a LEASE it can verify, never loads, is refused by rank 0's plan
socket and by the report socket with a specific reason, and fails closed after
`auth_timeout_s` with a marker that says why. The live deployment keeps serving."""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from common.atomic_json import read_json
from common.home import Paths, marker_path
from common.keys import new_launch_secret
from common.rankspec import RankSpec
from tests.e2e.rank_harness import REPO, Deployment, poll_until

AUTH_TIMEOUT_S = 4.0
PROMPT = [2, 7, 1, 8, 2, 8]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("live"), mode="tp")
    d.start()
    d.reference = d.generate(PROMPT, 30)
    yield d
    d.teardown()


def intruder_spec(d: Deployment, root: Path, case: str) -> Path:
    home = Paths(root / "home").ensure()
    spec = d.spec(1)
    secret = home.secrets / "intruder.key"
    if case == "duplicate":
        secret.write_bytes(Path(d.secret_path).read_bytes())
        os.chmod(secret, 0o600)
    else:
        new_launch_secret(secret)  # a secret that is not this launch's
    job = "j-old-" + secrets.token_hex(3) if case == "old_launch" else spec.job_id
    settings = dataclasses.replace(spec.settings, auth_timeout_s=AUTH_TIMEOUT_S)
    spec = dataclasses.replace(spec, job_id=job, home=str(home.home), secret_path=str(secret),
                               settings=settings)
    path = root / "intruder.spec.json"
    spec.save(path)
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "plan_reason", "report_reason"), [
    ("stale_secret", "unknown_key", "unknown_key"),
    ("old_launch", "unknown_key", "unknown_key"),
    ("duplicate", "duplicate_rank", "duplicate_rank"),
])
def test_intruding_rank_cannot_join(live, tmp_path, case, plan_reason, report_reason):
    d = live
    before_plan = d.fresh_telemetry(0).rejects.get(f"plan.{plan_reason}", 0)
    before_report = d.stub.rep.rejects.snapshot().get(report_reason, 0)
    spec_path = intruder_spec(d, tmp_path, case)
    env = d.rank_env(1)
    log = open(tmp_path / "intruder.log", "wb")  # noqa: SIM115 - closed below
    p = subprocess.Popen([sys.executable, "-m", "services.rank", "--spec", str(spec_path)],
                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = p.wait(AUTH_TIMEOUT_S + 30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    out = (tmp_path / "intruder.log").read_text(errors="replace")
    assert code == 1, out[-3000:]
    spec = RankSpec.load(spec_path)
    marker = read_json(marker_path(Paths(Path(spec.home)), spec.deployment_id, 1))
    assert marker["phase"] == "failed" and "mutual authentication" in marker["error"], marker
    assert "load" not in {marker["phase"]} and marker["step"] == 0
    rejects = marker["extra"]["rejects"]
    if case != "duplicate":  # it could not verify a single LEASE or challenge
        assert rejects.get("control.unknown_key", 0) > 0, rejects
    # Refused by rank 0's plan socket and by the report socket, under a specific reason.
    poll_until(lambda: d.fresh_telemetry(0).rejects.get(f"plan.{plan_reason}", 0)
               > before_plan, 10, f"rank 0 to count plan.{plan_reason}")
    assert d.stub.rep.rejects.snapshot().get(report_reason, 0) > before_report
    assert "loading" not in out and "distributed" not in out.lower()
    # The live deployment is untouched: same tokens, both ranks still serving.
    assert d.generate(PROMPT, 30).tokens == d.reference.tokens
    assert d.live_ranks() == {0, 1}
    assert d.marker(1)["pid"] == d.procs[1].pid
