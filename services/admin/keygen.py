"""`lockstep keygen [--home DIR] [--force]` — create the cluster key, mode 0600."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.home import default_home
from common.keys import KeyFileError, generate_key_file


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lockstep keygen", description=__doc__)
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="replace an existing key")
    args = ap.parse_args(argv)
    home = (args.home or default_home()).expanduser()
    path = home / "keys" / "cluster.key"
    try:
        generate_key_file(path, overwrite=args.force)
    except KeyFileError as exc:
        print(f"lockstep keygen: {exc}")
        return 1
    print(f"wrote {path} (mode 0600)")
    return 0
