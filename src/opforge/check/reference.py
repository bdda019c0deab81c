"""The reference check of ``opforge check``: each sample through the operator
and through the spec's reference in float64 (``run_reference``), compared by
``opforge.check.values``; what the comparison allows (the reference's dtype,
the reference in the operator's own dtype, signed zeros, flushed subnormals)
is said in ``check_reference`` and ``run_reference``."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from opforge.check.steps import CheckResult, KernelError, dtype_name, first_line, generator, map_tensors, sample_label, settle, step
from opforge.check.values import (
    ErrorStats,
    describe,
    measure_error,
    poisoned_allocations,
    tensors,
    unchanged,
    with_special_values,
)
from opforge.opspec import OpSpec, Sample, SpecError, exact_dtype


def to_reference(a: Any, device: torch.device | str | None = None) -> Any:
    """An argument as the float64 reference takes it: floating tensors in
    float64 (complex ones in complex128); integer and bool tensors (indices,
    masks, counts) keep their dtype; on ``device`` where given. Always a copy:
    a reference that writes into an argument (an in-place or out= operator's)
    must not write into the operator's own."""
    if isinstance(a, (list, tuple)):  # a Tensor[] argument
        return type(a)(to_reference(x, device) for x in a)
    if not isinstance(a, torch.Tensor):
        return a
    a = a.detach()
    dtype = torch.float64 if a.is_floating_point() else torch.complex128 if a.is_complex() else a.dtype
    return a.to(device=device or a.device, dtype=dtype, copy=True)


def expected_dtype(ref: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype an output must have, from the reference's (``ref``, computed in
    float64 from floating inputs) and the sample's ``dtype``: a floating or
    complex result in the sample's precision (its real or complex counterpart
    where the reference's kind differs: abs of a complex, an FFT of a real); an
    integer or bool result (indices, counts, masks) in the reference's own dtype."""
    if ref.is_floating_point() and (dtype.is_floating_point or dtype.is_complex):
        return dtype.to_real() if dtype.is_complex else dtype
    if ref.is_complex() and (dtype.is_floating_point or dtype.is_complex):
        return dtype.to_complex() if dtype.is_floating_point else dtype
    return ref.dtype


def copy_argument(a: Any) -> Any:
    """A copy of an argument: a tensor cloned (detached), a Tensor[] one element by element, anything else as it is."""
    if isinstance(a, (list, tuple)):
        return type(a)(copy_argument(x) for x in a)
    return a.detach().clone() if isinstance(a, torch.Tensor) else a


def rerun_reference(
    spec: OpSpec, sample: Sample, inputs_before: Sequence[torch.Tensor | None], drawn: dict[int, Any], convert: Callable[[Any], Any]
) -> list[torch.Tensor] | None:
    """The reference run again on the sample's arguments as drawn (``inputs_before``:
    the inputs' copies; ``drawn``: the written arguments'), each passed through
    ``convert``: its outputs followed by what it wrote, as ``run_reference`` pairs
    them; None where the reference does not run on them."""
    pairs = enumerate(zip(sample.args, inputs_before, strict=True))
    args = [convert(before if before is not None else drawn.get(i, a)) for i, (a, before) in pairs]
    kwargs = {k: convert(v) for k, v in sample.kwargs.items()}
    try:
        with torch.no_grad():
            out = spec.reference(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a reference for float64 only, or for signed inputs only: the usual tolerance then
        return None
    returned = tensors(out) if spec.returns_tensor else []  # an in-place reference may return what it wrote into
    return returned + [args[i] for i in spec.mutated_args]


def own_dtype_reference(
    spec: OpSpec, sample: Sample, inputs_before: Sequence[torch.Tensor | None], drawn: dict[int, Any]
) -> list[torch.Tensor] | None:
    """The reference run on the sample's arguments in their own dtypes (``rerun_reference``)."""
    return rerun_reference(spec, sample, inputs_before, drawn, copy_argument)


def magnitude_reference(
    spec: OpSpec, sample: Sample, inputs_before: Sequence[torch.Tensor | None], drawn: dict[int, Any], device: torch.device | str | None
) -> list[torch.Tensor] | None:
    """The float64 reference run on the magnitudes of the sample's floating
    inputs (NaN and Inf as 0), paired as ``run_reference`` pairs outputs: the
    size of the terms behind each output element. Where a largest finite value
    meets ordinary ones in one output (a sum over a segment holding +max, -max
    and 0.4), the order of additions alone moves an exact float64 result by a
    share of that size: the tolerance there scales with it. None where the
    reference does not run on them."""

    def magnitude(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(magnitude(x) for x in a)
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return torch.where(a.isfinite(), a.abs(), 0.0)
        return a

    def size(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() or t.is_complex():
            return t.abs().to(torch.float64).nan_to_num(nan=0.0)
        return torch.zeros(t.shape, dtype=torch.float64, device=t.device)  # integer and bool outputs are exact

    outs = rerun_reference(spec, sample, inputs_before, drawn, lambda a: magnitude(to_reference(a, device)))
    return None if outs is None else [size(t) for t in outs]


def argument_name(spec: OpSpec, i: int) -> str:
    args = spec.schema.arguments
    return args[i].name if i < len(args) else f"#{i}"


def unmarked_write_message(spec: OpSpec, positions: Sequence[int]) -> str:
    """What is wrong when the operator writes into the arguments at ``positions``, which its schema does not mark, and the fix."""
    args = spec.schema.arguments
    names = [argument_name(spec, i) for i in positions]
    used = {s for a in args if a.alias_info is not None for s in a.alias_info.before_set}
    letters = iter(c for c in string.ascii_lowercase if c not in used)
    declared = []
    for i, name in zip(positions, names, strict=True):
        kind = str(args[i].type) if i < len(args) else "Tensor"
        suffix = "[]" if kind.startswith("List") else "?" if kind.startswith("Optional") else ""
        declared.append(f"`Tensor({next(letters)}!){suffix} {name}`")
    them = "it" if len(names) == 1 else "them"
    listed = " and ".join(names)
    return (
        f"writes into argument{'s' if len(names) > 1 else ''} {listed}, which its schema does not mark as written: "
        f"if writing {them} is the operator's job, declare {them} {', '.join(declared)} in its schema (now: {spec.schema}); "
        f"if not, the kernel overwrites an input it must only read"
    )


def run_reference(
    spec: OpSpec,
    sample: Sample,
    dtype: torch.dtype,
    errors: list[ErrorStats] | None = None,
    reference_device: torch.device | str | None = None,
    *,
    special: bool = False,
) -> str | None:
    """Runs one sample through the operator and the float64 reference; None if
    they agree. ``errors`` (if given) receives each output's ErrorStats;
    ``special``: the sample holds special values (subnormal results are then
    compared without the absolute tolerance, ``measure_error``). The
    reference runs on the sample's device unless ``reference_device`` says
    otherwise (the sanitizer runs put it on the CPU: its report is then about
    the operator's kernels, not about PyTorch's own kernels computing the
    reference, whose multi-block reductions initcheck flags)."""
    op = spec.overload
    mutated = spec.mutated_args
    args = list(sample.args)
    # Written arguments keep the values drawn: an in-place operator reads them, and
    # an out= one that writes nothing leaves values the reference's cannot match.
    inputs_before = [a.clone() if isinstance(a, torch.Tensor) and i not in mutated else None for i, a in enumerate(args)]

    ref_args = [to_reference(a, reference_device) for a in args]
    ref_kwargs = {k: to_reference(v, reference_device) for k, v in sample.kwargs.items()}
    ref_before = [to_reference(a) if inputs_before[i] is not None else None for i, a in enumerate(ref_args)]
    try:
        expected = spec.reference(*ref_args, **ref_kwargs)
    except Exception as exc:
        raise ReferenceRaised(first_line(exc)) from exc
    ref_written = [i for i, before in enumerate(ref_before) if before is not None and not unchanged(before, ref_args[i])]
    if ref_written:
        names = " and ".join(argument_name(spec, i) for i in ref_written)
        return (
            f"the reference writes into {names}, which the schema does not mark as written: the reference must leave "
            "its inputs as they are (compute into a new tensor, or clone first)"
        )
    # The first tensor argument's device (an optional first argument may be None, a Tensor[] one a list).
    device = tensors(args)[0].device
    # The values drawn into written arguments, for the reference in the operator's own dtype (on a mismatch only).
    drawn = {i: copy_argument(args[i]) for i in mutated}
    with poisoned_allocations():
        got = op(*args, **sample.kwargs)
    settle(device)

    expected_tensors = tensors(expected)
    if not spec.returns_tensor and mutated:
        # An in-place reference may return what it wrote into (x.add_(1)): the written argument is compared anyway.
        written_refs = [ref_args[i] for i in mutated]
        if all(any(t is w for w in written_refs) for t in expected_tensors):
            expected_tensors = []
        else:
            names = " and ".join(argument_name(spec, i) for i in mutated)
            return (
                f"the reference returned {len(expected_tensors)} new tensor{'s' if len(expected_tensors) != 1 else ''} but the "
                f"schema returns nothing ({spec.schema}): the operator's result is what it writes into {names}, so the reference "
                f"must write it there too (as x.add_(1) or out.copy_(...) do) and return None or that argument"
            )
    if len(tensors(got)) != len(expected_tensors):
        return f"returned {len(tensors(got))} tensors, reference {len(expected_tensors)}"
    pairs = list(zip(tensors(got), expected_tensors, strict=False))
    pairs += [(args[i], ref_args[i]) for i in mutated]
    n_out = len(expected_tensors)
    strict = spec.special_values == "strict"
    for k, (o, r) in enumerate(pairs):
        want_dtype = expected_dtype(r, dtype)
        if o.dtype != want_dtype:
            what = f"output {k}" if k < n_out else f"written argument {argument_name(spec, mutated[k - n_out])}"
            whose = "" if want_dtype == dtype else " (the reference's)"
            return f"{what} has dtype {o.dtype}, expected {want_dtype}{whose}"
        if o.device != device:
            return f"output {k} is on {o.device}, expected {device}"
    tols = [(0.0, 0.0) if exact_dtype(o.dtype) else spec.tolerance(dtype, sample) for o, _ in pairs]

    def measure(k: int, own: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> ErrorStats | None:
        (o, r), (atol, rtol) = pairs[k], tols[k]
        if o.shape != r.shape:
            return None
        own = own if own is not None and own.shape == o.shape else None
        scale = scale if scale is not None and scale.shape == o.shape else None
        return measure_error(o, r, atol, rtol, subnormals=special, strict=strict, own=own, scale=scale)

    stats = [measure(k) for k in range(len(pairs))]
    own: list[torch.Tensor] | None = None
    if any(e is not None and e.n_bad for e in stats):
        # Past the float64 reference: what eager torch gives in the operator's own dtype is not a failure.
        own = own_dtype_reference(spec, sample, inputs_before, drawn)
        own = own if own is not None and len(own) == len(pairs) else None
        if own is not None:
            stats = [measure(k, own[k]) if e is not None and e.n_bad else e for k, e in enumerate(stats)]
    if special and any(e is not None and e.n_bad for e in stats):
        scales = magnitude_reference(spec, sample, inputs_before, drawn, reference_device)
        if scales is not None and len(scales) == len(pairs):
            stats = [
                measure(k, own[k] if own is not None else None, scales[k]) if e is not None and e.n_bad else e for k, e in enumerate(stats)
            ]
    problems = []
    for k, e in enumerate(stats):
        if errors is not None and e is not None:
            errors.append(e)
        problem = describe(e, *tols[k]) if e is not None else f"shape {list(pairs[k][0].shape)} != reference {list(pairs[k][1].shape)}"
        if problem:
            problems.append(f"{f'output {k}' if k < n_out else f'written argument {argument_name(spec, mutated[k - n_out])}'}: {problem}")
    if problems:
        return "; ".join(problems)
    written = [i for i, before in enumerate(inputs_before) if before is not None and not unchanged(before, args[i])]
    if written:
        return unmarked_write_message(spec, written)
    return None


def reference_cases(spec: OpSpec, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[tuple[Sample, bool]]:
    """What the reference check runs in one dtype: (sample, False) for each of the
    spec's samples, each followed by (its copy with special values, True) where
    ``with_special_values`` gives one and the spec does not opt out."""
    for sample in spec.samples(device, dtype, gen):
        # Drawn before the plain run, which might write into an input.
        special = with_special_values(spec, sample, dtype, gen) if spec.special_values else None
        yield sample, False
        if special is not None:
            yield special, True


def contiguous_written(spec: OpSpec, sample: Sample) -> tuple[Sample, str] | None:
    """For a sample derived from the schema (``opforge.spec`` without
    ``samples=``) whose written arguments are not all contiguous (a transposed
    out=): the sample with those made contiguous, and what they were ("out with
    strides [1, 33]"). None for any other sample: a spec's own samples are
    what its operator must take."""
    if "samples" not in spec.derived:
        return None
    args, what = list(sample.args), []
    for i in spec.mutated_args:
        a = args[i]
        if isinstance(a, torch.Tensor) and not a.is_contiguous():
            what.append(f"{argument_name(spec, i)} with strides {list(a.stride())} ({sample.desc.split(',')[0]})")
            args[i] = a.contiguous()
    if not what:
        return None
    return Sample(tuple(args), sample.kwargs, f"{sample.desc}, written contiguous"), " and ".join(what)


def refusals_noted(res: CheckResult, refused: dict[str, str]) -> CheckResult:
    """The layouts the operator refused, in the result's note and tag."""
    if refused:
        res.tag = f"{len(refused)} layout{'s' if len(refused) > 1 else ''} refused"
        res.note = "; ".join(f"refuses {what}: {why}; checked with it contiguous instead" for what, why in refused.items())
    return res


def check_reference(
    spec: OpSpec, device: torch.device, seed: int, seeds: int = 1, reference_device: torch.device | str | None = None
) -> CheckResult:
    """Every sample in every dtype, with ``seeds`` fresh draws each (seed, seed+1, ...),
    then the small ones with special values (``with_special_values``) unless the
    spec opts out; ``worst`` keeps the largest error per case ("dtype [layout]")
    across them. A special-values case enters ``worst`` only with a mismatch:
    beside a largest finite value, an ordinary one's exact sum is off by an
    absolute error of its own size, which says nothing about precision."""
    res = CheckResult(spec.name, "reference", "pass")
    refused: dict[str, str] = {}
    flushed: dict[torch.dtype, int] = {}  # subnormal results given as zero, per dtype
    undefined: dict[str, str] = {}  # derived samples the operator and its reference both refuse, and why

    def attempt(sample: Sample, dtype: torch.dtype, errors: list[ErrorStats], special: bool) -> str | None:
        step(spec, "reference", sample_label(spec, dtype, sample))
        try:
            return run_reference(spec, sample, dtype, errors, reference_device, special=special)
        except KernelError as exc:
            return str(exc)

    def run(sample: Sample, dtype: torch.dtype, k: int, special: bool) -> None:
        res.count += 1
        errors: list[ErrorStats] = []
        try:
            try:
                problem = attempt(sample, dtype, errors, special)
            except Exception as exc:
                retry = contiguous_written(spec, sample)
                if retry is None:
                    raise
                errors.clear()
                problem = attempt(retry[0], dtype, errors, special)
                refused.setdefault(retry[1], first_line(exc.__cause__ or exc))
        except ReferenceRaised as exc:
            # A sample derived from the schema that the operator refuses as its reference does (an argmax of
            # no elements) lies outside what the operator defines: said under the table, not a failure.
            problem = str(exc)
            if "samples" in spec.derived and refuses(spec, sample, dtype):
                undefined.setdefault(f"{dtype_name(dtype)} [{sample.desc}]", str(exc))
                problem = None
        except Exception as exc:  # noqa: BLE001 - report, keep checking
            problem = first_line(exc)
        case = f"{str(dtype).removeprefix('torch.')} [{sample.desc}]"
        flushed[dtype] = flushed.get(dtype, 0) + sum(e.n_flushed for e in errors)
        for e in errors:
            if not special or e.n_bad:
                res.worst[case] = res.worst[case].worse(e) if case in res.worst else e
        if problem:
            res.failures.append(f"{sample_label(spec, dtype, sample)} (seed {seed + k}): {problem}")

    try:
        for k in range(seeds):
            gen = generator(device, seed + k)
            for dtype in spec.dtypes:
                for sample, special in reference_cases(spec, device, dtype, gen):
                    run(sample, dtype, k, special)
    except SpecError as exc:  # samples= yields what is not a Sample
        res.failures.append(str(exc))
    refusals_noted(res.close(), refused)
    notes = [res.note]
    if any(flushed.values()):
        counts = ", ".join(f"{dtype_name(d)} {n} element{'s' if n > 1 else ''}" for d, n in flushed.items() if n)
        notes.append(
            f"flushes subnormal results to zero ({counts}): allowed, as a fast-math build does; "
            'special_values="strict" in the spec makes it a failure'
        )
    if undefined:
        first, why = next(iter(undefined.items()))
        more = f" and {len(undefined) - 1} more" if len(undefined) > 1 else ""
        notes.append(f"samples the operator and its reference both refuse, left out: {first}{more} ({why})")
    res.note = "; ".join(filter(None, notes))
    return res


class ReferenceRaised(Exception):
    """The spec's reference raised on a sample (the message: its error, in a line)."""


def refuses(spec: OpSpec, sample: Sample, dtype: torch.dtype) -> bool:
    """Whether the operator raises on ``sample`` (its own copy of it)."""
    step(spec, "reference", f"{sample_label(spec, dtype, sample)}: does the operator take it?")
    try:
        spec.overload(*map_tensors(sample.args, torch.clone), **sample.kwargs)
        settle(tensors(sample.args)[0].device)
    except KernelError:
        return False
    except Exception:  # noqa: BLE001 - the answer
        return True
    return False
