"""How an Args field appears on the `lockstep admin` command line, said once beside the
field (`field(metadata=...)`); services/admin/cli.py builds the subcommands from it.
A field without such metadata is `--field-name VALUE` (a bool: a switch), of its type."""

from __future__ import annotations

import enum

from common.messages.vocab import Backend


class Cli(enum.Enum):
    """How a field appears, when not as `--field-name VALUE` (or a flag name given)."""

    POSITIONAL = enum.auto()  # a required argument: `stop ID`
    OPTIONAL_POSITIONAL = enum.auto()  # `abort-all [ID]`
    HOSTS_FILE = enum.auto()  # `--hosts FILE`: its hosts (and envs, backend)
    FLATTEN = enum.auto()  # a nested record's fields as flags of their own


POSITIONAL = {"cli": Cli.POSITIONAL}
OPTIONAL_POSITIONAL = {"cli": Cli.OPTIONAL_POSITIONAL}
HIDDEN = {"cli": None}  # not on the command line (the hosts file gives it, or HTTP only)
HOSTS_FILE = {"cli": Cli.HOSTS_FILE}
FLATTEN = {"cli": Cli.FLATTEN}
# the backends a deploy, replan or backend selection may ask for
BACKEND_CHOICES = tuple(b.value for b in Backend if b is not Backend.NONE)


def flag(name: str) -> dict[str, object]:
    """`--name` instead of the field's own name (`--model` for model_path)."""
    return {"cli": name}


def choices(values: tuple[str, ...], **more: object) -> dict[str, object]:
    return {"cli_choices": values, **more}
