"""``python -m opforge.abi FILE...``: the same as ``opforge abi``."""

import sys

from opforge.cli.abi import main

sys.exit(main())
