"""Every operator's autograd kernel, from its spec: the reverse-mode formula
(``backward`` / ``setup_context``, as ``torch.library.register_autograd`` takes
them), forward-mode AD through the spec's ``jvp``, and a clear error wherever
a derivative is missing.

Without such a kernel the dispatcher's fallback lets a gradient or a tangent
through an operator with a warning at most: backward returns nothing for the
inputs and ``torch.func.jvp`` returns zeros. Here an operator without a
``backward`` raises when its gradient is asked for, and one without a ``jvp``
raises when it is given a tangent, each naming the operator.

Operators that write an argument (out= forms) refuse both, as torch's own
out= functions do, and bump the version of what they wrote: through the C++
kernel of the fast-path module (opforge.fast) when it is there, else through
the Python kernel here, with the same words (the tests run both).
An operator whose library registered an Autograd kernel itself keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as fwad
from torch._library.autograd import Info, make_autograd_impl
from torch._library.utils import fill_defaults

from opforge import fast

if TYPE_CHECKING:
    from opforge.opspec import OpSpec

# One fragment per namespace; a Library deregisters its kernels when collected.
_LIBRARIES: dict[str, torch.library.Library] = {}


def register(spec: OpSpec) -> None:
    """Registers ``spec``'s autograd kernel (the Autograd dispatch key)."""
    if spec.mutated_args:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "Autograd"):
            _register_writes_arguments(spec)
        return
    backward = spec.backward if spec.backward is not None else _no_derivative(spec)
    reverse = make_autograd_impl(spec.overload, Info(backward, spec.setup_context if spec.backward is not None else None))
    names = [a.name for a in spec.schema.arguments]

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        # Forward AD is on only inside a dual_level (torch.func.jvp enters one too).
        if fwad._current_level >= 0:
            tangents = tuple(fwad.unpack_dual(a).tangent if isinstance(a, torch.Tensor) else None for a in args)
            if any(t is not None for t in tangents):
                return _forward_mode(spec, reverse, keyset, args, kwargs, tangents, names)
        try:
            return reverse(keyset, *args, **kwargs)
        except RuntimeError as exc:
            if _FUNCTORCH_REFUSAL not in str(exc):
                raise
            # torch's words name an autograd.Function the user never wrote, not the operator.
            raise RuntimeError(
                f"{spec.qualname}: torch.func's reverse-mode transforms (grad, vjp, jacrev, hessian) cannot differentiate "
                "through this operator: its derivative is registered for torch.autograd, which they do not take from "
                "a custom operator. Use torch.autograd.grad or .backward() (forward mode, torch.func.jvp and jacfwd, "
                "goes through the operator's jvp)"
            ) from exc

    _library(spec.namespace).impl(spec.name, kernel, "Autograd", with_keyset=True)


#: What torch raises when a torch.func transform meets the autograd.Function behind a registered formula.
_FUNCTORCH_REFUSAL = "with functorch transforms"


def _register_writes_arguments(spec: OpSpec) -> None:
    # The C++ kernel where the fast-path module is loaded: through torch.ops it costs 9.8 us per
    # add_out call on an H100 where this Python one costs 28 (host_overhead.py's torch.ops route).
    module = fast.module()
    if module is not None:
        module.writes_arguments(spec.qualname)
        return
    arguments = spec.schema.arguments
    written = set(spec.mutated_args)

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        values = [*args, *(kwargs[a.name] for a in arguments[len(args) :] if a.name in kwargs)]
        grad_on = torch.is_grad_enabled()
        for i, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                continue
            name = arguments[i].name
            if grad_on and value.requires_grad:
                what = "writes into it" if i in written else "writes into an argument"
                raise RuntimeError(
                    f"{spec.qualname}: {name} requires grad, but this operator {what} and has no derivative (as torch's "
                    "out= functions). Call it under torch.no_grad(), on detached tensors, or use the functional form"
                )
            if fwad._current_level >= 0 and fwad.unpack_dual(value).tangent is not None:
                raise NotImplementedError(
                    f"{spec.qualname}: {name} has a tangent, but forward-mode AD is not supported by an operator that "
                    "writes an argument (as torch's out= functions)"
                )
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = spec.overload.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)
        for i in written:
            if i < len(values) and isinstance(values[i], torch.Tensor):
                torch.autograd.graph.increment_version(values[i])
        return out

    _library(spec.namespace).impl(spec.name, kernel, "Autograd", with_keyset=True)


def _library(namespace: str) -> torch.library.Library:
    library = _LIBRARIES.get(namespace)
    if library is None:
        library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return library


def no_derivative_error(spec: OpSpec, where: str = "") -> RuntimeError:
    """What a gradient through an operator without a derivative raises: the
    operator, why it has none, and (``where``) what the gradient went through."""
    why = f" ({spec.no_derivative})" if spec.no_derivative else ""
    return RuntimeError(
        f"{spec.qualname}: has no derivative{why}; a gradient was asked for through it "
        f"({where or 'backward or torch.autograd.grad reached one of its outputs'})"
    )


def _no_derivative(spec: OpSpec) -> Callable[..., Any]:
    def backward(ctx: Any, *grads: Any) -> Any:
        raise no_derivative_error(spec)

    return backward


def _forward_mode(
    spec: OpSpec,
    reverse: Callable[..., Any],
    keyset: torch._C.DispatchKeySet,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tangents: tuple[torch.Tensor | None, ...],
    names: list[str],
) -> Any:
    if spec.jvp is None:
        given = ", ".join(n for n, t in zip(names, tangents, strict=False) if t is not None)
        raise NotImplementedError(
            f"{spec.qualname}: forward-mode AD is not supported (a tangent was given for {given}); "
            "use reverse mode (backward, torch.autograd.grad, torch.func.vjp)"
        )
    primals = tuple(fwad.unpack_dual(a).primal if t is not None else a for a, t in zip(args, tangents, strict=True))
    out = reverse(keyset, *primals, **kwargs)
    # The dispatcher drops trailing arguments equal to their defaults: the formula sees them all.
    inputs, _ = fill_defaults(spec.schema, primals, kwargs)
    tangent_out = spec.jvp(tuple(inputs), tangents + (None,) * (len(inputs) - len(tangents)), out)
    if isinstance(out, tuple):
        return tuple(o if t is None else fwad.make_dual(o, t) for o, t in zip(out, tangent_out, strict=True))
    return fwad.make_dual(out, tangent_out)


def add_tangents(*terms: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the terms that are there (a jvp's inputs without a tangent give None)."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for t in present[1:]:
        total = total + t
    return total


__all__ = ["add_tangents", "register"]
