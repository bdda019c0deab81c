"""``opforge check``: does each operator compute what its spec says, and is it
registered so that autograd, fake tensors and torch.compile work?

Checks per operator, all read from its spec:

* reference: every sample, every dtype, fresh random data; outputs allocated by
  the operator are poisoned (NaN) before the run, so an element the kernel never
  writes is a mismatch; the reference gets its own copy of every argument, and
  each argument the schema marks written (in-place or out=) keeps its drawn
  values, so that an in-place kernel reads them and one that writes nothing
  leaves values the reference's do not match; NaN/Inf where the reference is
  finite count as mismatches; inputs must come back unchanged, the reference's
  too (one that writes into its input is named as the culprit). Then (unless
  the spec says ``special_values=False``) the small samples again with NaN,
  +-Inf, +-0, subnormals and the dtype's largest finite values written into
  their inputs: NaN must stay NaN where the reference gives NaN, an Inf must
  be the reference's, rounded to the output's dtype; a subnormal result
  flushed to zero is a note, and a zero of either sign matches a zero, unless
  the spec says ``special_values="strict"``. Each output has the reference's
  dtype (an integer or bool one compared exactly); an element off against the
  float64 reference but equal to the reference run in the operator's own dtype
  (what eager torch gives there) is not a failure;
* opcheck: ``torch.library.opcheck`` with its four test utils (an operator
  without a fake kernel fails opcheck, compile and export with one line that
  says how to register one);
* gradcheck, gradgradcheck: ``torch.autograd.gradcheck`` and ``gradgradcheck``
  (differentiable ops only), in float64, or in float32 for an operator whose
  spec does not take float64; and compile: ``torch.compile(fullgraph=True)``
  equal to eager, backward included (``check_grad``);
* bad inputs: each listed bad call raises the listed error, naming the op.

Before them, one call says whether the operator writes into an argument that
its schema does not mark as written: then that is the one failure reported,
with the fix, and the other checks wait for it. Each call of the operator is a
step (``check_steps``): named before it runs, and on CUDA waited for and
checked for a kernel's error after it. A derived sample whose written argument
the operator refuses to take in its layout (a transposed out=) is reported as
a layout it refuses, and checked with that argument contiguous instead.

How outputs are compared, and the special values written into inputs, are in
``check_values``.
"""

from __future__ import annotations

import functools
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opforge.check.export import check_export
from opforge.check.grad import check_compile, check_gradcheck, check_gradgradcheck
from opforge.check.reference import (
    check_reference,
    contiguous_written,
    copy_argument,
    reference_cases,
    refusals_noted,
    run_reference,
    to_reference,
    unmarked_write_message,
)
from opforge.check.sharding import check_sharding
from opforge.check.steps import (
    CheckResult,
    KernelError,
    fake_call,
    first_line,
    generator,
    missing_fake,
    sample_label,
    settle,
    step,
    with_grad,
)
from opforge.check.values import (
    ErrorStats,
    compare,
    measure_error,
    poisoned_allocations,
    small,
    tensors,
    unchanged,
    with_special_values,
)
from opforge.opspec import OpSpec, Sample, SpecError

CHECKS: tuple[str, ...] = ("reference", "opcheck", "gradcheck", "gradgradcheck", "compile", "export", "bad inputs", "sharding")

# opcheck runs each sample through several dispatch modes: a few layouts
# already cover what it tests (schema, fake, autograd registration).
_OPCHECK_MAX_NUMEL = 4096


def check_opcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """``torch.library.opcheck`` with its four test utils: schema, autograd registration, fake tensor, AOT dispatch."""
    res = CheckResult(spec.name, "opcheck", "pass")
    refused: dict[str, str] = {}
    gen = generator(device, seed)

    def opcheck(sample: Sample) -> None:
        run_opcheck(spec, sample)
        settle(device)

    for dtype in spec.dtypes:
        samples = [s for s in spec.samples(device, dtype, gen) if small(s, _OPCHECK_MAX_NUMEL)]
        if dtype != torch.float32:
            samples = samples[:2]  # every layout in float32; the dtypes once or twice each
        if samples and res.count == 0:
            step(spec, "opcheck", f"{sample_label(spec, dtype, samples[0])}: on fake tensors")
            if missing := missing_fake(spec, samples[0], "opcheck"):
                return CheckResult(spec.name, "opcheck", "fail", count=1, failures=[missing], tag="no fake kernel")
        for sample in samples:
            if spec.differentiable:
                sample = with_grad(spec, sample)
            res.count += 1
            label = sample_label(spec, dtype, sample)
            step(spec, "opcheck", label)
            try:
                try:
                    opcheck(sample)
                except Exception as exc:
                    retry = contiguous_written(spec, sample)
                    if retry is None:
                        raise
                    opcheck(retry[0])
                    refused.setdefault(retry[1], first_line(exc.__cause__ or exc))
            except Exception as exc:  # noqa: BLE001
                # opcheck's message has its cause in it already; there is no stack trace above to scroll up to.
                res.failures.append(f"{label}: {first_line(exc).removesuffix(' (scroll up for stack trace)')}")
    return refusals_noted(res.close(), refused)


_OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def run_opcheck(spec: OpSpec, sample: Sample) -> None:
    """``torch.library.opcheck`` of one sample. Its AOT dispatch test compares
    outputs with ``assert_close``, for which NaN differs from NaN: an operator
    whose outputs hold NaN by design (log of a negative number) fails it. There
    that test runs again, with NaN equal to NaN."""
    try:
        torch.library.opcheck(spec.overload, sample.args, dict(sample.kwargs))
    except Exception as exc:
        if "test_aot_dispatch_dynamic" not in str(exc) or not outputs_hold_nan(spec, sample):
            raise
        torch.library.opcheck(spec.overload, sample.args, dict(sample.kwargs), test_utils=_OPCHECK_UTILS[:3])
        # lazy: torch.testing's internals, as opcheck imports them (only where an output holds NaN)
        from torch.testing._internal.optests import aot_autograd_check

        def call(*args: Any, **kwargs: Any) -> Any:  # on copies: the check runs it several times
            return spec.overload(*copy_argument(args), **{k: copy_argument(v) for k, v in kwargs.items()})

        equal_nan = functools.partial(torch.testing.assert_close, equal_nan=True)
        try:
            aot_autograd_check(call, sample.args, dict(sample.kwargs), True, assert_equals_fn=equal_nan, check_gradients="auto")
        except Exception as again:
            raise RuntimeError(f"opcheck(op, ...): test_aot_dispatch_dynamic failed with {first_line(again)}") from again


def outputs_hold_nan(spec: OpSpec, sample: Sample) -> bool:
    """Whether the operator's outputs for ``sample`` (called on a copy) hold a NaN."""
    with torch.no_grad():
        out = spec.overload(*copy_argument(sample.args), **{k: copy_argument(v) for k, v in sample.kwargs.items()})
    return any(t.isnan().any() for t in tensors(out) if t.is_floating_point() or t.is_complex())


def _expect_refusal(call: Callable[[], Any], bad: Any, where: str) -> str | None:
    """None when ``call`` raises ``bad.error`` with the expected words, else what went wrong."""
    try:
        call()
    except bad.error as exc:
        if not re.search(bad.match, str(exc)):
            return f"{where}message {str(exc).splitlines()[0]!r} does not match {bad.match!r}"
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{where}raised {first_line(exc)}, expected {bad.error.__name__}"
    return f"{where}did not raise"


def check_bad_inputs(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """Each bad input is refused by the kernel and, unless it is a rule about
    values, by the fake kernel too, in the same words: an eager call and a
    torch.compile trace then fail alike."""
    bad_inputs = list(spec.bad_inputs(device))
    if not bad_inputs:
        return CheckResult(spec.name, "bad inputs", "n/a", note="none declared")
    res = CheckResult(spec.name, "bad inputs", "pass")
    has_fake = torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "Meta")
    for bad in bad_inputs:
        res.count += 1
        step(spec, "bad inputs", f"{spec.name} [{bad.desc}]")
        failure = _expect_refusal(lambda b=bad: spec.overload(*b.args, **b.kwargs), bad, "")
        try:
            settle(device)
        except KernelError as exc:
            failure = failure or str(exc)
        if failure is None and has_fake and bad.traced:
            failure = _expect_refusal(lambda b=bad: fake_call(spec, b.args, dict(b.kwargs)), bad, "under the fake kernel: ")
        if failure is not None:
            res.failures.append(f"{spec.name} [{bad.desc}]: {failure}")
    if not has_fake:
        res.note = "no fake kernel: checked eagerly only"
    return res.close()


CHECK_FUNCTIONS: dict[str, Callable[[OpSpec, torch.device, int], CheckResult]] = {
    "reference": check_reference,
    "opcheck": check_opcheck,
    "gradcheck": check_gradcheck,
    "gradgradcheck": check_gradgradcheck,
    "compile": check_compile,
    "export": check_export,
    "bad inputs": check_bad_inputs,
    "sharding": check_sharding,
}


def unmarked_writes(spec: OpSpec, device: torch.device, seed: int, check: str = "reference") -> list[int]:
    """Positions of the tensor arguments that one call of the operator (its
    first sample that holds elements) writes into although its schema does not
    mark them as written. [] where the call raises: the checks say why; but a
    CUDA error the call leaves (KernelError) is raised, with the sample named."""
    dtype = torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0]
    samples = spec.samples(device, dtype, generator(device, seed))
    sample = next((s for s in samples if tensors(s.args) and all(t.numel() > 0 for t in tensors(s.args))), None)
    if sample is None:
        return []
    mutated = set(spec.mutated_args)
    before = {i: [t.clone() for t in tensors(a)] for i, a in enumerate(sample.args) if i not in mutated and tensors(a)}
    label = sample_label(spec, dtype, sample)
    step(spec, check, f"{label}: does it write an argument its schema does not mark?")
    try:
        spec.overload(*sample.args, **sample.kwargs)
        settle(device)
    except KernelError as exc:
        raise KernelError(f"{label}: {exc}") from None
    except Exception:  # noqa: BLE001
        return []
    return [i for i, ts in before.items() if not all(unchanged(b, a) for b, a in zip(ts, tensors(sample.args[i]), strict=True))]


def check_op(
    spec: OpSpec,
    device: torch.device,
    seed: int,
    checks: Sequence[str] = CHECKS,
    seeds: int = 1,
    reference_device: torch.device | str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """The checks of one operator, in order (``on_result`` is called with each
    as it ends). An operator that writes into an argument its schema does not
    mark fails the first check with that, once, and the rest are not run: each
    would fail for it (an input modified, opcheck's schema test, a compiled
    graph that assumes the argument unchanged)."""
    results: list[CheckResult] = []

    def add(result: CheckResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    checks = list(checks)
    try:
        written = unmarked_writes(spec, device, seed, checks[0]) if checks else []
    except KernelError as exc:  # its first call: the first check's failure, whose own run would meet it first
        add(CheckResult(spec.name, checks[0], "fail", count=1, failures=[str(exc)]))
        checks, written = checks[1:], []
    except SpecError as exc:  # samples= yields what is not a Sample: every check would fail for it
        first, *rest = checks
        add(CheckResult(spec.name, first, "fail", count=1, failures=[str(exc)], tag="spec"))
        for name in rest:
            add(CheckResult(spec.name, name, "n/a", note="not run: its spec's samples= must yield Samples first"))
        return results
    except Exception:  # noqa: BLE001 - samples that cannot be drawn: the checks say so
        written = []
    if written:
        first, *rest = checks
        add(CheckResult(spec.name, first, "fail", count=1, failures=[f"{spec.qualname} {unmarked_write_message(spec, written)}"],
                        tag="schema"))  # fmt: skip
        for name in rest:
            add(CheckResult(spec.name, name, "n/a", note="not run: its schema must mark what it writes first"))
        return results
    for name in checks:
        try:
            if name == "reference":
                add(check_reference(spec, device, seed, seeds, reference_device))
            else:
                add(CHECK_FUNCTIONS[name](spec, device, seed))
        except SpecError as exc:  # the spec's fault, said in its own line
            add(CheckResult(spec.name, name, "fail", failures=[str(exc)], tag="spec"))
        except Exception:  # noqa: BLE001 - a crash in one check must not hide the others
            add(CheckResult(spec.name, name, "fail", failures=[traceback.format_exc(limit=3)]))
    return results


__all__ = [
    "CHECKS",
    "CHECK_FUNCTIONS",
    "CheckResult",
    "ErrorStats",
    "check_bad_inputs",
    "check_compile",
    "check_gradcheck",
    "check_gradgradcheck",
    "check_op",
    "check_opcheck",
    "check_reference",
    "compare",
    "contiguous_written",
    "fake_call",
    "generator",
    "measure_error",
    "poisoned_allocations",
    "reference_cases",
    "run_reference",
    "to_reference",
    "unmarked_write_message",
    "unmarked_writes",
    "with_special_values",
]
