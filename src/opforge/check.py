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

How outputs are compared, and the special values written into inputs, are in
``check_values``.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from opforge.check_sharding import sharding_check
from opforge.check_values import (
    ErrorStats,
    compare,
    measure_error,
    poisoned_allocations,
    self_overlapping,
    small,
    tensors,
    unchanged,
    with_special_values,
)
from opforge.check_values import special_values as special_values
from opforge.spec import OpSpec, Sample

CHECKS: tuple[str, ...] = ("reference", "opcheck", "gradcheck", "gradgradcheck", "compile", "bad inputs", "sharding")

# gradcheck's numerical Jacobian costs one forward per input element.
_GRADCHECK_MAX_NUMEL = 1100
# opcheck runs each sample through several dispatch modes: a few layouts
# already cover what it tests (schema, fake, autograd registration).
_OPCHECK_MAX_NUMEL = 4096


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


def _map_tensors(args: Sequence[Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    return tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args)


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

    pairs = list(zip(tensors(got), tensors(expected), strict=False))
    if len(tensors(got)) != len(tensors(expected)):
        return f"returned {len(tensors(got))} tensors, reference {len(tensors(expected))}"
    pairs += [(args[i], ref_args[i]) for i in mutated]
    atol, rtol = spec.tolerance(dtype, sample)
    # The first tensor argument's device (an optional first argument may be None, a Tensor[] one a list).
    device = tensors(args)[0].device
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
        if before is not None and not unchanged(before, args[i]):
            return f"input {i} was modified by the operator"
    return None


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


def check_opcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult(spec.name, "opcheck", "pass")
    gen = generator(device, seed)
    for dtype in spec.dtypes:
        samples = [s for s in spec.samples(device, dtype, gen) if small(s, _OPCHECK_MAX_NUMEL)]
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
    whole = min(range(len(samples)), key=lambda i: sum(t.numel() for t in tensors(samples[i].args)), default=-1)
    for i, sample in enumerate(samples):
        _run_autograd_check(res, spec, sample, torch.autograd.gradcheck, fast_mode=i != whole, check_forward_ad=spec.jvp is not None)
    res.status = "fail" if res.failures else "pass"
    return res


def _gradcheck_samples(spec: OpSpec, device: torch.device, seed: int) -> list[Sample]:
    """float64 samples that gradcheck can perturb one element at a time, small enough to afford it."""
    gen = generator(device, seed)
    return [s for s in spec.samples(device, torch.float64, gen) if small(s, _GRADCHECK_MAX_NUMEL) and not self_overlapping(s)]


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
    smallest = min(samples, key=lambda s: sum(t.numel() for t in tensors(s.args)))
    strided = next((s for s in samples if not all(t.is_contiguous() for t in tensors(s.args))), None)
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
    sample = next(s for s in spec.samples(device, torch.float32, gen) if small(s, _OPCHECK_MAX_NUMEL) and tensors(s.args)[0].dim() >= 2)
    res.count = 1
    mutated = spec.mutated_args
    kwargs = dict(sample.kwargs)

    def run(fn: Callable[..., Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs and written arguments, gradients), detached."""
        s = _with_grad(spec, sample) if spec.differentiable else Sample(_map_tensors(sample.args, torch.clone), kwargs)
        out = fn(*s.args)
        results = tensors(out) + [s.args[i] for i in mutated]
        grads = []
        if spec.differentiable:
            sum(t.sum() for t in tensors(out)).backward()
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


def fake_call(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The call as torch.compile traces it: through the fake kernel, on fake
    tensors (one per real tensor, so that aliased inputs stay aliased)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    memo: dict[int, Any] = {}

    def fake(x: Any) -> Any:
        return memo.setdefault(id(x), mode.from_tensor(x)) if isinstance(x, torch.Tensor) else x

    fargs, fkwargs = [fake(a) for a in args], {k: fake(v) for k, v in kwargs.items()}
    # torch logs every exception a fake kernel raises, with its traceback; here
    # the exception is the expected answer, so it stays out of the report.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with mode:
            spec.overload(*fargs, **fkwargs)
    finally:
        log.setLevel(level)


def _expect_refusal(call: Callable[[], Any], bad: Any, where: str) -> str | None:
    """None when ``call`` raises ``bad.error`` with the expected words, else what went wrong."""
    try:
        call()
    except bad.error as exc:
        if not re.search(bad.match, str(exc)):
            return f"{where}message {str(exc).splitlines()[0]!r} does not match {bad.match!r}"
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{where}raised {_first_line(exc)}, expected {bad.error.__name__}"
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
        failure = _expect_refusal(lambda b=bad: spec.overload(*b.args, **b.kwargs), bad, "")
        if failure is None and has_fake and bad.traced:
            failure = _expect_refusal(lambda b=bad: fake_call(spec, b.args, dict(b.kwargs)), bad, "under the fake kernel: ")
        if failure is not None:
            res.failures.append(f"{spec.name} [{bad.desc}]: {failure}")
    if not has_fake:
        res.note = "no fake kernel: checked eagerly only"
    res.status = "fail" if res.failures else "pass"
    return res


def check_sharding(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """Every declared sharding strategy on a simulated mesh (opforge.check_sharding)."""
    return sharding_check(spec, device, seed, CheckResult)


CHECK_FUNCTIONS: dict[str, Callable[[OpSpec, torch.device, int], CheckResult]] = {
    "reference": check_reference,
    "opcheck": check_opcheck,
    "gradcheck": check_gradcheck,
    "gradgradcheck": check_gradgradcheck,
    "compile": check_compile,
    "bad inputs": check_bad_inputs,
    "sharding": check_sharding,
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
