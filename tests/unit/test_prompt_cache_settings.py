"""The prefix cache's two settings, from flag or variable to every rank's spec: one name
at every hop, 0 bytes (auto) resolved once by the supervisor, never left for a rank."""

from __future__ import annotations

import psutil
import pytest

from common.config import ConfigError, load_settings
from common.rankspec import PROMPT_CACHE_AUTO_MAX, RankSettings, RankSpec, auto_prompt_cache_bytes
from services.supervisor import settings as sup_settings
from services.supervisor.__main__ import _parser as supervisor_parser
from services.supervisor.job_launch import rank_settings
from services.up.__main__ import _parser as up_parser
from services.up.settings import UpSettings

GIB = 1 << 30


def test_auto_is_the_smaller_of_4_gib_and_an_eighth_of_memory():
    assert auto_prompt_cache_bytes(8 * GIB) == GIB
    assert auto_prompt_cache_bytes(16 * GIB) == 2 * GIB
    assert auto_prompt_cache_bytes(64 * GIB) == PROMPT_CACHE_AUTO_MAX == 4 * GIB
    assert auto_prompt_cache_bytes(1000) == 125


def test_the_supervisor_resolves_auto_and_hands_every_rank_the_same_numbers():
    auto = rank_settings(sup_settings.load(env={}))
    assert auto.prompt_cache_entries == 32
    assert auto.prompt_cache_bytes == auto_prompt_cache_bytes(psutil.virtual_memory().total) > 0
    s = sup_settings.load(env={"LOCKSTEP_PROMPT_CACHE_ENTRIES": "0",
                               "LOCKSTEP_PROMPT_CACHE_BYTES": "12345"})
    r = rank_settings(s)
    assert (r.prompt_cache_entries, r.prompt_cache_bytes) == (0, 12345)
    cli = sup_settings.load(cli={"prompt_cache_bytes": 777}, env={"LOCKSTEP_PROMPT_CACHE_BYTES": "5"})
    assert rank_settings(cli).prompt_cache_bytes == 777  # CLI > variable
    assert rank_settings(s) == rank_settings(s)  # every rank of a launch: one value


def test_the_spec_carries_them(tmp_path):
    spec = RankSpec(1, "d", "j", 0, 1, 1, 1, "h", "/m", "none", str(tmp_path), "s", "c", "r",
                    "p", "q", 1, settings=RankSettings(prompt_cache_entries=4,
                                                       prompt_cache_bytes=1 << 20))
    spec.save(tmp_path / "spec.json")
    back = RankSpec.load(tmp_path / "spec.json").settings
    assert (back.prompt_cache_entries, back.prompt_cache_bytes) == (4, 1 << 20)


@pytest.mark.parametrize("var", ["LOCKSTEP_PROMPT_CACHE_ENTRIES", "LOCKSTEP_PROMPT_CACHE_BYTES"])
def test_a_negative_value_is_refused_naming_it(var):
    with pytest.raises(ConfigError, match=var):
        sup_settings.load(env={var: "-1"})


def test_the_flags_of_supervisor_and_up():
    ns = vars(supervisor_parser().parse_args(["--prompt-cache-entries", "3",
                                              "--prompt-cache-bytes", "4096"]))
    s = sup_settings.load(cli={k: v for k, v in ns.items() if k != "log_level"}, env={})
    assert (s.prompt_cache_entries, s.prompt_cache_bytes) == (3, 4096)
    up = load_settings(UpSettings, vars(up_parser().parse_args(
        ["--prompt-cache-entries", "0", "--prompt-cache-bytes", "9"])), env={})
    assert (up.prompt_cache_entries, up.prompt_cache_bytes) == (0, 9)
