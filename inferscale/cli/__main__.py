"""``python -m inferscale.cli``: the command line."""

import sys

from inferscale.cli import main

sys.exit(main())
