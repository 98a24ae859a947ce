"""``python -m ddtree_lab.cli``: the command line."""

import sys

from . import main

sys.exit(main())
