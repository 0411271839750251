"""The supervisor's resolved watchdog settings reach its ranks: a LOCKSTEP_* watchdog
variable in the supervisor's environment must not beat its own --flag on the rank side,
while a deployment's explicit envs still may."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.rankspec import WATCHDOG_ENV
from services.rank.watchdogs import WatchdogSettings
from services.supervisor.deployment import Deployment
from services.supervisor.job_launch import _env, rank_settings
from services.supervisor.plan import DeployPlan
from services.supervisor.settings import SupervisorSettings


def _dep(tmp_path: Path, envs: list[str]) -> Deployment:
    plan = DeployPlan(model_path="m", tp=1, pp=1, backend="none", requested_backend="auto",
                      hosts=None, members=[], envs=envs)
    return Deployment(deployment_id="d", job_id="j", plan=plan, job_dir=tmp_path)


def test_supervisor_flags_beat_its_inherited_environment(tmp_path, monkeypatch):
    from common.home import Paths

    for var in WATCHDOG_ENV:
        monkeypatch.setenv(var, "99")
    settings = replace(SupervisorSettings(home=tmp_path), peer_abort_grace=2.0,
                       progress_stall_timeout=30.0, signal_clear_timeout=4.0)
    env = _env(_dep(tmp_path, []), 0, Paths(tmp_path), settings, {})
    assert not set(WATCHDOG_ENV) & set(env)
    got = WatchdogSettings.resolve(rank_settings(settings), env)  # as the rank resolves it
    assert (got.peer_abort_grace, got.progress_stall_timeout, got.signal_clear_timeout) == (2.0, 30.0, 4.0)


def test_a_deployments_explicit_envs_still_override(tmp_path, monkeypatch):
    from common.home import Paths

    monkeypatch.setenv("LOCKSTEP_PEER_ABORT_GRACE", "99")
    settings = SupervisorSettings(home=tmp_path)
    env = _env(_dep(tmp_path, ["LOCKSTEP_PEER_ABORT_GRACE=0"]), 0, Paths(tmp_path), settings, {})
    assert WatchdogSettings.resolve(rank_settings(settings), env).peer_abort_grace == 0.0
