"""``opforge check``: does each operator compute what its spec says, and is it
registered so that autograd, fake tensors and torch.compile work?

Checks per operator, all read from its spec:

* reference: every sample, every dtype, fresh random data; outputs allocated by
  the operator are poisoned (NaN) before the run and out= arguments filled with
  NaN, so an element the kernel never writes is a mismatch; NaN/Inf where the
  reference is finite count as mismatches; inputs must come back unchanged.
  Then (unless the spec says ``special_values=False``) the small samples again
  with NaN, +-Inf, +-0, subnormals and the dtype's largest finite values
  written into their inputs: NaN must stay NaN where the reference gives NaN,
  and an Inf must be the reference's, rounded to the output's dtype;
* opcheck: ``torch.library.opcheck`` with its four test utils;
* gradcheck: float64 ``torch.autograd.gradcheck`` (differentiable ops only):
  the whole Jacobian, element by element, on the sample with the fewest
  input elements; on every other sample (layouts: transposed, strided,
  offset) gradcheck's fast mode, which compares the Jacobian's product with
  random vectors, one backward and two forwards per sample instead of one per
  element (lltm's six samples on two cores: 1 s instead of 40);
  the spec's ``jvp`` (forward-mode AD) against the same numerical Jacobian
  where it has one;
* gradgradcheck: float64 ``torch.autograd.gradgradcheck`` (differentiable ops
  whose spec does not say ``double_backward=False``): the backward's own
  derivative, on two samples only (it is the dearest check per sample): the
  smallest whole, and the first non-contiguous one in fast mode;
* compile: ``torch.compile(fullgraph=True)`` equal to eager, backward included;
* bad inputs: each listed bad call raises the listed error, naming the op.
"""

from __future__ import annotations

import contextlib
import math
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from opforge.spec import OpSpec, Sample

CHECKS: tuple[str, ...] = ("reference", "opcheck", "gradcheck", "gradgradcheck", "compile", "bad inputs")

# gradcheck's numerical Jacobian costs one forward per input element.
_GRADCHECK_MAX_NUMEL = 1100
# opcheck runs each sample through several dispatch modes: a few layouts
# already cover what it tests (schema, fake, autograd registration).
_OPCHECK_MAX_NUMEL = 4096
# Special values go into the small samples only: every layout, none of the
# large ones (whose cost would double the reference check for nothing new).
_SPECIAL_MAX_NUMEL = 4096


@dataclass
class CheckResult:
    op: str
    check: str
    status: str  # "pass", "fail" or "n/a"
    count: int = 0
    failures: list[str] = field(default_factory=list)
    note: str = ""
    worst: dict[str, ErrorStats] = field(default_factory=dict)  # reference check: per case

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _map_tensors(args: Sequence[Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    return tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args)


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """While active, ``torch.empty`` (and ``at::empty`` inside our kernels) fill
    floating tensors with NaN, so unwritten output elements cannot pass."""
    import torch.utils.deterministic as det

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

    def worse(self, other: ErrorStats) -> ErrorStats:
        """The worst of both: largest errors, and the first mismatch of whichever has one."""
        first = self if self.first_bad is not None else other
        return ErrorStats(max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel), self.n_bad + other.n_bad,
                          self.numel + other.numel, first.first_bad, first.got, first.want)  # fmt: skip


def measure_error(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> ErrorStats:
    """Errors of ``out`` against ``ref``; an element is bad past ``atol + rtol * |ref|``.
    NaN where the reference is NaN matches, and so does an Inf equal to the
    reference rounded to ``out``'s dtype (a float64 result past float16's range
    is float16's Inf, as in a kernel that rounds once); any other NaN or Inf, in
    either, is bad."""
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if o.numel() == 0:
        return ErrorStats(0.0, 0.0, 0, 0, None)
    r_out = ref.detach().cpu().to(out.dtype).to(torch.float64) if out.is_floating_point() else r
    same = (torch.isnan(o) & torch.isnan(r)) | (torch.isinf(o) & (o == r_out))
    err = torch.where(same, 0.0, (o - r).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    # A finite bound for finite values only: |finite - Inf| <= rtol * Inf would pass.
    bad = ~(same | (torch.isfinite(o) & torch.isfinite(r) & (err <= atol + rtol * r.abs())))
    rel = torch.where(err == 0, 0.0, err / r.abs().clamp_min(torch.finfo(torch.float64).tiny)).nan_to_num(nan=math.inf)
    stats = ErrorStats(float(err.max()), float(rel.max()), int(bad.sum()), o.numel(), None)
    if stats.n_bad:
        first = int(bad.flatten().nonzero()[0])
        stats.first_bad = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), o.shape)) if o.dim() else ()
        stats.got, stats.want = o.flatten()[first].item(), r.flatten()[first].item()
    return stats


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None when ``out`` matches ``ref`` within ``atol + rtol * |ref|``, else what differs."""
    if out.shape != ref.shape:
        return f"shape {list(out.shape)} != reference {list(ref.shape)}"
    e = measure_error(out, ref, atol, rtol)
    if not e.n_bad:
        return None
    got, want = f"{e.got:.6g}", f"{e.want:.6g}"
    if got == want:  # off in a digit past the sixth (float64 rounded through float32): all of them
        got, want = f"{e.got:.17g}", f"{e.want:.17g}"
    return (
        f"{e.n_bad}/{e.numel} elements off (atol {atol:g}, rtol {rtol:g}): first at {list(e.first_bad or ())} "
        f"got {got} want {want}; max abs err {e.max_abs:.3g}, max rel err {e.max_rel:.3g}"
    )


def run_reference(
    spec: OpSpec,
    sample: Sample,
    dtype: torch.dtype,
    errors: list[ErrorStats] | None = None,
    reference_device: torch.device | str | None = None,
) -> str | None:
    """Runs one sample through the operator and the float64 reference; None if
    they agree. ``errors`` (if given) receives each output's ErrorStats. The
    reference runs on the sample's device unless ``reference_device`` says
    otherwise (the sanitizer runs put it on the CPU: its report is then about
    the operator's kernels, not about PyTorch's own kernels computing the
    reference, whose multi-block reductions initcheck flags)."""
    op = spec.overload
    mutated = spec.mutated_args
    args = list(sample.args)
    for i in mutated:
        args[i].fill_(float("nan"))
    inputs_before = [a.clone() if isinstance(a, torch.Tensor) and i not in mutated else None for i, a in enumerate(args)]

    def to_ref(a: Any) -> Any:
        if isinstance(a, (list, tuple)):  # a Tensor[] argument
            return type(a)(to_ref(x) for x in a)
        if not isinstance(a, torch.Tensor):
            return a
        return a.detach().to(device=reference_device or a.device, dtype=torch.float64)

    ref_args = [to_ref(a) for a in args]
    expected = spec.reference(*ref_args, **{k: to_ref(v) for k, v in sample.kwargs.items()})
    with poisoned_allocations():
        got = op(*args, **sample.kwargs)

    pairs = list(zip(_tensors(got), _tensors(expected), strict=False))
    if len(_tensors(got)) != len(_tensors(expected)):
        return f"returned {len(_tensors(got))} tensors, reference {len(_tensors(expected))}"
    pairs += [(args[i], ref_args[i]) for i in mutated]
    atol, rtol = spec.tolerance(dtype, sample)
    # The first tensor argument's device (an optional first argument may be None, a Tensor[] one a list).
    device = _tensors(args)[0].device
    problems = []
    for k, (o, r) in enumerate(pairs):
        if o.dtype != dtype:
            return f"output {k} has dtype {o.dtype}, expected {dtype}"
        if o.device != device:
            return f"output {k} is on {o.device}, expected {device}"
        if errors is not None and o.shape == r.shape:
            errors.append(measure_error(o, r, atol, rtol))
        problem = compare(o, r, atol, rtol)
        if problem:
            problems.append(f"output {k}: {problem}")
    if problems:
        return "; ".join(problems)
    for i, before in enumerate(inputs_before):
        if before is not None and not _unchanged(before, args[i]):
            return f"input {i} was modified by the operator"
    return None


def _unchanged(before: torch.Tensor, after: torch.Tensor) -> bool:
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
    mutated = set(spec.mutated_args)
    positions = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.is_floating_point() and i not in mutated]
    originals = Sample(tuple(sample.args[i] for i in positions))
    if not positions or not _small(originals, _SPECIAL_MAX_NUMEL) or _self_overlapping(originals):
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


def _sample_label(spec: OpSpec, dtype: torch.dtype, sample: Sample) -> str:
    return f"{spec.name} {str(dtype).removeprefix('torch.')} [{sample.desc}]"


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"


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

    def run(sample: Sample, dtype: torch.dtype, k: int, special: bool) -> None:
        res.count += 1
        errors: list[ErrorStats] = []
        try:
            problem = run_reference(spec, sample, dtype, errors, reference_device)
        except Exception as exc:  # noqa: BLE001 - report, keep checking
            problem = _first_line(exc)
        case = f"{str(dtype).removeprefix('torch.')} [{sample.desc}]"
        for e in errors:
            if not special or e.n_bad:
                res.worst[case] = res.worst[case].worse(e) if case in res.worst else e
        if problem:
            res.failures.append(f"{_sample_label(spec, dtype, sample)} (seed {seed + k}): {problem}")

    for k in range(seeds):
        gen = generator(device, seed + k)
        for dtype in spec.dtypes:
            for sample, special in reference_cases(spec, device, dtype, gen):
                run(sample, dtype, k, special)
    res.status = "fail" if res.failures else "pass"
    return res


def _with_grad(spec: OpSpec, sample: Sample) -> Sample:
    """The sample with every non-mutated floating input requiring grad (views keep their strides)."""
    mutated = set(spec.mutated_args)
    args = tuple(
        a.detach().requires_grad_() if isinstance(a, torch.Tensor) and i not in mutated and a.is_floating_point() else a
        for i, a in enumerate(sample.args)
    )
    return Sample(args, sample.kwargs, sample.desc)


def _small(sample: Sample, limit: int) -> bool:
    ts = _tensors(sample.args)
    return all(0 < t.numel() <= limit for t in ts)


def _self_overlapping(sample: Sample) -> bool:
    """True if an input has elements sharing memory (an expanded view):
    gradcheck cannot perturb those one at a time."""
    return any(st == 0 and sz > 1 for t in _tensors(sample.args) for st, sz in zip(t.stride(), t.shape, strict=True))


def check_opcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult(spec.name, "opcheck", "pass")
    gen = generator(device, seed)
    for dtype in spec.dtypes:
        samples = [s for s in spec.samples(device, dtype, gen) if _small(s, _OPCHECK_MAX_NUMEL)]
        if dtype != torch.float32:
            samples = samples[:2]  # every layout in float32; the dtypes once or twice each
        for sample in samples:
            if spec.differentiable:
                sample = _with_grad(spec, sample)
            res.count += 1
            try:
                torch.library.opcheck(spec.overload, sample.args, dict(sample.kwargs))
            except Exception as exc:  # noqa: BLE001
                res.failures.append(f"{_sample_label(spec, dtype, sample)}: {_first_line(exc)}")
    res.status = "fail" if res.failures else "pass"
    return res


def check_gradcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    if not spec.differentiable:
        return CheckResult(spec.name, "gradcheck", "n/a", note="no autograd formula")
    res = CheckResult(spec.name, "gradcheck", "pass")
    samples = _gradcheck_samples(spec, device, seed)
    whole = min(range(len(samples)), key=lambda i: sum(t.numel() for t in _tensors(samples[i].args)), default=-1)
    for i, sample in enumerate(samples):
        _run_autograd_check(res, spec, sample, torch.autograd.gradcheck, fast_mode=i != whole, check_forward_ad=spec.jvp is not None)
    res.status = "fail" if res.failures else "pass"
    return res


def _gradcheck_samples(spec: OpSpec, device: torch.device, seed: int) -> list[Sample]:
    """float64 samples that gradcheck can perturb one element at a time, small enough to afford it."""
    gen = generator(device, seed)
    return [s for s in spec.samples(device, torch.float64, gen) if _small(s, _GRADCHECK_MAX_NUMEL) and not _self_overlapping(s)]


def _run_autograd_check(res: CheckResult, spec: OpSpec, sample: Sample, check: Callable[..., bool], **options: Any) -> None:
    """One gradcheck or gradgradcheck of ``sample``; a failure or an error goes into ``res``."""
    sample = _with_grad(spec, sample)
    res.count += 1
    try:
        if not check(lambda *a, s=sample: spec.overload(*a, **s.kwargs), sample.args, **options):
            res.failures.append(f"{_sample_label(spec, torch.float64, sample)}: {res.check} returned False")
    except Exception as exc:  # noqa: BLE001
        res.failures.append(f"{_sample_label(spec, torch.float64, sample)}: {_first_line(exc)}")


def check_gradgradcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    if not spec.differentiable:
        return CheckResult(spec.name, "gradgradcheck", "n/a", note="no autograd formula")
    if not spec.double_backward:
        return CheckResult(spec.name, "gradgradcheck", "n/a", note="double backward unsupported")
    res = CheckResult(spec.name, "gradgradcheck", "pass")
    samples = _gradcheck_samples(spec, device, seed)
    if not samples:
        return CheckResult(spec.name, "gradgradcheck", "n/a", note="no sample small enough")
    smallest = min(samples, key=lambda s: sum(t.numel() for t in _tensors(s.args)))
    strided = next((s for s in samples if not all(t.is_contiguous() for t in _tensors(s.args))), None)
    for sample, fast in ((smallest, False), (strided, True)):
        if sample is None or (fast and sample is smallest):
            continue
        _run_autograd_check(res, spec, sample, torch.autograd.gradgradcheck, fast_mode=fast)
    res.status = "fail" if res.failures else "pass"
    return res


def check_compile(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """One mid-sized sample through torch.compile(fullgraph=True), forward and
    (for differentiable ops) backward, equal to eager. The forward's outputs
    come from the operator's own kernel either way, so they must be equal bit
    for bit; the gradients, where a spec's backward is written in PyTorch ops
    that Inductor fuses (and may round differently, by an ulp), to the spec's
    float32 tolerance."""
    res = CheckResult(spec.name, "compile", "pass")
    gen = generator(device, seed)
    sample = next(s for s in spec.samples(device, torch.float32, gen) if _small(s, _OPCHECK_MAX_NUMEL) and _tensors(s.args)[0].dim() >= 2)
    res.count = 1
    mutated = spec.mutated_args
    kwargs = dict(sample.kwargs)

    def run(fn: Callable[..., Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs and written arguments, gradients), detached."""
        s = _with_grad(spec, sample) if spec.differentiable else Sample(_map_tensors(sample.args, torch.clone), kwargs)
        out = fn(*s.args)
        results = _tensors(out) + [s.args[i] for i in mutated]
        grads = []
        if spec.differentiable:
            sum(t.sum() for t in _tensors(out)).backward()
            grads = [a.grad for a in s.args if isinstance(a, torch.Tensor) and a.grad is not None]
        return [r.detach() for r in results], [g.detach() for g in grads]

    def eager(*a: Any) -> Any:
        return spec.overload(*a, **kwargs)

    try:
        torch._dynamo.reset()
        compiled = torch.compile(eager, fullgraph=True)
        (want, want_grads), (got, got_grads) = run(eager), run(compiled)
        if len(want) + len(want_grads) != len(got) + len(got_grads):
            res.failures.append(f"{spec.name}: compiled returned {len(got) + len(got_grads)} tensors, eager {len(want) + len(want_grads)}")
        for k, (w, g) in enumerate(zip(want, got, strict=False)):
            if not torch.equal(w, g):
                res.failures.append(f"{spec.name} [{sample.desc}]: compiled output {k} differs from eager: {compare(g, w, 0, 0)}")
        atol, rtol = spec.tolerance(torch.float32)
        for k, (w, g) in enumerate(zip(want_grads, got_grads, strict=False)):
            if problem := compare(g, w, atol, rtol):
                res.failures.append(f"{spec.name} [{sample.desc}]: compiled gradient {k} differs from eager: {problem}")
    except Exception as exc:  # noqa: BLE001
        res.failures.append(f"{spec.name} [{sample.desc}]: {_first_line(exc)}")
    res.status = "fail" if res.failures else "pass"
    return res


def check_bad_inputs(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    bad_inputs = list(spec.bad_inputs(device))
    if not bad_inputs:
        return CheckResult(spec.name, "bad inputs", "n/a", note="none declared")
    res = CheckResult(spec.name, "bad inputs", "pass")
    for bad in bad_inputs:
        res.count += 1
        try:
            spec.overload(*bad.args, **bad.kwargs)
        except bad.error as exc:
            if not re.search(bad.match, str(exc)):
                res.failures.append(f"{spec.name} [{bad.desc}]: message {str(exc).splitlines()[0]!r} does not match {bad.match!r}")
        except Exception as exc:  # noqa: BLE001
            res.failures.append(f"{spec.name} [{bad.desc}]: raised {_first_line(exc)}, expected {bad.error.__name__}")
        else:
            res.failures.append(f"{spec.name} [{bad.desc}]: did not raise")
    res.status = "fail" if res.failures else "pass"
    return res


CHECK_FUNCTIONS: dict[str, Callable[[OpSpec, torch.device, int], CheckResult]] = {
    "reference": check_reference,
    "opcheck": check_opcheck,
    "gradcheck": check_gradcheck,
    "gradgradcheck": check_gradgradcheck,
    "compile": check_compile,
    "bad inputs": check_bad_inputs,
}


def check_op(
    spec: OpSpec,
    device: torch.device,
    seed: int,
    checks: Sequence[str] = CHECKS,
    seeds: int = 1,
    reference_device: torch.device | str | None = None,
) -> list[CheckResult]:
    results = []
    for name in checks:
        try:
            if name == "reference":
                results.append(check_reference(spec, device, seed, seeds, reference_device))
            else:
                results.append(CHECK_FUNCTIONS[name](spec, device, seed))
        except Exception:  # noqa: BLE001 - a crash in one check must not hide the others
            results.append(CheckResult(spec.name, name, "fail", failures=[traceback.format_exc(limit=3)]))
    return results
