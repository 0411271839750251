"""python -m common.tinymodel DIR [--preset tiny|bench] [--seed N] [--force]"""

import sys

from .build import main

sys.exit(main())
