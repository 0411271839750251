"""`python -m services.hostagent` (see the package doc)."""

import sys

from services.hostagent import main

sys.exit(main())
