"""The import path ``opforge.spec`` of earlier releases: ``from opforge.spec import OpSpec, Sample,
register_module`` (as packages made by ``opforge new`` then do) keeps working.

``opforge.spec`` itself is the function that derives a spec (``opforge.derive.spec``); ``import
opforge`` enters this module in ``sys.modules`` under that dotted path. The types are in
``opforge.opspec``, the registry's functions in ``opforge.registry``: new code imports from those.
"""

from __future__ import annotations

from opforge.opspec import (
    DEFAULT_TOLERANCES,
    FLOAT_DTYPES,
    BadInput,
    Baseline,
    CheckedSamples,
    Cost,
    OpSpec,
    Sample,
    SampleFn,
    SpecError,
    as_dtype,
    as_dtypes,
    check_tolerance,
    default_tolerance,
    exact_dtype,
    owner_has_autograd,
)
from opforge.registry import all_specs, get_specs, register, register_module, replace_registered

__all__ = [
    "DEFAULT_TOLERANCES",
    "FLOAT_DTYPES",
    "BadInput",
    "Baseline",
    "CheckedSamples",
    "Cost",
    "OpSpec",
    "Sample",
    "SampleFn",
    "SpecError",
    "all_specs",
    "as_dtype",
    "as_dtypes",
    "check_tolerance",
    "default_tolerance",
    "exact_dtype",
    "get_specs",
    "owner_has_autograd",
    "register",
    "register_module",
    "replace_registered",
]
