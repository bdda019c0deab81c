"""``opforge.spec``: a spec for an operator already in ``torch.ops``, from its
schema and a reference, with whatever else the user wants to say.

What the user leaves out is derived from the schema:

* samples: every Tensor argument one shape, across odd sizes ((), (1,), (7,),
  (3, 5), (33, 17)), a transposed layout, an empty one and one of 65539
  elements (past a kernel's first block or thread chunk, with an odd tail:
  only the reference check takes a sample that large); floating values drawn
  at random (normal), integer ones small, bool ones both ways; optional Tensor
  arguments a tensor and None by turns, Tensor lists two tensors; other
  arguments with a default keep it;
* bench cases: every Tensor argument 2^16 and 2^20 elements on the CPU, 2^20
  and 2^24 on a GPU;
* cost: the bytes of every input and output, a FLOP per output element;
* tolerances: ``DEFAULT_TOLERANCES`` per dtype (exact for integer dtypes);
* bad inputs: none (the report says that none are declared).

The fake kernel and the autograd formula are the operator's own: its owner
registered them (``torch.library.register_fake`` / ``register_autograd``, or
C++), and the spec registers nothing in their place (``OpSpec.owner_registered``).
Where the schema cannot be drawn from (an ``int[]``, a ``str``) or the
operator refuses one shape for all its tensors (a matmul), the error names the
arguments and asks for ``samples=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from opforge.opspec import DEFAULT_TOLERANCES, FLOAT_DTYPES, BadInput, Cost, OpSpec, Sample, SampleFn, as_dtypes, default_tolerance

# (description, shape); "transposed" takes the transpose of the shape's reverse, a view.
LAYOUTS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("scalar", ()),
    ("1", (1,)),
    ("7", (7,)),
    ("3x5", (3, 5)),
    ("33x17", (33, 17)),
    ("transposed 33x17", (33, 17)),
    ("empty 0", (0,)),
    # Past the sizes where kernels change path: more than one block of 1024 threads
    # or one CPU thread's chunk (32768), and an odd tail after any vector width.
    ("65539", (65539,)),
)
# Launch- and call-bound on a GPU (2^20) and past its L2 (2^24); on the CPU
# sizes that CI's two cores time in seconds.
BENCH_SIZES = {"cpu": (2**16, 2**20), "cuda": (2**20, 2**24)}
# The layout the operator is first called with, to learn whether it takes one
# shape for all its tensors: two dimensions, none of them 1.
_PROBE = "3x5"

_FIELDS = {f.name for f in dataclasses.fields(OpSpec) if f.init}
# Read from the operator itself.
_FROM_OPERATOR = ("name", "namespace", "overload_name")


class DeriveError(ValueError):
    """What the schema does not say, and the field of ``opforge.spec`` that would say it."""


def resolve(op: Any) -> torch._ops.OpOverload:
    """The OpOverload ``op`` names: an OpOverload, an OpOverloadPacket (its
    default overload), a ``torch.library.custom_op`` function, or a string
    ``"ns::name"`` / ``"ns::name.overload"``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._library.custom_ops.CustomOpDef):
        return op._opoverload
    if isinstance(op, torch._ops.OpOverloadPacket):
        overloads = op.overloads()
        # A default overload without a Tensor argument (aten::add's is add(Scalar a, Scalar b) -> Scalar) is never the one meant.
        takes_tensor = [o for o in overloads if any("Tensor" in str(a.type) for a in getattr(op, o)._schema.arguments)]
        if "default" in takes_tensor:
            return op.default
        names = ", ".join(f"{op._qualified_op_name}.{o}" for o in takes_tensor or overloads)
        if "default" in overloads:
            raise DeriveError(
                f"{op._qualified_op_name}: its default overload ({op.default._schema}) takes no Tensor; name the overload to check, "
                f"one of {names}"
            )
        raise DeriveError(f"{op._qualified_op_name} has no default overload; name one of {names}")
    if isinstance(op, str):
        namespace, sep, rest = op.partition("::")
        name, _, overload = rest.partition(".")
        if not sep or not namespace or not name:
            raise DeriveError(f"operator {op!r} is not a qualified name such as 'my_ns::my_op' (or 'my_ns::my_op.overload')")
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            raise DeriveError(f"{op!r}: no such operator in torch.ops; import the module that registers it first") from None
        if not overload:
            return resolve(packet)
        if overload not in packet.overloads():
            raise DeriveError(f"{op!r}: {namespace}::{name} has no overload {overload!r}; it has {', '.join(packet.overloads())}")
        return getattr(packet, overload)
    raise TypeError(
        f"opforge.spec: op must be an operator of torch.ops (torch.ops.my_ns.my_op.default) or its name ('my_ns::my_op'), "
        f"got {type(op).__name__} ({op!r:.60})"
    )


def spec(op: Any, *, reference: Callable[..., Any], **fields: Any) -> OpSpec:
    """An ``OpSpec`` for ``op``, an operator already in ``torch.ops``: the same
    type as the library's own specs and ``opforge new``'s, with what ``fields``
    leaves out derived from the schema (this module's docstring says how), its
    fake kernel and autograd formula the owner's. Any ``OpSpec`` field but the
    operator's name may be given::

        SPECS = [opforge.spec(torch.ops.my_ns.my_op.default, reference=lambda a, b: a * b + 1)]
    """
    overload = resolve(op)
    schema = overload._schema
    qualname = overload.name()
    if not callable(reference):
        raise TypeError(f"opforge.spec({qualname}): reference must be a function of the operator's arguments, got {reference!r:.60}")
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise TypeError(
            f"opforge.spec({qualname}): no OpSpec field named {', '.join(unknown)}; the fields are {', '.join(sorted(_FIELDS))}"
        )
    given = [k for k in _FROM_OPERATOR if k in fields]
    if given:
        raise TypeError(f"opforge.spec({qualname}): {', '.join(given)} come from the operator; leave them out")
    if "derived" in fields:
        raise TypeError(f"opforge.spec({qualname}): derived is what opforge.spec fills in (the fields left out); leave it out")
    owner = fields.setdefault("owner_registered", True)
    if owner and fields.get("jvp") is not None:
        raise DeriveError(
            f"opforge.spec({qualname}): jvp= is served by opforge's own autograd kernel, which an operator registered by "
            "its owner does not get (it would replace the owner's); give owner_registered=False for opforge to register "
            "its autograd kernel from backward= and jvp="
        )
    dtypes = fields["dtypes"] = as_dtypes(fields.get("dtypes", FLOAT_DTYPES), f"opforge.spec({qualname}): dtypes=")
    if not dtypes:
        raise DeriveError(f"opforge.spec({qualname}): dtypes=() leaves nothing to check; give at least one dtype")
    derived = [k for k in ("samples", "bench_cases", "cost", "tolerances") if k not in fields]
    drawn = [k for k in ("samples", "bench_cases") if k in derived]
    if drawn:
        _check_drawable(qualname, schema, drawn)
    if "samples" in derived:
        fields["samples"] = derived_samples(schema)
    if "bench_cases" in derived:
        fields["bench_cases"] = derived_bench_cases(schema)
    if "cost" in derived:
        fields["cost"] = derived_cost(overload)
    if "tolerances" in derived:
        fields["tolerances"] = derived_tolerances(dtypes)
    if "bad_inputs" not in fields:
        fields["bad_inputs"] = no_bad_inputs
        derived.append("bad_inputs")
    namespace, name = schema.name.split("::", 1)
    made = OpSpec(name=name, namespace=namespace, overload_name=overload._overloadname or "default", reference=reference,
                  derived=tuple(derived), **fields)  # fmt: skip
    if drawn:
        _probe(made, overload, dtypes[0], drawn)
    return made


def describe(spec: OpSpec) -> str:
    """What was derived for ``spec``, in a line for the reports; "" when nothing was."""
    words = {"samples": "samples", "bench_cases": "bench cases", "cost": "cost", "tolerances": "tolerances"}
    parts = [words[k] for k in spec.derived if k in words]
    said = []
    if parts:
        listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
        said.append(f"{listed} derived from the schema")
    if "bad_inputs" in spec.derived:
        said.append("no bad inputs declared")
    return "; ".join(said)


def no_bad_inputs(device: torch.device) -> list[BadInput]:
    """A derived spec's bad inputs: none; which calls an operator must refuse is not in its schema."""
    return []


# --- drawing arguments ---


def _kind(arg: torch._C.Argument) -> str:
    """How a derived call fills ``arg``: "tensor", "optional tensor", "tensors", "none", "float",
    "int", "bool", "dtype", "device", "default", or "" (it cannot)."""
    real = str(arg.real_type)
    if real == "Tensor":
        return "tensor"
    if real == "Optional[Tensor]":
        return "optional tensor"  # None and a tensor, by turns
    if real in ("List[Tensor]", "List[Optional[Tensor]]"):
        return "tensors"
    if real == "bool":
        return "bool"  # both ways, default or not
    if arg.has_default_value():
        return "default"
    if real.startswith("Optional["):
        return "none"
    return {"float": "float", "number": "float", "int": "int", "SymInt": "int", "ScalarType": "dtype", "Device": "device"}.get(real, "")


def _check_drawable(qualname: str, schema: torch._C.FunctionSchema, drawn: Sequence[str]) -> None:
    fix = " and ".join(f"{k}=" for k in drawn)
    for a in schema.arguments:
        if not _kind(a):
            raise DeriveError(
                f"{qualname}: cannot derive {' or '.join(drawn)} from the schema: argument {a.name!r} is a {a.real_type}, "
                f"which opforge does not draw at random; give {fix} (a function (device, dtype, generator) yielding "
                "opforge.spec's Sample(args))"
            )
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
            raise DeriveError(
                f"{qualname}: cannot derive {' or '.join(drawn)} from the schema: argument {a.name!r} is keyword-only and "
                f"written by the operator, and opforge's checks take written arguments by position; give {fix}"
            )
    if not any(_kind(a) in ("tensor", "tensors") for a in schema.arguments):
        raise DeriveError(f"{qualname}: cannot derive {' or '.join(drawn)}: the schema has no Tensor argument to draw; give {fix}")


def _tensor(
    shape: tuple[int, ...], transposed: bool, device: torch.device, dtype: torch.dtype, gen: torch.Generator | None
) -> torch.Tensor:
    """Fresh random values of ``dtype`` (normal for floating types, never all
    zeros; small integers; both bools), laid out as asked. Floating values are
    drawn at ``dtype``'s own precision (float64 with all 53 bits), half types in
    float32 and rounded once."""
    base = tuple(reversed(shape)) if transposed else shape
    if device.type == "meta":  # bench's case names: sizes only
        t = torch.empty(base, dtype=dtype, device=device)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, base, generator=gen, device=device).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        draw = dtype if dtype in (torch.float64, torch.float32) or dtype.is_complex else torch.float32
        t = torch.randn(base, generator=gen, device=device, dtype=draw).to(dtype)
    else:
        t = torch.randint(-8 if dtype.is_signed else 0, 9, base, generator=gen, device=device, dtype=dtype)
    return t.t() if transposed else t


def _scalar(kind: str, device: torch.device, gen: torch.Generator | None) -> float | int:
    """A float in [0.5, 2) or an int in 1..4: the argument's meaning is unknown,
    and a positive value of order one suits most (a scale, an epsilon's
    stand-in, a count), where zero or a negative one would often be refused."""
    if device.type == "meta":
        return 1.0 if kind == "float" else 1
    u = float(torch.rand((), generator=gen, device=device, dtype=torch.float64))
    return 0.5 + 1.5 * u if kind == "float" else 1 + int(4 * u)


def _call(
    schema: torch._C.FunctionSchema,
    shape: tuple[int, ...],
    transposed: bool,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator | None,
    index: int,
    desc: str,
) -> Sample:
    """One derived call: every Tensor argument ``shape``; the bools of call
    ``index`` (bits of it, so that a few calls give each bool both values), its
    optional tensors a tensor or None (even or odd ``index``)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pending: list[Any] = []  # defaults of positional arguments left out, passed only if a later one is given
    drawn: list[str] = []  # what the description names: each optional tensor's and bool's value
    n_bool = 0
    for a in schema.arguments:
        kind = _kind(a)
        value: Any
        if kind == "default":
            if not a.kwarg_only:
                pending.append(a.default_value)
            continue
        if kind == "tensor":
            value = _tensor(shape, transposed, device, dtype, gen)
        elif kind == "optional tensor":
            # A tensor in the even calls (the first, which probes the operator, included), None in the odd ones.
            value = None if index % 2 else _tensor(shape, transposed, device, dtype, gen)
            drawn.append(f"{a.name}={'None' if value is None else 'tensor'}")
        elif kind == "tensors":
            value = [_tensor(shape, transposed, device, dtype, gen) for _ in range(2)]
        elif kind == "none":
            value = None
        elif kind in ("float", "int"):
            value = _scalar(kind, device, gen)
        elif kind == "bool":
            value = bool((index >> (n_bool % 3)) & 1)
            n_bool += 1
            drawn.append(f"{a.name}={value}")
        elif kind == "dtype":
            value = dtype
        else:  # device
            value = device
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args += [*pending, value]
            pending = []
    return Sample(tuple(args), kwargs, ", ".join([desc, *drawn]))


def derived_samples(schema: torch._C.FunctionSchema) -> SampleFn:
    """A spec's ``samples``: one call per layout of ``LAYOUTS``."""

    def samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for k, (desc, shape) in enumerate(LAYOUTS):
            yield _call(schema, shape, desc.startswith("transposed"), device, dtype, gen, k, desc)

    return samples


def derived_bench_cases(schema: torch._C.FunctionSchema) -> SampleFn:
    """A spec's ``bench_cases``: every Tensor argument contiguous, of each size in ``BENCH_SIZES``."""

    def cases(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for n in BENCH_SIZES["cpu" if device.type == "cpu" else "cuda"]:
            yield _call(schema, (n,), False, device, dtype, gen, 0, f"2^{n.bit_length() - 1}")

    return cases


def derived_tolerances(dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, tuple[float, float]]:
    """``DEFAULT_TOLERANCES``; a complex dtype its real part's, integer and bool dtypes exact."""
    out = dict(DEFAULT_TOLERANCES)
    for d in dtypes:
        out[d] = default_tolerance(d)
    return out


# --- cost ---


def _all_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _all_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _all_tensors(o)]
    return []


def _outputs(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``op`` returns for these arguments: on fake tensors (nothing computed)
    where it has a fake kernel, else by calling it."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            return op(*fake_args, **fake_kwargs)
    except Exception:  # noqa: BLE001 - no fake kernel, or one that fails: the operator itself says
        with torch.no_grad():
            return op(*args, **kwargs)


def derived_cost(op: torch._ops.OpOverload) -> Callable[..., Cost]:
    """A spec's ``cost``: every input read once and every output written once
    (an argument the operator writes counts once), a FLOP per output element."""
    schema = op._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    # Returned aliases of the inputs (an out= form's result) are already counted as inputs.
    fresh = [r.alias_info is None for r in schema.returns]

    def cost(*args: Any, **kwargs: Any) -> Cost:
        result = _outputs(op, args, kwargs)
        results = result if len(schema.returns) > 1 else (result,)
        made = [t for keep, r in zip(fresh, results, strict=False) if keep for t in _all_tensors(r)]
        overwritten = [t for i in written if i < len(args) for t in _all_tensors(args[i])]
        nbytes = sum(t.numel() * t.element_size() for t in (*_all_tensors((args, kwargs)), *made))
        return Cost(bytes=nbytes, flops=sum(t.numel() for t in (*made, *overwritten)))

    return cost


# --- the first call ---


def has_kernel_for(op: torch._ops.OpOverload, device_type: str) -> bool:
    """Whether ``op`` runs on ``device_type`` ("cpu", "cuda"): a kernel for it, or one for every device."""
    keys = (device_type.upper(), "CompositeExplicitAutograd", "CompositeImplicitAutograd")
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in keys)


# Called with the operator's name before each first call: a process that loads spec files for another
# (opforge check's) says which operator's call it was in when that call kills it.
_PROBE_WATCHERS: list[Callable[[str], None]] = []


@contextlib.contextmanager
def watching_probes(watcher: Callable[[str], None]) -> Iterator[None]:
    """``watcher(qualified name)`` before each first call ``opforge.spec`` makes of an operator, meanwhile."""
    _PROBE_WATCHERS.append(watcher)
    try:
        yield
    finally:
        _PROBE_WATCHERS.remove(watcher)


def _probe(spec: OpSpec, op: torch._ops.OpOverload, dtype: torch.dtype, drawn: Sequence[str]) -> None:
    """Calls the operator once with every Tensor argument 3x5, so that one whose
    inputs need shapes of their own (a matmul's) is told here, with its
    arguments named, rather than failing every check. On the CPU, or on a GPU
    for an operator with CUDA kernels only; not at all where neither runs it (a
    fake kernel is no judge: it may refuse a device its operator takes)."""
    device = next((d for d in ("cpu", "cuda") if has_kernel_for(op, d) and (d == "cpu" or torch.cuda.is_available())), None)
    if device is None:
        return
    where = torch.device(device)
    shape = dict(LAYOUTS)[_PROBE]
    sample = _call(spec.schema, shape, False, where, dtype, torch.Generator(device=where).manual_seed(0), 0, _PROBE)
    for watcher in _PROBE_WATCHERS:
        watcher(op.name())
    try:
        with torch.no_grad():
            op(*sample.args, **sample.kwargs)
    except Exception as exc:  # noqa: BLE001 - any refusal means the derived inputs do not fit
        tensors = [a.name for a in spec.schema.arguments if _kind(a) in ("tensor", "optional tensor", "tensors")]
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fix = " and ".join(f"{k}=" for k in drawn)
        raise DeriveError(
            f"{op.name()}: the operator refuses the inputs derived from its schema, every Tensor argument "
            f"({', '.join(tensors)}) one shape ({'x'.join(map(str, shape))}, {str(dtype).removeprefix('torch.')}, {device}): "
            f"{type(exc).__name__}: {message}. Where its arguments need shapes of their own (as a matmul's do), give {fix} "
            "(a function (device, dtype, generator) yielding opforge.spec's Sample(args))"
        ) from None


__all__ = [
    "BENCH_SIZES",
    "LAYOUTS",
    "DeriveError",
    "derived_bench_cases",
    "derived_cost",
    "derived_samples",
    "derived_tolerances",
    "describe",
    "has_kernel_for",
    "no_bad_inputs",
    "resolve",
    "spec",
    "watching_probes",
]
