"""``python -m linearize.cli``."""

import sys

from . import main

sys.exit(main())
