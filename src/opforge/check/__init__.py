"""``opforge check``: every check a spec drives (reference, opcheck, gradients,
torch.compile, bad inputs, sharding), one operator at a time. The names here are
the ones a package's own tests use (``opforge new`` writes such tests)."""

from opforge.check.export import check_export
from opforge.check.grad import check_compile, check_gradcheck, check_gradgradcheck
from opforge.check.run import (
    CHECKS,
    check_bad_inputs,
    check_op,
    check_opcheck,
    check_reference,
    reference_cases,
    run_reference,
)
from opforge.check.sharding import check_sharding
from opforge.check.steps import CheckResult, generator
from opforge.check.values import measure_error

__all__ = [
    "CHECKS",
    "CheckResult",
    "check_bad_inputs",
    "check_compile",
    "check_export",
    "check_gradcheck",
    "check_gradgradcheck",
    "check_op",
    "check_opcheck",
    "check_reference",
    "check_sharding",
    "generator",
    "measure_error",
    "reference_cases",
    "run_reference",
]
