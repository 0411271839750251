"""The `lockstep` console script as a user runs it: every subcommand answers --help
under its own name, and `lockstep make-model DIR` builds a model mlx-lm loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.__main__ import COMMANDS
from tests.support.processes import REPO, lockstep_env

LOCKSTEP = [sys.executable, "-m", "services"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_answers_help(name):
    out = subprocess.run([*LOCKSTEP, name, "--help"], cwd=REPO, env=lockstep_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: "), out.stdout


@pytest.mark.timeout(180)
def test_make_model_builds_a_loadable_model(tmp_path):
    target = tmp_path / "m"
    out = subprocess.run([*LOCKSTEP, "make-model", str(target), "--seed", "3"], cwd=REPO,
                         env=lockstep_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert (target / "model.safetensors.index.json").is_file()
    load = subprocess.run(
        [sys.executable, "-c", "import sys; from mlx_lm import load; "
         "m, t = load(sys.argv[1]); print(len(t.encode('hello world')) > 0)", str(target)],
        cwd=REPO, env=lockstep_env(), capture_output=True, text=True, timeout=120)
    assert load.returncode == 0 and load.stdout.strip() == "True", load.stderr


@pytest.mark.timeout(60)
def test_an_unknown_subcommand_is_a_usage_error():
    out = subprocess.run([*LOCKSTEP, "frobnicate"], cwd=REPO, env=lockstep_env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr
