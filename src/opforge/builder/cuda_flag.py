"""``OPFORGE_BUILD_CUDA``, read in one place; a module of its own, below the build
configurations (``opforge.builder.config``), so that what explains a load failure
(``opforge.builder.symbols``) can read it without importing every build's definition."""

from __future__ import annotations

import os

from opforge.builder.errors import BuildError

_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def build_cuda_flag() -> bool | None:
    """``OPFORGE_BUILD_CUDA``, the one place it is read: True or False when set
    (1/0, true/false, yes/no, on/off, in any case), None when unset or empty.
    Any other value is a BuildError: a typo must not quietly mean "off"."""
    raw = os.environ.get("OPFORGE_BUILD_CUDA", "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _YES or value in _NO:
        return value in _YES
    raise BuildError(
        f"opforge: OPFORGE_BUILD_CUDA={raw!r} is neither on nor off: set it to 1 or 0 (or true/false, yes/no, on/off), "
        "or unset it for the default (CUDA kernels when torch has CUDA and nvcc is found)"
    )
