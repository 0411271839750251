"""`--speculative` (issue 46): a closed set of values, and only with deterministic mode
(a verify step emits plain decoding's tokens only with the batch-invariant pass)."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load_settings
from common.messages import Speculation
from common.rankspec import RankSettings
from services.supervisor.settings import load
from services.up.__main__ import main as up_main


def test_the_supervisor_takes_ngram_and_refuses_it_without_determinism():
    assert load({"speculative": "ngram"}, env={}).speculative is Speculation.NGRAM
    assert load({}, env={}).speculative is Speculation.OFF
    with pytest.raises(ConfigError, match="--speculative ngram needs --deterministic"):
        load({"speculative": "ngram", "deterministic": False}, env={})


def test_a_value_outside_the_set_names_the_set():
    with pytest.raises(ConfigError, match="LOCKSTEP_SPECULATIVE='draft' is not one of off, ngram"):
        load_settings(RankSettings, env={"LOCKSTEP_SPECULATIVE": "draft"})


def test_up_refuses_it_before_starting_anything(capsys):
    assert up_main(["--speculative", "ngram", "--no-deterministic"]) == 2
    assert "needs --deterministic" in capsys.readouterr().err
