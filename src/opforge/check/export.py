"""The ``export`` check of ``opforge check``: ``torch.export.export`` of a module
that calls the operator once, with the first dimension of each tensor argument
left dynamic where the operator allows it (``Dim.AUTO``: export decides, and
keeps a dimension static where the fake kernel ties it to a constant); the
exported program run on the sample, and again after ``torch.export.save`` and
``load``, must give the operator's own outputs bit for bit (the same kernel
runs), written arguments included.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from opforge.check.grad import COMPILE_MAX_NUMEL, compile_dtype, compile_sample
from opforge.check.steps import CheckResult, first_line, generator, missing_fake, sample_label, settle, step
from opforge.check.values import difference, small, tensors
from opforge.opspec import OpSpec, Sample


def _is_input(a: Any) -> bool:
    """A tensor, or a non-empty list of tensors (a ``Tensor[]`` argument): an input of the exported program."""
    return isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple)) and bool(a) and all(isinstance(t, torch.Tensor) for t in a))


class OneOp(torch.nn.Module):
    """A module whose forward calls ``op`` once: the sample's tensors and lists of tensors are
    its inputs, every other argument (a number, None, a dtype, a list of numbers) a constant."""

    def __init__(self, op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.op = op
        self.template = tuple(None if _is_input(a) else a for a in args)
        self.where = [i for i, a in enumerate(args) if _is_input(a)]
        self.kwargs = dict(kwargs)

    def forward(self, *inputs: torch.Tensor | list[torch.Tensor]) -> Any:
        args = list(self.template)
        for i, t in zip(self.where, inputs, strict=True):
            args[i] = t
        return self.op(*args, **self.kwargs)


def one_op_module(spec: OpSpec, sample: Sample) -> tuple[OneOp, tuple[torch.Tensor | list[torch.Tensor], ...]]:
    """The module around ``spec``'s operator for ``sample``, and its inputs (a ``Tensor[]`` argument as a list)."""
    module = OneOp(spec.overload, sample.args, dict(sample.kwargs))
    return module, tuple(list(a) if isinstance(a, tuple) else a for a in sample.args if _is_input(a))


def batch_dynamic_shapes(inputs: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> tuple[Any, ...]:
    """Dimension 0 of every input tensor of one or more dimensions left to export (``Dim.AUTO``),
    a list of them for a list input (export matches ``dynamic_shapes`` to the inputs' structure);
    for ``OneOp``, whose inputs are one varargs argument, wrap it in a tuple."""

    def one(t: torch.Tensor) -> dict[int, Any]:
        return {0: torch.export.Dim.AUTO} if t.dim() >= 1 else {}

    return tuple(one(t) if isinstance(t, torch.Tensor) else [one(x) for x in t] for t in inputs)


def dynamic_dims(ep: torch.export.ExportedProgram) -> list[str]:
    """The placeholders' dimensions that stayed symbolic, as ``name[dim]``."""
    found = []
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            found += [f"{node.name}[{d}]" for d, s in enumerate(val.shape) if not isinstance(s, int)]
    return found


def export_sample(samples: list[Sample]) -> Sample | None:
    """The first small sample whose first tensor has a batch to leave dynamic
    (two or more rows: export fixes a dimension of size 0 or 1); else the compile check's."""
    for s in samples:
        ts = tensors(s.args)
        if ts and all(t.numel() > 0 for t in ts) and small(s, COMPILE_MAX_NUMEL) and ts[0].dim() >= 2 and ts[0].shape[0] >= 2:
            return s
    return compile_sample(samples)


@contextlib.contextmanager
def _quiet_specialisation() -> Iterator[None]:
    """Export's warning for each dimension Dim.AUTO leaves static is this check's note instead."""
    logger = logging.getLogger("torch._export.non_strict_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def traced_outputs(ep: torch.export.ExportedProgram) -> list[Any]:
    """What the exported graph says its outputs are (fake tensors, from the fake kernel), the
    written inputs after the returned tensors, as ``_outputs`` orders them."""
    sig = ep.graph_signature
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in out_node.args[0]]
    kinds = [o.kind.name for o in sig.output_specs]
    returned = [v for v, k in zip(vals, kinds, strict=False) if k == "USER_OUTPUT" and isinstance(v, torch.Tensor)]
    written = [v for v, k in zip(vals, kinds, strict=False) if k == "USER_INPUT_MUTATION" and isinstance(v, torch.Tensor)]
    return returned + written


def metadata_mismatch(traced: torch.Tensor, real: torch.Tensor) -> str:
    """How a traced output (its fake kernel's) differs from the kernel's in dtype, rank or a static size; "" if not."""
    if traced.dtype != real.dtype:
        return f"dtype {traced.dtype} traced, {real.dtype} computed"
    if traced.dim() != real.dim():
        return f"{traced.dim()} dimensions traced, {real.dim()} computed (shape {list(real.shape)})"
    for d, (t, r) in enumerate(zip(traced.shape, real.shape, strict=True)):
        if isinstance(t, int) and t != r:
            return f"size {t} traced in dimension {d}, {r} computed"
    return ""


def _outputs(spec: OpSpec, out: Any, inputs: Sequence[torch.Tensor], module: OneOp) -> list[torch.Tensor]:
    written = tensors([inputs[module.where.index(i)] for i in spec.mutated_args if i in module.where])
    return [t.detach() for t in tensors(out)] + [t.detach() for t in written]


def _clone(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Fresh copies of the inputs, the tensors of a list input included."""
    return tuple([t.clone() for t in a] if isinstance(a, list) else a.clone() for a in inputs)


def check_export(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """One sample through ``torch.export.export`` of a one-operator module,
    run, saved, loaded and run again, equal to eager (bit for bit)."""
    dtype = compile_dtype(spec)
    sample = export_sample(list(spec.samples(device, dtype, generator(device, seed))))
    if sample is None:
        return CheckResult(spec.name, "export", "n/a", note="no sample holds an element")
    res = CheckResult(spec.name, "export", "pass", count=1)
    label = sample_label(spec, dtype, sample)
    module, inputs = one_op_module(spec, sample)

    def run(fn: Any) -> list[torch.Tensor]:
        fresh = _clone(inputs)
        out = _outputs(spec, fn(*fresh), fresh, module)
        settle(device)
        return out

    def same(what: str, want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
        if len(want) != len(got):
            res.failures.append(f"{label}: {what} returned {len(got)} tensors, eager {len(want)}")
        for k, (w, g) in enumerate(zip(want, got, strict=False)):
            if problem := difference(g, w):
                res.failures.append(f"{label}: {what} output {k} differs from eager: {problem}")

    step(spec, "export", f"{label}: on fake tensors")
    if missing := missing_fake(spec, sample, "export"):
        return CheckResult(spec.name, "export", "fail", count=1, failures=[missing], tag="no fake kernel")
    step(spec, "export", label)
    try:
        want = run(module)
        with torch.no_grad(), _quiet_specialisation():
            ep = torch.export.export(module, _clone(inputs), dynamic_shapes=(batch_dynamic_shapes(inputs),))
        same("the exported program", want, run(ep.module()))
        traced = traced_outputs(ep)
        for k, (t, w) in enumerate(zip(traced, want, strict=False)):
            if problem := metadata_mismatch(t, w):
                res.failures.append(f"{label}: output {k} of the exported graph (the fake kernel's) differs from the kernel's: {problem}")
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        same("the saved and loaded program", want, run(torch.export.load(buf).module()))
        dims = dynamic_dims(ep)
        static = "static shapes (the operator fixes its first dimension, or the sample's is 0 or 1)"
        res.note = f"dynamic: {', '.join(dims)}" if dims else static
    except Exception as exc:  # noqa: BLE001
        hint = ""
        if type(exc).__name__ == "UnsupportedOperatorException" or "fake" in str(exc).lower():
            hint = f" (export traces on fake tensors: {spec.qualname} needs a fake kernel, torch.library.register_fake or the spec's fake=)"
        res.failures.append(f"{label}: {first_line(exc)}{hint}")
    return res.close()


__all__ = [
    "OneOp",
    "batch_dynamic_shapes",
    "check_export",
    "dynamic_dims",
    "export_sample",
    "metadata_mismatch",
    "one_op_module",
    "traced_outputs",
]
