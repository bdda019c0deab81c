"""Values, compared: an operator's output against its float64 reference, element
by element (NaN and Inf included), and the inputs that put the comparison to the
test: allocations poisoned with NaN, special values written into the samples.
``opforge check`` and ``opforge bench`` both judge an output by these."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.deterministic as det

from opforge.opspec import OpSpec, Sample

# Special values go into the small samples only: every layout, none of the
# large ones (whose cost would double the reference check for nothing new).
_SPECIAL_MAX_NUMEL = 4096


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``: itself, or those of a (nested) tuple or list, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    return []


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """While active, ``torch.empty`` (and ``at::empty`` inside our kernels) fill
    floating tensors with NaN, so unwritten output elements cannot pass."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


@dataclass
class ErrorStats:
    """How far an output is from the reference, over all its elements."""

    max_abs: float
    max_rel: float
    n_bad: int
    numel: int
    first_bad: tuple[int, ...] | None  # index of the first element out of tolerance
    got: float | None = None  # the values there
    want: float | None = None
    # Subnormal results given as zero (a fast-math kernel's flush), not counted in n_bad: outside strict mode
    # a flush is a note, not a failure.
    n_flushed: int = 0

    def worse(self, other: ErrorStats) -> ErrorStats:
        """The worst of both: largest errors, and the first mismatch of whichever has one."""
        first = self if self.first_bad is not None else other
        return ErrorStats(max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel), self.n_bad + other.n_bad,
                          self.numel + other.numel, first.first_bad, first.got, first.want,
                          self.n_flushed + other.n_flushed)  # fmt: skip


def _matches(o: torch.Tensor, r: torch.Tensor, r_out: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Where ``o`` (widened) matches ``r``: NaN for NaN, an Inf equal to ``r_out`` (``r``
    rounded to the output's dtype), a finite value within ``bound`` of a finite one.
    A finite bound for finite values only: |finite - Inf| <= rtol * Inf would pass."""
    same = (torch.isnan(o) & torch.isnan(r)) | (torch.isinf(o) & (o == r_out))
    return same | (torch.isfinite(o) & torch.isfinite(r) & ((o - r).abs() <= bound))


def measure_error(
    out: torch.Tensor,
    ref: torch.Tensor,
    atol: float,
    rtol: float,
    *,
    subnormals: bool = False,
    strict: bool = False,
    own: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> ErrorStats:
    """Errors of ``out`` against ``ref``; an element is bad past ``atol + rtol * |ref|``.
    NaN where the reference is NaN matches, and so does an Inf equal to the
    reference rounded to ``out``'s dtype (a float64 result past float16's range
    is float16's Inf, as in a kernel that rounds once); any other NaN or Inf, in
    either, is bad. A zero matches a zero of either sign: a sum's zero takes its
    sign from the order of its terms, and ``x + 0.0`` turns -0 into +0.

    With ``subnormals`` (the samples holding special values), where the
    reference rounded to ``out``'s dtype is subnormal, ``atol`` (larger than
    every subnormal of float32 and the half types) gives way to two of the
    dtype's smallest subnormals. Not in ordinary samples: a float16 matmul's sum
    of normal terms may land among the subnormals, with the error of the terms.
    There, and in ordinary samples where it is off (float16's subnormals lie
    above its absolute tolerance), a zero for a subnormal result (a kernel built
    with fast math flushes subnormals by design) is counted in ``n_flushed``,
    not ``n_bad``; with ``strict`` it is bad, and so is a zero of the other sign
    where the reference is an exact zero (in the samples holding special values).

    ``own``: the reference evaluated in the operator's own dtype; an element
    that matches it is not bad (eager torch in float32 overflows x1*c - x2*s near
    float32's largest value to inf - inf = NaN, where float64 gives +-Inf).

    ``scale``: the size of the terms behind each element (``magnitude_reference``),
    for the samples holding special values: a finite element within ``rtol``
    of it matches, since float64's own rounding of such terms moves the result
    that much whatever the order of operations.

    Complex outputs are compared in complex128 (the error is the modulus of the difference)."""
    if out.numel() == 0:
        return ErrorStats(0.0, 0.0, 0, 0, None)
    # On the output's device, with one read back: a benchmark case's output of 2^26 elements
    # copied to the host and compared there took seconds.
    wide = torch.complex128 if out.is_complex() or ref.is_complex() else torch.float64
    o = out.detach().to(wide)
    r = ref.detach().to(device=o.device, dtype=wide)
    r_out = ref.detach().to(device=o.device, dtype=out.dtype).to(wide) if out.is_floating_point() else r
    bound = atol + rtol * r.abs()
    wrong_sign = flushed = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
    if out.is_floating_point():
        fi = torch.finfo(out.dtype)
        subnormal = (r_out != 0) & (r_out.abs() < fi.tiny)
        flushed = subnormal & (o == 0)
        if subnormals:
            bound = torch.where(subnormal, torch.minimum(bound, rtol * r.abs() + 2 * fi.tiny * fi.eps), bound)
            if strict:
                wrong_sign = (o == 0) & (r == 0) & (torch.signbit(o) != torch.signbit(r))
    if scale is not None:
        bound = torch.maximum(bound, rtol * scale.detach().to(device=o.device, dtype=torch.float64))
    good = _matches(o, r, r_out, bound)
    if own is not None:
        w = own.detach().to(device=o.device, dtype=wide)
        rescued = ~good & _matches(o, w, w, atol + rtol * w.abs())
        good = good | rescued
    else:
        rescued = torch.zeros_like(good)
    err = torch.where((good & (torch.isnan(o) | torch.isinf(o))) | rescued, 0.0, (o - r).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    bad = wrong_sign | ~good
    if not strict:
        flushed = flushed & bad & ~wrong_sign
        bad = bad & ~flushed
    else:
        flushed = torch.zeros_like(flushed)
    rel = torch.where(err == 0, 0.0, err / r.abs().clamp_min(torch.finfo(torch.float64).tiny)).nan_to_num(nan=math.inf)
    max_abs, max_rel, n_bad, n_flushed = torch.stack(
        [err.max(), rel.max(), bad.sum().to(torch.float64), flushed.sum().to(torch.float64)]
    ).tolist()
    stats = ErrorStats(max_abs, max_rel, int(n_bad), o.numel(), None, n_flushed=int(n_flushed))
    if stats.n_bad:
        first = int(bad.flatten().nonzero()[0])
        stats.first_bad = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), o.shape)) if o.dim() else ()
        stats.got, stats.want = o.flatten()[first].item(), r.flatten()[first].item()
    return stats


def describe(e: ErrorStats, atol: float, rtol: float) -> str | None:
    """What ``measure_error`` found, in a line naming the first bad element and both values; None if nothing is bad."""
    if not e.n_bad:
        return None
    got, want = f"{e.got:.6g}", f"{e.want:.6g}"
    if got == want:  # off in a digit past the sixth (float64 rounded through float32): all of them
        got, want = f"{e.got:.17g}", f"{e.want:.17g}"
    return (
        f"{e.n_bad}/{e.numel} elements off (atol {atol:g}, rtol {rtol:g}): first at {list(e.first_bad or ())} "
        f"got {got} want {want}; max abs err {e.max_abs:.3g}, max rel err {e.max_rel:.3g}"
    )


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, *, subnormals: bool = False) -> str | None:
    """None when ``out`` matches ``ref`` within ``atol + rtol * |ref|`` (``measure_error``), else what differs."""
    if out.shape != ref.shape:
        return f"shape {list(out.shape)} != reference {list(ref.shape)}"
    return describe(measure_error(out, ref, atol, rtol, subnormals=subnormals), atol, rtol)


def difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How ``got`` differs from ``want``, which the same kernel computed (compiled,
    exported, eager): None where they are equal element for element, a NaN for a
    NaN included; else the shape, the dtype, or the first element that differs
    with both values. -0 equals +0 here (as in ``torch.equal``)."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, eager {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, eager {want.dtype}"
    if unchanged(want, got):
        return None
    differs = ~((got == want) | (got.isnan() & want.isnan())) if (got.is_floating_point() or got.is_complex()) else got != want
    n, first = int(differs.sum()), int(differs.flatten().nonzero()[0])
    where = [int(i) for i in torch.unravel_index(torch.tensor(first), got.shape)] if got.dim() else []
    return f"{n}/{got.numel()} elements differ: first at {where} got {got.flatten()[first].item()} want {want.flatten()[first].item()}"


def unchanged(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Equal element for element, a NaN where there was a NaN included (torch.equal says NaN != NaN)."""
    if torch.equal(before, after):
        return True
    if not (before.is_floating_point() or before.is_complex()) or before.shape != after.shape:
        return False
    return bool(((before == after) | (before.isnan() & after.isnan())).all())


def special_values(dtype: torch.dtype) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(values that may meet each other in one element: NaN, +-Inf, +-0;
    values that meet only ordinary ones: the smallest subnormal and one more,
    the largest finite values). A huge value beside an Inf or another huge value
    would test the order of a kernel's float32 operations (3 * max - 3 * max is
    NaN in float32, 0 in the float64 reference), not the kernel."""
    fi = torch.finfo(dtype)
    subnormal = fi.tiny * fi.eps
    return (math.nan, math.inf, -math.inf, 0.0, -0.0), (subnormal, -subnormal, fi.tiny / 2, fi.max, -fi.max)


def _copy_with_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides and storage offset: a transposed,
    strided or offset view stays one, and the kernel meets the same layout."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    base = torch.zeros(t.storage_offset() + span, dtype=t.dtype, device=t.device)
    return base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(t)


def with_special_values(spec: OpSpec, sample: Sample, dtype: torch.dtype, gen: torch.Generator) -> Sample | None:
    """A copy of ``sample`` with special values written into its floating inputs
    (each laid out as before; ``sample`` itself is left as it is), or None where
    there is nowhere to write them (no floating input, an empty or large one,
    or one whose elements share memory). Per element of inputs of one shape:
    half left as drawn; a quarter with one input (chosen at random) given any
    special value; a quarter with every input given NaN, +-Inf or +-0. Inputs
    of different shapes are treated each alone."""
    # Written arguments too: an in-place operator reads them (an out= one overwrites what is there).
    positions = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    originals = Sample(tuple(sample.args[i] for i in positions))
    if not positions or not small(originals, _SPECIAL_MAX_NUMEL) or self_overlapping(originals):
        return None
    args = list(sample.args)
    for i in positions:
        args[i] = _copy_with_layout(sample.args[i].detach())
    inputs = [args[i] for i in positions]
    device = inputs[0].device
    meeting, alone = (torch.tensor(v, dtype=torch.float64, device=device) for v in special_values(dtype))
    every = torch.cat([meeting, alone])
    groups = [inputs] if all(t.shape == inputs[0].shape for t in inputs) else [[t] for t in inputs]

    def pick(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return values[torch.randint(0, len(values), shape, generator=gen, device=device)].to(dtype)

    with torch.no_grad():
        for group in groups:
            shape = group[0].shape
            mode = torch.randint(0, 4, shape, generator=gen, device=device)
            chosen = torch.randint(0, len(group), shape, generator=gen, device=device)
            for k, t in enumerate(group):
                value = torch.where(mode == 3, pick(meeting, shape), pick(every, shape))
                t.copy_(torch.where((mode == 3) | ((mode == 2) & (chosen == k)), value, t))
    return Sample(tuple(args), sample.kwargs, f"{sample.desc}, special values")


def small(sample: Sample, limit: int) -> bool:
    """Every tensor argument has between 1 and ``limit`` elements."""
    ts = tensors(sample.args)
    return all(0 < t.numel() <= limit for t in ts)


def expanded(t: torch.Tensor) -> bool:
    """True if elements of ``t`` share memory: a dimension of more than one
    element with stride 0 (an expanded view)."""
    return any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape, strict=True))


def self_overlapping(sample: Sample) -> bool:
    """True if an input has elements sharing memory (an expanded view):
    gradcheck cannot perturb those one at a time."""
    return any(expanded(t) for t in tensors(sample.args))
