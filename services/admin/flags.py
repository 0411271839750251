"""An admin command's Args as command-line flags, and back: each field is spelled once,
in its Args (common/messages/commands/<command>.py), with how it appears on the command
line in its metadata (common/messages/commands/cli.py). Only what is given is set; the
rest takes the Args' defaults."""

from __future__ import annotations

import argparse
import enum
import types
import typing
from pathlib import Path
from typing import Any

from common.messages.commands import fields_of
from common.messages.commands.cli import Cli

SUPPRESS = argparse.SUPPRESS
HOSTS_DEST = "hosts_file"
_SCALAR = {int: int, float: float, str: str}


def _unwrap(tp: Any) -> Any:
    """X | None -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return tp


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_one(p: argparse.ArgumentParser, dest: str, flag: str, tp: Any, default: Any,
             meta: dict) -> None:
    kw: dict[str, Any] = {"dest": dest, "default": SUPPRESS}
    if tp is not bool and "." in dest:  # a flattened field: --top-p TOP_P
        kw["metavar"] = dest.rsplit(".", 1)[1].upper()
    if tp is bool:
        if default is True:  # `--no-wait`
            p.add_argument("--no-" + flag[2:], action="store_false", **kw)
        else:
            p.add_argument(flag, action="store_true", **kw)
        return
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        p.add_argument(flag, action="append", type=_SCALAR[item], **kw)
        return
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        kw["choices"] = [e.value for e in tp]
    else:
        kw["type"] = _SCALAR[tp]
    if "cli_choices" in meta:
        kw["choices"] = list(meta["cli_choices"])
    p.add_argument(flag, required=bool(meta.get("required")), **kw)


def add_fields(p: argparse.ArgumentParser, args_cls: type) -> None:
    """One argument per field of `args_cls`, as its metadata says."""
    hints = typing.get_type_hints(args_cls)
    for f in fields_of(args_cls):
        meta = dict(f.metadata)
        cli = meta.get("cli", _dashed(f.name))
        tp = _unwrap(hints[f.name])
        if cli is None:
            continue
        if cli is Cli.POSITIONAL:
            p.add_argument(f.name)
        elif cli is Cli.OPTIONAL_POSITIONAL:
            p.add_argument(f.name, nargs="?", default=SUPPRESS)
        elif cli is Cli.HOSTS_FILE:
            p.add_argument("--hosts", dest=HOSTS_DEST, metavar="FILE", default=SUPPRESS,
                           required=bool(meta.get("required")))
        elif cli is Cli.FLATTEN:  # e.g. sampling: --temperature, --top-p, ...
            inner = typing.get_type_hints(tp)
            for g in fields_of(tp):
                _add_one(p, f"{f.name}.{g.name}", _dashed(g.name), _unwrap(inner[g.name]),
                         g.default, dict(g.metadata))
        else:
            default = None if f.default is f.default_factory else f.default
            _add_one(p, f.name, str(cli), tp, default, meta)


def args_from(ns: argparse.Namespace, args_cls: type) -> Any:
    """The Args instance the parsed command line says (ValueError: a bad hosts file)."""
    given = vars(ns)
    hints = typing.get_type_hints(args_cls)
    names = {f.name for f in fields_of(args_cls)}
    out: dict[str, Any] = {}
    if HOSTS_DEST in given:
        out.update(_hosts(given[HOSTS_DEST], names))
    for f in fields_of(args_cls):
        if f.metadata.get("cli") is Cli.FLATTEN:
            nested = {k.split(".", 1)[1]: v for k, v in given.items()
                      if k.startswith(f.name + ".")}
            if nested:
                out[f.name] = _unwrap(hints[f.name])(**nested)
        elif f.name in given:
            tp = _unwrap(hints[f.name])
            enum_typed = isinstance(tp, type) and issubclass(tp, enum.Enum)
            out[f.name] = tp(given[f.name]) if enum_typed else given[f.name]
    return args_cls(**out)


def _hosts(path: str, names: set[str]) -> dict[str, Any]:
    """A hosts file's hosts, and its envs and backend where the command takes them (a
    flag given as well wins)."""
    from services.supervisor.hosts import HostsError, read_hosts_file

    try:
        doc = read_hosts_file(Path(path))
    except HostsError as exc:
        raise ValueError(str(exc)) from None
    out: dict[str, Any] = {"hosts": doc.hosts}
    if doc.envs and "envs" in names:
        out["envs"] = doc.envs
    if doc.backend and "backend" in names:
        out["backend"] = doc.backend.value
    return out
