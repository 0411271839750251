"""`lockstep reaper` entry point: settings precedence, --once output and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError, load_settings
from services.reaper.__main__ import ReaperSettings, main

pytestmark = pytest.mark.timeout(30)


def test_settings_cli_over_env_over_defaults(tmp_path: Path) -> None:
    assert load_settings(ReaperSettings, {}, env={}).reaper_interval == 10.0
    env = {"LOCKSTEP_REAPER_INTERVAL": "2.5", "LOCKSTEP_HOME": str(tmp_path),
           "LOCKSTEP_REAPER_EVENTS_PORT": "7714"}
    s = load_settings(ReaperSettings, {}, env=env)
    assert (s.reaper_interval, s.home, s.reaper_events_port) == (2.5, tmp_path, 7714)
    assert load_settings(ReaperSettings, {"reaper_interval": 0.5}, env=env).reaper_interval == 0.5
    with pytest.raises(ConfigError):
        load_settings(ReaperSettings, {"reaper_interval": 0.0}, env={})


def test_once_json_clean_pass(tmp_path: Path, capsys) -> None:
    assert main(["--home", str(tmp_path), "--once", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reaped"] == [] and report["blocking"] is False


def test_once_exit_status_when_blocked(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "runtime" / "manifests" / "x.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("[]")
    assert main(["--home", str(tmp_path), "--once"]) == 1
    assert f"UNREADABLE {bad}" in capsys.readouterr().out


def test_bad_settings_and_missing_key_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--home", str(tmp_path), "--once", "--interval", "-1"]) == 2
    # Publishing events needs the cluster key: fail closed, before any pass runs.
    assert main(["--home", str(tmp_path), "--events-port", "0"]) == 2
    assert not (tmp_path / "runtime").exists()
