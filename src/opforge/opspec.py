"""The operator spec: everything opforge knows about an operator, in one place.

The schema lives in C++ (``TORCH_LIBRARY``) and is read back from
``torch.ops``; a spec adds what C++ cannot say: a plain-PyTorch reference,
sample inputs, bad inputs and the error each must raise, benchmark cases, a cost
model, a fake kernel and an autograd formula. ``opforge check``, ``opforge
bench``, the tests and the public functions all read specs; adding an operator
is adding one folder under ``csrc/ops`` and one spec module, nothing else.

A spec is a description only: this module imports nothing of opforge, so that
every floor can read it. ``opforge.registry`` wires a spec to its fake kernel,
autograd, public function and sharding strategies. ``opforge.spec`` is the
function that derives a spec from a schema (``opforge.derive``); the older import
path ``from opforge.spec import OpSpec, Sample`` still reaches this module's names.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._library.custom_ops import _maybe_get_opdef

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# (atol, rtol) per dtype, against a float64 reference. The kernels compute half
# types in float32 and round once, so the error is at most half an ulp of the
# output: 2^-11 relative in float16, 2^-8 in bfloat16; rtol is twice that.
DEFAULT_TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-6, 1e-6),
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 8e-3),
}


class SpecError(ValueError):
    """A spec field whose value opforge cannot use: the error names the operator, the field and the value."""


def as_dtype(value: Any, where: str) -> torch.dtype:
    """``value`` as a torch.dtype: one already, or its name ("float32", "torch.int64")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.strip().removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise SpecError(f"{where}: {value!r} is not a dtype; give torch dtypes (torch.float32) or their names ('float32')")


def as_dtypes(value: Any, where: str) -> tuple[torch.dtype, ...]:
    """A spec's ``dtypes=``: one dtype or several, each a torch.dtype or its name."""
    if isinstance(value, (torch.dtype, str)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise SpecError(f"{where}: {value!r:.60} is not a sequence of dtypes; give a tuple such as (torch.float32,)") from None
    return tuple(as_dtype(v, where) for v in items)


def exact_dtype(dtype: torch.dtype) -> bool:
    """Integer and bool dtypes: results compared exactly."""
    return not (dtype.is_floating_point or dtype.is_complex)


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``DEFAULT_TOLERANCES``' entry; a complex dtype its real part's, integer and bool dtypes exact (0, 0)."""
    if exact_dtype(dtype):
        return (0.0, 0.0)
    return DEFAULT_TOLERANCES[dtype.to_real() if dtype.is_complex else dtype]


def check_tolerance(value: Any, where: str) -> tuple[float, float]:
    """An (atol, rtol) pair of finite numbers, neither negative."""
    try:
        atol, rtol = value
        pair = (float(atol), float(rtol))
    except (TypeError, ValueError):
        raise SpecError(f"{where}: {value!r:.60} is not an (atol, rtol) pair of numbers") from None
    if not all(math.isfinite(v) and v >= 0 for v in pair):
        raise SpecError(f"{where}: {value!r:.60} is not an (atol, rtol) pair of finite numbers of at least 0")
    return pair


@dataclass(frozen=True)
class Sample:
    """One call's arguments."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    desc: str = ""


@dataclass(frozen=True)
class BadInput:
    """A call that must raise ``error`` with a message matching ``match``."""

    desc: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    match: str = ""
    error: type[Exception] = RuntimeError
    # False for a rule about values (a scale out of range): the fake kernel sees
    # only shapes, dtypes, devices and strides, so only the kernel can refuse it.
    traced: bool = True


@dataclass(frozen=True)
class Cost:
    """The fewest bytes a call must move through memory, and its FLOPs."""

    bytes: int
    flops: int


SampleFn = Callable[[torch.device, torch.dtype, torch.Generator], Iterable[Sample]]


_IMPORT = "from opforge.opspec import Sample"


class CheckedSamples:
    """A spec's ``samples=`` function, yielding what it yields once each item is
    known to be a ``Sample`` of a tuple of arguments: a raw tensor or a bare
    argument list, or a function that yields nothing, is a SpecError naming the
    operator, not an AttributeError deep in a check."""

    def __init__(self, fn: SampleFn, qualname: str, field_name: str = "samples") -> None:
        self.fn, self.qualname, self.field_name = fn, qualname, field_name

    def __call__(self, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        where = f"spec of {self.qualname}: {self.field_name}="
        drawn = self.fn(device, dtype, gen)
        if drawn is None or isinstance(drawn, (torch.Tensor, Sample)) or not isinstance(drawn, Iterable):
            raise SpecError(f"{where} returned {type(drawn).__name__}, not Samples; yield Sample((x, ...)) per call ({_IMPORT})")
        n = 0
        for item in drawn:
            if not isinstance(item, Sample):
                what = f"Tensor of shape {list(item.shape)}" if isinstance(item, torch.Tensor) else f"{type(item).__name__} ({item!r:.40})"
                raise SpecError(
                    f"{where} yielded a {' '.join(what.split())} as its sample {n}, not a Sample: "
                    f"yield Sample((x, ...)), the call's arguments as a tuple ({_IMPORT})"
                )
            if not isinstance(item.args, tuple):
                raise SpecError(
                    f"{where} yielded Sample({type(item.args).__name__}) as its sample {n}: Sample takes the call's arguments "
                    "as a tuple, as Sample((x,)) for one"
                )
            n += 1
            yield item
        if not n:
            raise SpecError(f"{where} yielded no sample for {str(dtype).removeprefix('torch.')} on {device}: yield at least one Sample")


# A baseline of `opforge bench` besides the reference: from one of the op's
# samples, the function to time and its own arguments, prepared untimed (for
# example the float16 matmul that a quantised operator replaces).
Baseline = Callable[[Sample], tuple[Callable[..., Any], Sample]]


@dataclass
class OpSpec:
    """An operator as opforge sees it. Only ``name`` ties it to C++.

    One type for every operator: the library's own (``opforge.ops``), an
    ``opforge new`` package's (``<package>.ops``) and an operator someone
    already has in ``torch.ops``, for which ``opforge.spec(op, reference=...)``
    makes this same type with the rest derived from the schema
    (``opforge.derive``). They differ only in how much is filled in by hand.
    """

    name: str
    reference: Callable[..., Any]
    samples: SampleFn
    bad_inputs: Callable[[torch.device], Iterable[BadInput]]
    cost: Callable[..., Cost]
    bench_cases: SampleFn
    # Sizes for `opforge bench --sweep` (a curve from launch-bound to DRAM-bound); bench_cases when None.
    sweep_cases: SampleFn | None = None
    fake: Callable[..., Any] | None = None
    backward: Callable[..., Any] | None = None
    setup_context: Callable[..., Any] | None = None
    namespace: str = "opforge"
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    tolerances: Mapping[torch.dtype, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    # Extra `opforge bench` columns, by name (Baseline above); none by default.
    baselines: Mapping[str, Baseline] = field(default_factory=dict)
    # (atol, rtol) for one sample, where the error grows with its sizes (a
    # matmul's with K); ``tolerances`` when None.
    sample_tolerance: Callable[[Sample, torch.dtype], tuple[float, float]] | None = None
    # The reference check also runs samples holding NaN, +-Inf, -0.0, subnormals
    # and each dtype's largest finite values; False where the reference does not
    # define what a kernel must give for them (say why at the spec). By default
    # a zero of either sign matches a zero, and a subnormal result flushed to
    # zero is a note, not a failure (fast-math kernels flush by design);
    # "strict": a zero must have the reference's sign, and a flush fails.
    special_values: bool | str = True
    # gradgradcheck joins the checks for a differentiable op; False where its
    # backward has no derivative of its own.
    double_backward: bool = True
    # Forward-mode AD: jvp(inputs, tangents, output) -> the output's tangent (a
    # tuple for several outputs); tangents holds None for an input without one.
    # Without it, a tangent raises an error naming the operator.
    jvp: Callable[[tuple[Any, ...], tuple[Any, ...], Any], Any] | None = None
    # Why an operator without ``backward`` has no derivative: the error a
    # gradient through it raises says so.
    no_derivative: str = ""
    doc: str = ""
    # The overload of ``namespace::name`` this spec is about.
    overload_name: str = "default"
    # The operator's owner registered its fake kernel and autograd formula,
    # where it has them (torch.library, or C++): opforge registers only what
    # this spec itself adds (``fake``, ``backward``), never an autograd kernel
    # in place of the owner's, and reads ``differentiable`` from the dispatcher.
    owner_registered: bool = False
    # How the operator runs on DTensor (opforge.sharding_strategies): "pointwise" (any placement its tensor
    # arguments share), "pointwise-linear" (Partial too), or a function in
    # torch.distributed.tensor.experimental.register_sharding's form; None: no strategies.
    sharding: str | Callable[..., Any] | None = None
    # The fields opforge.spec filled in because they were left out ("samples",
    # "cost", ...; "bad_inputs": none declared), for the reports to say.
    derived: tuple[str, ...] = ()
    function: Callable[..., Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        where = f"spec of {self.namespace}::{self.name}"
        self.dtypes = as_dtypes(self.dtypes, f"{where}: dtypes=")
        if not self.dtypes:
            raise SpecError(f"{where}: dtypes=() leaves nothing to check; give at least one dtype")
        if self.special_values not in (True, False, "strict") or not isinstance(self.special_values, (bool, str)):
            raise SpecError(f'{where}: special_values= is True, False or "strict", got {self.special_values!r:.60}')
        if not isinstance(self.tolerances, Mapping):
            raise SpecError(f"{where}: tolerances= must map dtypes to (atol, rtol), got {self.tolerances!r:.60}")
        tolerances = {}
        for d, tol in self.tolerances.items():
            dtype = as_dtype(d, f"{where}: tolerances=")
            tolerances[dtype] = check_tolerance(tol, f"{where}: tolerances[{str(dtype).removeprefix('torch.')}]")
        self.tolerances = tolerances
        if not callable(self.samples):
            got = f"{self.samples!r:.50}"
            raise SpecError(f"{where}: samples= must be a function (device, dtype, generator) yielding Sample(args), got {got}")
        if not isinstance(self.samples, CheckedSamples):
            self.samples = CheckedSamples(self.samples, f"{self.namespace}::{self.name}")

    @property
    def qualname(self) -> str:
        return f"{self.namespace}::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        try:
            return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload_name)
        except AttributeError:
            raise RuntimeError(
                f"{self.qualname}: no such operator in torch.ops; its C++ library is not loaded "
                f'or does not define it (TORCH_LIBRARY_FRAGMENT({self.namespace}, m) {{ m.def("{self.name}(...)"); }})'
            ) from None

    @property
    def schema(self) -> torch._C.FunctionSchema:
        return self.overload._schema

    @property
    def returns_tensor(self) -> bool:
        """Whether the schema returns a tensor (``-> ()`` returns none: an out= form writes its result instead)."""
        return any("Tensor" in str(r.type) for r in self.schema.returns)

    @property
    def differentiable(self) -> bool:
        """Whether gradients flow from what the operator returns: it returns a
        tensor, and has an autograd formula (this spec's, or its owner's)."""
        if not self.returns_tensor:
            return False
        if self.backward is not None:
            return True
        return self.owner_registered and owner_has_autograd(self.overload)

    @property
    def mutated_args(self) -> list[int]:
        """Positions of the arguments the schema marks as written (``Tensor(a!)``)."""
        return [i for i, a in enumerate(self.schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

    def signature(self) -> inspect.Signature:
        """The Python signature of the schema, defaults included."""
        params = []
        for a in self.schema.arguments:
            kind = inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            default = a.default_value if a.has_default_value() else inspect.Parameter.empty
            params.append(inspect.Parameter(a.name, kind, default=default))
        return inspect.Signature(params)

    def tolerance(self, dtype: torch.dtype, sample: Sample | None = None) -> tuple[float, float]:
        if sample is not None and self.sample_tolerance is not None:
            return check_tolerance(self.sample_tolerance(sample, dtype), f"spec of {self.qualname}: sample_tolerance= for [{sample.desc}]")
        found = self.tolerances.get(dtype)
        return found if found is not None else default_tolerance(dtype)


def owner_has_autograd(op: torch._ops.OpOverload) -> bool:
    """Whether gradients flow through ``op`` by a formula its owner registered:
    a ``torch.library.custom_op`` with ``register_autograd`` (every custom_op
    has an Autograd kernel, one that raises without a formula), or any other
    operator with an Autograd kernel of its own or a CompositeImplicitAutograd
    one (made of differentiable operators)."""
    opdef = _maybe_get_opdef(op)
    if opdef is not None:
        return opdef._backward_fn is not None
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in ("Autograd", "CompositeImplicitAutograd"))
