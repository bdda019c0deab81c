"""The two consoles everything opforge prints goes through: ``out`` for
results (stdout), ``err`` for progress and errors (stderr)."""

from __future__ import annotations

import shutil
import sys

from rich.console import Console

# Tables are wide: when output is piped (CI logs), rich would assume 80 columns.
WIDTH = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
out = Console(width=WIDTH, soft_wrap=True)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, soft_wrap=True)

__all__ = ["WIDTH", "err", "out"]
