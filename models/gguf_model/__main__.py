"""python -m models.gguf_model DIR --preset smollm2 | --from-gguf FILE | --fetch-only"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
