"""The eager fast path (csrc/opforge/fast_python.cpp): the op library is also a
Python module whose ``fast_op(qualname)`` returns a callable that runs an
operator's kernel without torch.ops's generic argument parsing and without the
Python autograd kernel, when no gradient is needed. It returns NotImplemented
when it may not (a tensor needs a gradient, a tensor subclass, keyword
arguments, a __torch_function__ mode): the public function then takes the full
path. ``OPFORGE_FAST=0`` turns it off."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

_module: types.ModuleType | None = None


def attach(library: Path) -> types.ModuleType | None:
    """Imports the op library (already loaded into torch.ops) as the fast-path
    module; None for a library built without it (CMake) or when disabled."""
    global _module
    if os.environ.get("OPFORGE_FAST", "1") == "0":
        return None
    # The module's name is the file's: TORCH_EXTENSION_NAME, as the build named it.
    name = library.name.split(".", 1)[0]
    full = f"opforge.{name}" if name == "_C" else name
    spec = importlib.util.spec_from_file_location(full, library)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    sys.modules[full] = module
    _module = module
    return module


class Context:
    """The ``ctx`` of a fast-path call that records a gradient: what a spec's
    setup_context and backward use of torch's (save_for_backward,
    saved_tensors, needs_input_grad, attributes)."""

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors


def fast_op(qualname: str) -> Callable[..., Any] | None:
    """The fast-path callable for ``ns::name``, or None (no fast module, or an
    operator it cannot call: one that writes an argument, or takes or returns
    types other than tensors, floats, ints and bools)."""
    if _module is None:
        return None
    return _module.fast_op(qualname)


__all__ = ["attach", "fast_op"]
