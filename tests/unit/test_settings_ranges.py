"""One name per setting from flag to rank, parsed once, every range checked at load."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, load_settings
from common.rank_env import HostBlasSettings
from common.rankspec import ENV_OVERRIDES, RankSettings
from services.gateway.core import settings as gw_settings
from services.rank.seams import TestSeams
from services.reaper.__main__ import ReaperSettings
from services.supervisor import settings as sup_settings
from services.supervisor.job_launch import RANK_FIELDS, rank_settings
from services.up.settings import UpSettings

REPO = Path(__file__).resolve().parents[2]


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def test_the_supervisor_hands_ranks_its_settings_under_the_same_names():
    sup, rank = _defaults(sup_settings.SupervisorSettings), _defaults(RankSettings)
    # the supervisor's "auto" (-1) is resolved before any rank sees it: a rank's own
    # default is what a hand-made spec gets (0: no disk tier)
    resolved = {"prompt_cache_disk_bytes", "kv_budget_bytes"}
    for name in set(RANK_FIELDS) - resolved:
        assert sup[name] == rank[name], name
    assert sup["prompt_cache_disk_bytes"] == -1 and rank["prompt_cache_disk_bytes"] == 0
    assert sup["kv_budget_bytes"] == -1 and rank["kv_budget_bytes"] == 0  # auto: per plan
    assert rank_settings(sup_settings.SupervisorSettings()).prompt_cache_disk_bytes > 0
    off = sup_settings.SupervisorSettings(prompt_cache_disk_bytes=0)
    assert rank_settings(off).prompt_cache_disk_bytes == 0
    no_cache = sup_settings.SupervisorSettings(prompt_cache_entries=0)
    assert rank_settings(no_cache).prompt_cache_disk_bytes == 0
    assert set(ENV_OVERRIDES) <= set(RANK_FIELDS)
    s = sup_settings.load(env={"LOCKSTEP_PEER_ABORT_GRACE": "2", "LOCKSTEP_LEASE_TTL": "9",
                               "LOCKSTEP_RANK_TELEMETRY_INTERVAL_S": "0.5"})
    r = rank_settings(s)
    assert (r.peer_abort_grace, r.lease_ttl, r.rank_telemetry_interval_s) == (2.0, 9.0, 0.5)


@pytest.mark.parametrize(("load", "var", "raw"), [
    (sup_settings.load, "LOCKSTEP_PEER_ABORT_GRACE", "-1"),
    (sup_settings.load, "LOCKSTEP_LEASE_TTL", "inf"),
    (sup_settings.load, "LOCKSTEP_ADMIN_PORT", "70000"),
    (sup_settings.load, "LOCKSTEP_CANARY_RUNS", "0"),
    (gw_settings.load, "LOCKSTEP_MAX_INFLIGHT", "-1"),
    (gw_settings.load, "LOCKSTEP_PREPARE_THREADS", "0"),
    (gw_settings.load, "LOCKSTEP_KEEPALIVE_S", "nan"),
    (lambda env: load_settings(ReaperSettings, env=env), "LOCKSTEP_REAPER_INTERVAL", "0"),
    (lambda env: load_settings(UpSettings, env=env), "LOCKSTEP_TP", "0"),
    (lambda env: RankSettings().with_env(env), "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT", "-0.5"),
])
def test_out_of_range_is_refused_naming_the_setting(load, var, raw):
    with pytest.raises(ConfigError) as info:
        load(env={var: raw})
    name = var.removeprefix("LOCKSTEP_").lower()
    assert var in str(info.value) and name in str(info.value)


def test_the_rank_takes_only_its_overrides_from_its_environment():
    s = RankSettings(lease_ttl=9.0).with_env({"LOCKSTEP_PEER_ABORT_GRACE": "1.5",
                                             "LOCKSTEP_LEASE_TTL": "1", "LOCKSTEP_MAX_BATCH": "1"})
    assert (s.peer_abort_grace, s.lease_ttl, s.max_batch) == (1.5, 9.0, 16)
    with pytest.raises(ConfigError, match="peer_fail_tolerance"):  # the spec's values too
        RankSettings(peer_fail_tolerance=0).with_env({})


def test_seams_and_openblas_switches_go_through_the_one_parser():
    on = TestSeams(True, {"LOCKSTEP_TEST_DROP_PLAN_SEQ": "3", "LOCKSTEP_TEST_STEP_DELAY_S": "0.5",
                          "LOCKSTEP_TEST_HANG_ON_SIGTERM": "1", "LOCKSTEP_TEST_BLOCK_STEP_AFTER": ""})
    assert (on.drop_plan_seq, on.step_delay_s, on.hang_on_signal, on.block_step_after) == \
        (3, 0.5, True, None)
    off = TestSeams(False, {"LOCKSTEP_TEST_DROP_PLAN_SEQ": "3"})
    assert (off.drop_plan_seq, off.step_delay_s, off.hang_on_signal) == (None, 0.0, False)
    with pytest.raises(ConfigError, match="LOCKSTEP_TEST_STEP_DELAY_S"):
        TestSeams(True, {"LOCKSTEP_TEST_STEP_DELAY_S": "-1"})
    assert HostBlasSettings.load({"LOCKSTEP_OPENBLAS": "off"}).openblas is False
    assert HostBlasSettings.load({"LOCKSTEP_OPENBLAS": ""}).openblas is True  # empty = unset


def test_the_supervisor_cli_refuses_a_bad_flag_value_before_starting(tmp_path):
    p = subprocess.run([sys.executable, "-m", "services.supervisor", "--home", str(tmp_path),
                        "--peer-abort-grace", "-1"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "--peer-abort-grace / LOCKSTEP_PEER_ABORT_GRACE" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runtime").exists()  # nothing started
