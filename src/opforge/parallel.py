"""The import path ``opforge.parallel`` of earlier releases: ``from opforge.parallel import
ColwiseParallel, RowwiseParallel`` keeps working. The styles are in ``opforge.tensor_parallel``."""

from __future__ import annotations

from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

__all__ = ["ColwiseParallel", "RowwiseParallel"]
