"""``python -m opforge``: the same as the ``opforge`` command."""

import sys

from opforge.cli import main

sys.exit(main())
