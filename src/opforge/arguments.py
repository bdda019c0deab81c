"""What the dispatcher and torch's argument parser say too little about, said by
the operator's name: a call with no tensor where a Tensor is due (the
dispatcher's "forgot to register a fallback"), and a Python int no argument
type can hold (the parser's "found type 'int'")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from opforge.opspec import OpSpec


def check_tensor_arguments(spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises TypeError naming the first non-optional Tensor argument that got no tensor."""
    try:
        bound = spec.signature().bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{spec.qualname}: {exc}") from None
    for a in spec.schema.arguments:
        if str(a.type) == "Tensor" and a.name in bound.arguments and not isinstance(bound.arguments[a.name], torch.Tensor):
            value = bound.arguments[a.name]
            raise TypeError(f"{spec.qualname}: {a.name} must be a Tensor, got {type(value).__name__} ({value!r:.40})") from None


def check_number_arguments(spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises OverflowError naming the first int, float or Scalar argument given a Python int
    its type cannot hold (torch's parser then says only that it "found type 'int'")."""
    try:
        bound = spec.signature().bind(*args, **kwargs)
    except TypeError:
        return
    for a in spec.schema.arguments:
        value = bound.arguments.get(a.name)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        kind = str(a.type).removesuffix("?")
        if kind == "float":
            try:
                float(value)
            except OverflowError:
                raise OverflowError(
                    f"{spec.qualname}: {a.name}={_magnitude(value)} is out of range: a float argument takes a double, "
                    "at most about 1.8e308 in magnitude"
                ) from None
        elif kind in ("int", "SymInt", "Scalar") and not -(2**63) <= value < 2**63:
            raise OverflowError(
                f"{spec.qualname}: {a.name}={_magnitude(value)} is out of range: an {kind} argument takes a 64-bit "
                "integer, -2^63 to 2^63 - 1"
            )


def _magnitude(value: int) -> str:
    """A Python int too long to print whole, as 1e400 or -1.5e20 (exact up to its first three digits)."""
    digits = str(abs(value))
    if len(digits) <= 20:
        return str(value)
    mantissa = digits[0] + ("." + digits[1:3].rstrip("0") if digits[1:3].strip("0") else "")
    return f"{'-' if value < 0 else ''}{'' if digits[3:].strip('0') == '' else '~'}{mantissa}e{len(digits) - 1}"


class _NamingPacket(torch._ops.OpOverloadPacket):
    """``torch.ops.<namespace>.<name>`` of an opforge operator: a call that gives the
    dispatcher no tensor to dispatch on (a None where the operator's one tensor is due)
    raises naming the argument, as opforge's own function does, rather than the
    dispatcher's "forgot to register a fallback". A kernel cannot do it: the only key
    such a call reaches is a composite one, which would make every device look served
    and send fake tensors through it."""

    _opforge_spec: OpSpec

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except NotImplementedError:
            check_tensor_arguments(self._opforge_spec, args, kwargs)
            raise


def name_missing_tensors(spec: OpSpec) -> None:
    packet = getattr(getattr(torch.ops, spec.namespace), spec.name)
    if type(packet) is torch._ops.OpOverloadPacket:
        packet._opforge_spec = spec  # type: ignore[attr-defined]
        packet.__class__ = _NamingPacket
