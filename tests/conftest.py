"""Suite-wide settings. Hypothesis runs derandomized and without its example database, so
`make test` draws the same examples on every machine and every run (a failure prints
its reproduction blob). HYPOTHESIS_PROFILE=explore draws new examples each run."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))
