"""`lockstep` — one console script, one subcommand per service or tool."""

from __future__ import annotations

import importlib
import sys

# subcommand → (module with a `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.up.__main__", "start supervisor, reaper and gateway, deploy, serve"),
    "gateway": ("services.gateway.__main__", "the OpenAI-compatible HTTP gateway"),
    "supervisor": ("services.supervisor.__main__", "the deployment supervisor"),
    "reaper": ("services.reaper.__main__", "reap orphaned launches (--once for one pass)"),
    "admin": ("services.admin.cli", "talk to the supervisor's admin socket"),
    "keygen": ("services.admin.keygen", "create the cluster key (0600)"),
    "make-model": ("models.gguf_model.cli", "build a model: random presets or SmolLM2 from its GGUF"),
    "rank": ("services.rank.__main__", "one MLX rank (started by the supervisor only)"),
    "hostagent": ("services.hostagent", "process and file operations on this host, as JSON (run over ssh)"),
}


def usage() -> str:
    lines = ["usage: lockstep COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lockstep: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
