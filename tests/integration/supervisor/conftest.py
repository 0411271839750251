from __future__ import annotations

import pytest

from tests.support.fake_model import fake_model_dir
from tests.support.supervisor import RunningSupervisor, fake_settings


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def model_dir(tmp_path):
    return fake_model_dir(tmp_path / "fake-model")


@pytest.fixture
def start_supervisor(home):
    """start_supervisor(**settings) -> RunningSupervisor; every one is closed (with a
    verified teardown of what is left) at the end of the test."""
    running: list[RunningSupervisor] = []

    def start(seams=None, rank_env=None, **kw) -> RunningSupervisor:
        rs = RunningSupervisor(fake_settings(home, **kw), seams=seams, rank_env=rank_env)
        running.append(rs)
        return rs

    yield start
    for rs in running:
        rs.close()
