"""`--model` / `model_path` as a Hugging Face repo id resolved offline in the local HF
cache (a fake cache layout in a tmp HF_HOME), its id, and the deploy plan using it."""

from __future__ import annotations

import shutil

import pytest

from common import model_ref
from models.tinymodel import build_model
from services.supervisor.errors import AdminError
from services.supervisor.plan import make_plan

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """HF_HOME with the embedded model cached as acme/tiny-chat (refs/main → snapshot)."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--acme--tiny-chat"
    snap = repo / "snapshots" / REV
    shutil.copytree(build_model(tmp_path / "tiny", preset="tiny"), snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))  # read at import
    return snap


def test_a_repo_id_resolves_in_the_local_cache(hf_cache):
    p = model_ref.resolve("acme/tiny-chat")
    assert p == hf_cache.resolve()
    assert model_ref.model_id(p) == "acme/tiny-chat" and model_ref.owner("acme/tiny-chat") == "acme"


def test_a_directory_is_itself(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    assert model_ref.resolve(str(d)) == d.resolve()
    assert model_ref.model_id(d) == "my-model" and model_ref.owner("my-model") == "lockstep"


@pytest.mark.parametrize("ref", ["acme/not-cached", "no/such/thing", "/nowhere/at/all"])
def test_an_unknown_model_is_refused_by_name(hf_cache, ref):
    with pytest.raises(model_ref.ModelNotFound, match=ref):
        model_ref.resolve(ref)


def test_a_deploy_plan_takes_a_repo_id(hf_cache):
    plan = make_plan("acme/tiny-chat", 1, 1, None, "auto")
    assert plan.model_path == str(hf_cache.resolve())
    with pytest.raises(AdminError, match="not in the local Hugging Face cache"):
        make_plan("acme/other", 1, 1, None, "auto")
