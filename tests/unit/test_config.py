"""Settings: CLI > environment (LOCKSTEP_*) > defaults, with errors naming the variable."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from common.config import ConfigError, load_settings
from common.home import default_home


@dataclass(frozen=True)
class Demo:
    port: int = 8000
    ratio: float = 0.5
    verbose: bool = False
    name: str = "lockstep"
    home: Path = Path("/var/lib/lockstep")
    hosts: tuple[str, ...] = ()
    limit: int | None = None


@dataclass(frozen=True)
class Required:
    endpoint: str
    retries: int = 3


def test_defaults_when_nothing_is_set():
    assert load_settings(Demo, env={}) == Demo()


def test_env_overrides_default():
    env = {"LOCKSTEP_PORT": "9000", "LOCKSTEP_RATIO": "0.25", "LOCKSTEP_VERBOSE": "yes",
           "LOCKSTEP_NAME": "x", "LOCKSTEP_HOME": "/tmp/h", "LOCKSTEP_HOSTS": "a, b,,c",
           "LOCKSTEP_LIMIT": "7"}
    s = load_settings(Demo, env=env)
    assert s == Demo(9000, 0.25, True, "x", Path("/tmp/h"), ("a", "b", "c"), 7)


def test_cli_overrides_env_and_default():
    env = {"LOCKSTEP_PORT": "9000", "LOCKSTEP_NAME": "from-env"}
    s = load_settings(Demo, {"port": 9100, "ratio": 0.75}, env=env)
    assert (s.port, s.ratio, s.name, s.verbose) == (9100, 0.75, "from-env", False)


def test_cli_none_falls_through_to_env_then_default():
    s = load_settings(Demo, {"port": None, "name": None}, env={"LOCKSTEP_PORT": "9000"})
    assert (s.port, s.name) == (9000, "lockstep")


def test_unrelated_and_differently_cased_env_is_ignored():
    s = load_settings(Demo, env={"LOCKSTEP_port": "1", "PORT": "2", "LOCKSTEP_PORTS": "3"})
    assert s.port == 8000


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_PORT", "8123")
    assert load_settings(Demo).port == 8123


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("TRUE", True), (" on ", True),
                                            ("0", False), ("no", False), ("Off", False)])
def test_bool_spellings(raw, value):
    assert load_settings(Demo, env={"LOCKSTEP_VERBOSE": raw}).verbose is value


@pytest.mark.parametrize(
    ("var", "raw"),
    [("LOCKSTEP_PORT", "eighty"), ("LOCKSTEP_PORT", "1.5"), ("LOCKSTEP_PORT", ""),
     ("LOCKSTEP_RATIO", "half"), ("LOCKSTEP_VERBOSE", "maybe"), ("LOCKSTEP_LIMIT", "x")],
)
def test_bad_env_value_names_the_variable(var, raw):
    with pytest.raises(ConfigError) as info:
        load_settings(Demo, env={var: raw})
    assert var in str(info.value) and repr(raw) in str(info.value)
    assert "<class" not in str(info.value)


def test_bad_env_value_is_a_value_error_too():
    with pytest.raises(ValueError):
        load_settings(Demo, env={"LOCKSTEP_PORT": "x"})


def test_optional_empty_means_none():
    assert load_settings(Demo, env={"LOCKSTEP_LIMIT": ""}).limit is None


def test_path_expands_user(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert load_settings(Demo, env={"LOCKSTEP_HOME": "~/ls"}).home == Path("/home/someone/ls")


def test_unknown_cli_setting_is_refused():
    with pytest.raises(ConfigError, match="unknown setting colour"):
        load_settings(Demo, {"colour": "red"}, env={})


def test_required_field_from_env_or_cli():
    assert load_settings(Required, env={"LOCKSTEP_ENDPOINT": "tcp://e"}).endpoint == "tcp://e"
    assert load_settings(Required, {"endpoint": "tcp://c"},
                         env={"LOCKSTEP_ENDPOINT": "tcp://e"}).endpoint == "tcp://c"
    with pytest.raises(ConfigError, match="LOCKSTEP_ENDPOINT"):
        load_settings(Required, env={})


def test_unsupported_type_is_a_config_error():
    @dataclass
    class Odd:
        items: list[str]

    with pytest.raises(ConfigError, match="items"):
        load_settings(Odd, env={"LOCKSTEP_ITEMS": "a,b"})


def test_default_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.delenv("LOCKSTEP_HOME", raising=False)
    assert default_home() == Path("/home/someone/.lockstep")
    monkeypatch.setenv("LOCKSTEP_HOME", "~/elsewhere")
    assert default_home() == Path("/home/someone/elsewhere")


def test_an_overlay_sets_only_the_named_fields_over_a_base():
    base = Demo(port=9000, ratio=0.1)
    s = load_settings(Demo, env={"LOCKSTEP_PORT": "1", "LOCKSTEP_RATIO": "0.9"}, base=base,
                      only=("ratio",))
    assert (s.port, s.ratio) == (9000, 0.9)


def test_blank_is_unset_only_when_asked():
    assert load_settings(Demo, env={"LOCKSTEP_PORT": " "}, blank_is_unset=True).port == 8000
    with pytest.raises(ConfigError, match="LOCKSTEP_PORT"):
        load_settings(Demo, env={"LOCKSTEP_PORT": " "})
