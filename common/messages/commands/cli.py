"""How an Args field appears on the `lockstep admin` command line, said once beside the
field (`field(metadata=...)`); services/admin/cli.py builds the subcommands from it.
A field without such metadata is `--field-name VALUE` (a bool: a switch), of its type."""

from __future__ import annotations

from common.messages.vocab import Backend

POSITIONAL = {"cli": "positional"}  # a required argument: `stop ID`
OPTIONAL_POSITIONAL = {"cli": "positional?"}  # `abort-all [ID]`
HIDDEN = {"cli": None}  # not on the command line (the hosts file gives it, or HTTP only)
HOSTS_FILE = {"cli": "hosts-file"}  # `--hosts FILE`: its hosts (and envs, backend)
FLATTEN = {"cli": "flatten"}  # a nested record's fields as flags of their own
# the backends a deploy, replan or backend selection may ask for
BACKEND_CHOICES = tuple(b.value for b in Backend if b is not Backend.NONE)


def flag(name: str) -> dict[str, object]:
    """`--name` instead of the field's own name (`--model` for model_path)."""
    return {"cli": name}


def choices(values: tuple[str, ...], **more: object) -> dict[str, object]:
    return {"cli_choices": values, **more}
