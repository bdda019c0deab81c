"""opforge: custom C++/CUDA operators as first-class PyTorch operators.

Importing opforge loads its compiled op library into ``torch.ops.opforge``,
building it on first use (JIT, cached under ``~/.cache/opforge`` or
``OPFORGE_CACHE_DIR``), registers each operator's fake kernel and autograd
formula from its spec, and exposes a public function per operator:
``opforge.add``, ``opforge.square``, ``opforge.axpby``, ``opforge.sigmoid``, ...
"""

from __future__ import annotations

from opforge.build import library_config, load_library
from opforge.spec import all_specs, register_module

__version__ = "0.1.0"

#: The loaded op library: its path, cache key and whether CUDA kernels are in it.
library = load_library(library_config())

for _spec in register_module("opforge.ops"):
    globals()[_spec.name] = _spec.function

from opforge import nn  # noqa: E402 - needs the operators above

__all__ = ["all_specs", "library", "nn", *(_s.name for _s in all_specs())]
