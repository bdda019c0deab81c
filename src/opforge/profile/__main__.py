"""``python -m opforge.profile --run-case OP CASE DTYPE``: the runner ``opforge profile`` starts under ncu."""

import sys

from opforge.cli.profile import runner_main

sys.exit(runner_main())
