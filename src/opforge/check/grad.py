"""The checks of ``opforge check`` that differentiate or compile the operator:
gradcheck, gradgradcheck and torch.compile.

gradcheck compares the autograd formula with a numerical Jacobian (central
differences). It runs in float64 where the spec's dtypes include it (with
gradcheck's own tolerances); an operator that takes float32 only (many
kernels check their dtype) is checked in float32, with a step and tolerances
suited to float32's precision, and the report says so. Half precision alone
cannot carry a numerical derivative: gradcheck is then not applicable.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.gradcheck import GradcheckError

from opforge.check.steps import (
    CheckResult,
    dtype_name,
    first_line,
    generator,
    map_tensors,
    missing_fake,
    sample_label,
    settle,
    step,
    with_grad,
)
from opforge.check.values import compare, difference, self_overlapping, small, tensors
from opforge.opspec import OpSpec, Sample

# gradcheck's numerical Jacobian costs one forward per input element.
GRADCHECK_MAX_NUMEL = 1100
# The compile check's sample: small enough to compile and run fast.
COMPILE_MAX_NUMEL = 4096

# gradcheck's options per dtype. float64: its defaults. float32: the central
# difference (f(x + eps) - f(x - eps)) / 2 eps carries a rounding error of
# about ulp(f) / eps, 1.2e-7 / 1e-3 ~ 1e-4 relative, and the step itself is
# rounded to float32 (another ulp(x) / eps); 1e-2 leaves a margin of about 100
# over both, where a wrong formula (a factor, a term, a sign) is off by order one.
GRAD_OPTIONS: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3},
    torch.float32: {"eps": 1e-3, "atol": 1e-2, "rtol": 1e-2},
}


def not_differentiable(spec: OpSpec) -> str:
    """Why gradients are not checked for ``spec`` ("" when they are)."""
    if not spec.returns_tensor:
        return "returns no tensor"
    if not spec.differentiable:
        return "no autograd formula"
    return ""


def grad_dtype(spec: OpSpec) -> torch.dtype | None:
    """float64 if the spec's dtypes include it, else float32 if they do; None for half types alone."""
    return next((d for d in (torch.float64, torch.float32) if d in spec.dtypes), None)


def _grad_note(spec: OpSpec, dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return ""
    opts = GRAD_OPTIONS[dtype]
    return (
        f"in {dtype_name(dtype)}, the widest dtype the spec declares (dtypes={', '.join(map(dtype_name, spec.dtypes))}): "
        f"eps {opts['eps']:g}, atol {opts['atol']:g}, rtol {opts['rtol']:g}"
    )


def _begin(spec: OpSpec, check: str) -> tuple[CheckResult, torch.dtype | None]:
    """The result to fill, and the dtype to check in; a dtype of None: the result is n/a."""
    why = not_differentiable(spec)
    if why:
        return CheckResult(spec.name, check, "n/a", note=why), None
    dtype = grad_dtype(spec)
    if dtype is None:
        note = f"needs float32 or float64; the spec's dtypes are {', '.join(map(dtype_name, spec.dtypes))}"
        return CheckResult(spec.name, check, "n/a", note=note), None
    res = CheckResult(spec.name, check, "pass", note=_grad_note(spec, dtype))
    if dtype != torch.float64:
        res.tag = dtype_name(dtype)
    return res, dtype


def floating_outputs(spec: OpSpec, sample: Sample, check: str) -> str:
    """ "" where one of the operator's outputs for ``sample`` is floating (or
    complex), or the call fails (the check then says why); else why there is no
    gradient to check ("returns int64 only": indices, counts, masks)."""
    step(spec, check, f"{sample_label(spec, sample_dtype(sample), sample)}: which outputs are floating?")
    try:
        with torch.no_grad():
            outs = tensors(spec.overload(*map_tensors(sample.args, torch.clone), **sample.kwargs))
        settle(sample_device(sample))
    except Exception:  # noqa: BLE001 - the check's own run reports it
        return ""
    if not outs or any(t.is_floating_point() or t.is_complex() for t in outs):
        return ""
    return f"no floating output (returns {', '.join(dict.fromkeys(dtype_name(t.dtype) for t in outs))} only): nothing to differentiate"


def sample_dtype(sample: Sample) -> torch.dtype:
    """The dtype of the sample's first floating tensor (else its first tensor's)."""
    ts = tensors(sample.args)
    return next((t.dtype for t in ts if t.is_floating_point()), ts[0].dtype if ts else torch.float32)


def _no_floating_output(spec: OpSpec, samples: list[Sample], check: str) -> CheckResult | None:
    """The n/a result of ``check`` for an operator whose outputs are none of them floating; None otherwise."""
    sample = next((s for s in samples if all(t.numel() > 0 for t in tensors(s.args))), None)
    why = floating_outputs(spec, sample, check) if sample is not None else ""
    return CheckResult(spec.name, check, "n/a", note=why) if why else None


def check_gradcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """The whole Jacobian, element by element, on the sample with the fewest
    input elements; in float64, on every other sample (layouts: transposed,
    strided, offset) gradcheck's fast mode, which compares the Jacobian's
    product with random vectors, one backward and two forwards per sample
    instead of one per element (lltm's six samples on two cores: 1 s instead of
    40); the spec's ``jvp`` (forward-mode AD) against the same numerical
    Jacobian where it has one. In float32 every sample whole: fast mode's
    tolerance grows with the random vectors' sums while a wrong formula's
    difference shrinks with their norms, and at float32's tolerances it passed
    d/da = a for d/da = b on every one of ten 33x17 samples."""
    res, dtype = _begin(spec, "gradcheck")
    if dtype is None:
        return res
    samples = gradcheck_samples(spec, device, dtype, seed)
    if (na := _no_floating_output(spec, samples, "gradcheck")) is not None:
        return na
    whole = min(range(len(samples)), key=lambda i: sum(t.numel() for t in tensors(samples[i].args)), default=-1)
    for i, sample in enumerate(samples):
        fast = i != whole and dtype == torch.float64
        run_autograd_check(res, spec, sample, dtype, torch.autograd.gradcheck, fast_mode=fast, check_forward_ad=spec.jvp is not None)
    return res.close()


def gradcheck_samples(spec: OpSpec, device: torch.device, dtype: torch.dtype, seed: int) -> list[Sample]:
    """Samples that gradcheck can perturb one element at a time, small enough to afford it."""
    gen = generator(device, seed)
    return [s for s in spec.samples(device, dtype, gen) if small(s, GRADCHECK_MAX_NUMEL) and not self_overlapping(s)]


def run_autograd_check(
    res: CheckResult, spec: OpSpec, sample: Sample, dtype: torch.dtype, check: Callable[..., bool], **options: Any
) -> None:
    """One gradcheck or gradgradcheck of ``sample``; a failure or an error goes into ``res``."""
    sample = with_grad(spec, sample)
    label = sample_label(spec, dtype, sample)
    res.count += 1
    step(spec, res.check, label)
    try:
        with warnings.catch_warnings():
            # "Input #0 requires gradient and is not a double precision floating point": float32 is chosen here.
            warnings.filterwarnings("ignore", message=".*double precision floating point.*")
            ok = check(lambda *a, s=sample: spec.overload(*a, **s.kwargs), sample.args, **GRAD_OPTIONS[dtype], **options)
        settle(sample_device(sample))
        if not ok:
            res.failures.append(f"{label}: {res.check} returned False")
    except GradcheckError as exc:
        names = [spec.schema.arguments[i].name for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.requires_grad]
        res.failures.append(f"{label}: {jacobian_mismatch(names, str(exc))}")
    except Exception as exc:  # noqa: BLE001
        res.failures.append(f"{label}: {first_line(exc)}")


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)")


def jacobian_mismatch(names: list[str], message: str) -> str:
    """gradcheck's "Jacobian mismatch for output 0 with respect to input 1" in a
    line, the input named (``names``: the arguments that require grad, as
    gradcheck numbers them), with the worst element of the two Jacobians it
    prints (or, in fast mode, the two projections it compares)."""
    lines = message.strip().splitlines()
    head = lines[0].rstrip(",") if lines else "gradcheck failed"
    found = re.search(r"with respect to input (\d+)", head)
    if found and int(found.group(1)) < len(names):
        head += f" ({names[int(found.group(1))]})"
    text = "\n".join(lines[1:])
    sections = re.split(r"\b(?:numerical|analytical):", text.split("The above quantities")[0], flags=re.IGNORECASE)
    if len(sections) == 3:
        num, ana = (_NUMBER.findall(part) for part in sections[1:])
        if num and len(num) == len(ana) and "..." not in text:
            pairs = [(float(n), float(a)) for n, a in zip(num, ana, strict=True)]
            worst = max(range(len(pairs)), key=lambda i: abs(pairs[i][0] - pairs[i][1]))
            n, a = pairs[worst]
            # gradcheck prints the Jacobian as (input elements, output elements), a row per input element.
            rows = sections[1].count("[") - 1
            i, j = divmod(worst, len(pairs) // rows) if rows > 0 and len(pairs) % rows == 0 else (worst, -1)
            where = "" if len(pairs) == 1 else f" at input element {i}, output element {j} (flat)" if j >= 0 else f" at {worst}"
            return f"{head}: numerical {n:.6g}, analytical {a:.6g}{where}"
    return head


def sample_device(sample: Sample) -> torch.device:
    ts = tensors(sample.args)
    return ts[0].device if ts else torch.device("cpu")


def check_gradgradcheck(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """The backward's own derivative (differentiable ops whose spec does not say
    ``double_backward=False``), on two samples only (it is the dearest check per
    sample): the smallest whole, and the first non-contiguous one in fast mode."""
    res, dtype = _begin(spec, "gradgradcheck")
    if dtype is None:
        return res
    if not spec.double_backward:
        return CheckResult(spec.name, "gradgradcheck", "n/a", note="double backward unsupported")
    samples = gradcheck_samples(spec, device, dtype, seed)
    if not samples:
        return CheckResult(spec.name, "gradgradcheck", "n/a", note="no sample small enough")
    if (na := _no_floating_output(spec, samples, "gradgradcheck")) is not None:
        return na
    smallest = min(samples, key=lambda s: sum(t.numel() for t in tensors(s.args)))
    strided = next((s for s in samples if not all(t.is_contiguous() for t in tensors(s.args))), None)
    for sample, fast in ((smallest, False), (strided, True)):
        if sample is None or (fast and sample is smallest):
            continue
        run_autograd_check(res, spec, sample, dtype, torch.autograd.gradgradcheck, fast_mode=fast and dtype == torch.float64)
    return res.close()


def compile_dtype(spec: OpSpec) -> torch.dtype:
    """float32 where the spec takes it, else its first floating dtype (else its first)."""
    if torch.float32 in spec.dtypes:
        return torch.float32
    return next((d for d in spec.dtypes if d.is_floating_point), spec.dtypes[0])


def compile_sample(samples: list[Sample]) -> Sample | None:
    """The first small sample whose first tensor has two or more dimensions; else
    the largest small one; else the smallest that holds an element; None if none does."""
    filled = [s for s in samples if tensors(s.args) and all(t.numel() > 0 for t in tensors(s.args))]
    smalls = [s for s in filled if small(s, COMPILE_MAX_NUMEL)]
    numel = lambda s: sum(t.numel() for t in tensors(s.args))  # noqa: E731
    return (
        next((s for s in smalls if tensors(s.args)[0].dim() >= 2), None)
        or max(smalls, key=numel, default=None)
        or min(filled, key=numel, default=None)
    )


def check_compile(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """One mid-sized sample through torch.compile(fullgraph=True), forward and
    (for differentiable ops) backward, equal to eager. The forward's outputs
    come from the operator's own kernel either way, so they must be equal bit
    for bit; the gradients, where a spec's backward is written in PyTorch ops
    that Inductor fuses (and may round differently, by an ulp), to the spec's
    tolerance in the dtype compiled."""
    dtype = compile_dtype(spec)
    sample = compile_sample(list(spec.samples(device, dtype, generator(device, seed))))
    if sample is None:
        return CheckResult(spec.name, "compile", "n/a", note="no sample holds an element")
    res = CheckResult(spec.name, "compile", "pass", count=1)
    mutated = spec.mutated_args
    kwargs = dict(sample.kwargs)
    differentiable = not not_differentiable(spec)
    label = sample_label(spec, dtype, sample)

    def run(fn: Callable[..., Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs and written arguments, gradients), detached."""
        s = with_grad(spec, sample) if differentiable else Sample(map_tensors(sample.args, torch.clone), kwargs)
        out = fn(*s.args)
        results = tensors(out) + [s.args[i] for i in mutated]
        grads = []
        # Gradients flow from floating outputs only (an index, a count or a mask has none).
        floating = [t for t in tensors(out) if t.requires_grad]
        if differentiable and floating:
            sum(t.sum() for t in floating).backward()
            grads = [a.grad for a in s.args if isinstance(a, torch.Tensor) and a.grad is not None]
        settle(device)
        return [r.detach() for r in results], [g.detach() for g in grads]

    def eager(*a: Any) -> Any:
        return spec.overload(*a, **kwargs)

    step(spec, "compile", f"{label}: on fake tensors")
    if missing := missing_fake(spec, sample, "compile"):
        return CheckResult(spec.name, "compile", "fail", count=1, failures=[missing], tag="no fake kernel")
    step(spec, "compile", label)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(eager, fullgraph=True)
        (want, want_grads), (got, got_grads) = run(eager), run(compiled)
        if differentiable and not want_grads:
            res.note = "backward not run: no floating output to differentiate"
        if len(want) + len(want_grads) != len(got) + len(got_grads):
            res.failures.append(f"{label}: compiled returned {len(got) + len(got_grads)} tensors, eager {len(want) + len(want_grads)}")
        for k, (w, g) in enumerate(zip(want, got, strict=False)):
            if problem := difference(g, w):
                res.failures.append(f"{label}: compiled output {k} differs from eager: {problem}")
        atol, rtol = spec.tolerance(dtype)
        for k, (w, g) in enumerate(zip(want_grads, got_grads, strict=False)):
            if problem := compare(g, w, atol, rtol):
                res.failures.append(f"{label}: compiled gradient {k} differs from eager: {problem}")
    except Exception as exc:  # noqa: BLE001
        res.failures.append(f"{label}: {first_line(exc)}")
    return res.close()
