"""python -m models.tinymodel DIR [--preset tiny|bench] [--seed N] [--force]"""

import sys

from .build import main

if __name__ == "__main__":
    sys.exit(main())
