"""Entry point of the ``opforge`` command.

It lives outside the package so that it can defer the op library's build:
importing ``opforge`` builds and loads it, and ``opforge doctor`` must still run
(and explain) when that build fails. Commands that need the library load it.
"""

import os


def main() -> int:
    os.environ.setdefault("OPFORGE_NO_AUTOLOAD", "1")
    # lazy: import time (importing opforge builds and loads the op library unless OPFORGE_NO_AUTOLOAD is set first)
    from opforge.cli import main as cli_main

    return cli_main()
