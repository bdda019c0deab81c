"""``python -m opforge.doctor [--json]``: the same as ``opforge doctor``."""

import sys

from opforge.cli.doctor import main

sys.exit(main())
