"""opforge: custom C++/CUDA operators as first-class PyTorch operators.

Importing opforge loads its compiled op library into ``torch.ops.opforge``:
the one ``pip install`` built (``opforge._C``) when it fits this torch, these
sources and these GPUs, else a JIT build on first use (cached under
``~/.cache/opforge`` or ``OPFORGE_CACHE_DIR``); ``OPFORGE_LIBRARY=jit|prebuilt``
forces one, and ``OPFORGE_LIBRARY=<path>`` loads a build of another route (CMake's
``build/libopforge_ops.so``) instead; registers each operator's fake kernel and autograd
formula from its spec, and exposes a public function per operator:
``opforge.add``, ``opforge.square``, ``opforge.axpby``, ``opforge.sigmoid``, ...

``OPFORGE_NO_AUTOLOAD=1`` defers that to an explicit ``opforge.load()``: the
``opforge`` command sets it, so ``opforge doctor`` still runs when a build fails.

``opforge.spec(op, reference=...)`` describes an operator someone already has
in ``torch.ops``, for ``opforge check|bench FILE.py``: the rest of its spec is
derived from the schema (``opforge.derive``). A spec's types (``OpSpec``,
``Sample``, ...) are in ``opforge.opspec``; ``opforge.registry`` wires specs.
"""

from __future__ import annotations

import os
import sys

from opforge import fast as _fast
from opforge import spec_path as _spec_path
from opforge.builder.jit import Library
from opforge.builder.prebuilt import load_library_file as load_library
from opforge.builder.prebuilt import load_op_library
from opforge.derive import spec
from opforge.registry import all_specs, register, register_module

# `opforge.spec` is the function above. The import path `opforge.spec` of earlier releases (and of
# packages that `opforge new` made then: `from opforge.spec import OpSpec, register_module`) names
# opforge.spec_path, which hands on opforge.opspec's and opforge.registry's names. Python finds a
# dotted path in sys.modules before it looks for a file, and then leaves the attribute as it is.
sys.modules[f"{__name__}.spec"] = _spec_path

__version__ = "0.1.0"

#: The loaded op library (path, cache key, CUDA or not); None until load().
library: Library | None = None


def load(*, wait_fast: bool = False) -> Library:
    """Builds (first use) and loads the op library, registers the specs and
    their public functions. Idempotent. The eager fast path's module attaches
    when built (in the background the first time); ``wait_fast`` waits for it
    first, so that out= operators also get its C++ autograd kernel rather than
    the Python one (what the opforge command does)."""
    global library
    if library is None:
        # Beside the op library's build only with 8 cores or more (the library compiles at most 8 files
        # at once): on two cores the two builds slow each other down (benchmarks/README.md, build times).
        side_by_side = (os.cpu_count() or 1) >= 8
        if side_by_side:
            _fast.build_in_background()
        lib = load_op_library()
        if not side_by_side:
            _fast.build_in_background()
        _fast.attach(wait=wait_fast)
        for spec in register_module("opforge.ops"):
            globals()[spec.name] = spec.function
        library = lib
    elif wait_fast:  # loaded at import, its background build maybe still running
        _fast.attach(wait=True)
    return library


if os.environ.get("OPFORGE_NO_AUTOLOAD") != "1":
    load()

from opforge import nn  # noqa: E402 - after the operators, which its modules call

__all__ = ["all_specs", "library", "load", "load_library", "nn", "register", "spec", *(_s.name for _s in all_specs())]
