"""Sharding: how an operator runs on DTensor (tensor, sequence and data parallel).

A spec declares its sharding strategies in its ``sharding`` field, in one of three forms:

* ``"pointwise"``: elementwise over tensors of one shape; any placement that all its tensor
  arguments share runs on the local shards: ``Shard(d)`` on any dim (uneven shards included) or
  ``Replicate()``;
* ``"pointwise-linear"``: the same, and linear in its tensor arguments together
  (``f(x1 + x2) = f(x1) + f(x2)``), so that ``Partial()`` in gives ``Partial()`` out;
* a function in the form of ``torch.distributed.tensor.experimental.register_sharding``'s: it
  takes the operator's arguments (each tensor replaced by DTensor's spec of it, which has
  ``shape``, ``ndim`` and ``placements``) and returns the acceptable strategies for one mesh
  dimension, each a pair ``(output placements, input placements)``: one placement per output of
  the schema, and one per argument in the schema's order (``None`` for an argument that is not a
  tensor or is None; trailing ones may be left out). DTensor expands them over every mesh dimension.

``register(spec)`` gives DTensor the spec's strategies when the operator registers, without
importing DTensor (a second and more on import): where ``torch.distributed.tensor`` is not imported
yet, it is given them the moment it is. A torch built without distributed gets nothing.

What ``register_sharding`` itself leaves out is handled here: an argument that DTensor does not
redistribute (one the operator writes, as ``add_out``'s ``out``, or a keyword-only tensor) keeps
its placement, so only strategies that keep it are offered; the non-tensor arguments are part of
DTensor's cache key (an ``output_mask`` changes the outputs' shapes).

``opforge check`` verifies every declared strategy against the reference
(``opforge.check.sharding``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from opforge.opspec import OpSpec

POINTWISE = "pointwise"
POINTWISE_LINEAR = "pointwise-linear"
WORDS = (POINTWISE, POINTWISE_LINEAR)

# (output placements, input placements by schema argument), for one mesh dimension.
Row = tuple[tuple[Any, ...], tuple[Any, ...]]

_DTENSOR = "torch.distributed.tensor"
_pending: list[OpSpec] = []
_registered: dict[str, OpSpec] = {}
_lock = threading.RLock()


def available() -> bool:
    """Whether this torch has DTensor (torch.distributed)."""
    return torch.distributed.is_available()


def validate(spec: OpSpec) -> None:
    """Raises ValueError naming the operator if its ``sharding`` is neither a word nor a function."""
    s = spec.sharding
    if s is None or callable(s):
        return
    if isinstance(s, str) and s in WORDS:
        return
    raise ValueError(
        f"{spec.qualname}: sharding must be {' or '.join(repr(w) for w in WORDS)}, or a function in register_sharding's form "
        f"(the operator's arguments -> [(output placements, input placements), ...]), got {s!r:.60}"
    )


def is_linear(spec: OpSpec) -> bool:
    return spec.sharding == POINTWISE_LINEAR


def describe(spec: OpSpec) -> str:
    """How the spec declares its sharding, for reports: ``pointwise``, ``function``, or ``none``."""
    if spec.sharding is None:
        return "none"
    return spec.sharding if isinstance(spec.sharding, str) else "function"


# --- the declared strategies of one call ---


def _tensor_returns(spec: OpSpec) -> int:
    return len(spec.schema.returns)


def _is_spec(x: Any) -> bool:
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding); a strategy runs after DTensor's import
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(x, DTensorSpec)


def by_position(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """One call's arguments by schema position (keyword ones in their place, None for the absent)."""
    names = [a.name for a in spec.schema.arguments]
    out = list(args) + [None] * (len(names) - len(args))
    for k, v in kwargs.items():
        out[names.index(k)] = v
    return out


def pointwise_rows(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any], *, linear: bool) -> list[Row]:
    """``"pointwise"``'s strategies for one call: every tensor argument and output in
    ``Shard(d)`` for each dim d, or all ``Replicate()``; all ``Partial()`` too when ``linear``.
    Tensors of different shapes (broadcasting) shard nowhere."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Partial, Replicate, Shard

    names = [a.name for a in spec.schema.arguments]
    by_pos = by_position(spec, args, kwargs)
    tensors = [i for i, a in enumerate(by_pos) if _is_spec(a)]
    n_out = _tensor_returns(spec)
    shapes = {tuple(by_pos[i].shape) for i in tensors}

    def row(p: Any) -> Row:
        return (p,) * n_out, tuple(p if i in tensors else None for i in range(len(names)))

    rows = [row(Replicate())]
    if len(shapes) == 1:
        rows += [row(Shard(d)) for d in range(len(next(iter(shapes))))]
    if linear:
        rows.append(row(Partial()))
    return rows


class DeclarationError(ValueError):
    """A sharding function that raised, or returned what is not strategies: the message names the
    operator and what is wrong, for ``opforge check`` and for DTensor, which calls it at run time."""


_PLACEMENTS = "placements are torch.distributed.tensor's Shard(dim), Replicate() and Partial()"


def _placements(spec: OpSpec, k: int, what: str, given: Any) -> tuple[Any, ...]:
    """Strategy ``k``'s output or input placements as a tuple, each a Placement or None."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding); a strategy runs after DTensor's import
    from torch.distributed.tensor.placement_types import Placement

    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise DeclarationError(
            f"{spec.qualname}: sharding strategy {k} gives {given!r:.60} as its {what} placements; "
            f"they must be a list, one per {'output' if what == 'output' else 'argument'}"
        )
    for p in given:
        if p is not None and not isinstance(p, Placement):
            raise DeclarationError(
                f"{spec.qualname}: the sharding function returned {p!r:.60} among strategy {k}'s {what} placements; {_PLACEMENTS}"
            )
    return tuple(given)


def _check_dims(spec: OpSpec, k: int, ins: tuple[Any, ...], by_pos: list[Any]) -> None:
    """Every Shard(d) of a tensor argument names one of its dimensions."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Shard

    names = [a.name for a in spec.schema.arguments]
    for i, p in enumerate(ins):
        if isinstance(p, Shard) and _is_spec(by_pos[i]) and not -by_pos[i].ndim <= p.dim < by_pos[i].ndim:
            n = by_pos[i].ndim
            raise DeclarationError(
                f"{spec.qualname}: sharding strategy {k} gives Shard({p.dim}) for argument {names[i]}, "
                f"which has {n} dimension{'' if n == 1 else 's'} (shape {list(by_pos[i].shape)})"
            )


def declared_rows(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Row]:
    """The spec's strategies for one call (tensors given as DTensor specs), each
    ``(output placements, input placements by schema argument)``, checked for shape.
    Raises DeclarationError, naming the operator, where its function raises or returns
    what is not strategies."""
    decl = spec.sharding
    if decl is None:
        return []
    if isinstance(decl, str):
        return pointwise_rows(spec, args, kwargs, linear=decl == POINTWISE_LINEAR)
    n_args = len(spec.schema.arguments)
    n_out = _tensor_returns(spec)
    try:
        returned = decl(*args, **kwargs)
    except Exception as exc:  # the user's function: said as such, naming the operator
        first = str(exc).strip().splitlines()
        raise DeclarationError(
            f"{spec.qualname}: the sharding function raised {type(exc).__name__}{': ' + first[0] if first else ''}"
        ) from exc
    if isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
        raise DeclarationError(
            f"{spec.qualname}: the sharding function returned {returned!r:.60}; "
            "it must return a list of (output placements, input placements)"
        )
    by_pos = by_position(spec, args, kwargs)
    rows: list[Row] = []
    for k, entry in enumerate(returned):
        try:
            outs, ins = entry
        except (TypeError, ValueError):
            raise DeclarationError(
                f"{spec.qualname}: sharding strategy {k} must be a pair (output placements, input placements), got {entry!r:.80}"
            ) from None
        outs, ins = _placements(spec, k, "output", outs), _placements(spec, k, "input", ins)
        if len(outs) != n_out:
            raise DeclarationError(
                f"{spec.qualname}: sharding strategy {k} gives {len(outs)} output placements, the schema has {n_out} outputs: {outs}"
            )
        if len(ins) > n_args:
            raise DeclarationError(
                f"{spec.qualname}: sharding strategy {k} gives {len(ins)} input placements, the schema has {n_args} arguments: {ins}"
            )
        _check_dims(spec, k, ins, by_pos)
        rows.append((outs, ins + (None,) * (n_args - len(ins))))
    return rows


def tensor_positions(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    """Schema positions of the tensors of one call, in DTensor's order: the positional ones, then the keyword ones."""
    names = [a.name for a in spec.schema.arguments]
    return [i for i, a in enumerate(args) if _is_spec(a)] + [names.index(k) for k, v in kwargs.items() if _is_spec(v)]


def fixed_positions(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> set[int]:
    """Schema positions of the tensors that DTensor runs the operator on as they are, never
    redistributed: the ones it writes, and keyword arguments (DTensor redistributes positional
    arguments only; a keyword-only tensor keeps its placement)."""
    names = [a.name for a in spec.schema.arguments]
    return set(spec.mutated_args) | {names.index(k) for k, v in kwargs.items() if _is_spec(v)}


# --- DTensor's side ---


def _strategy(spec: OpSpec, op_schema: Any) -> Any:
    """DTensor's strategy function for ``spec``: the declared strategies of this call
    expanded over the mesh, less those that would move an argument DTensor does not move."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding); a strategy runs after DTensor's import
    from torch.distributed.tensor._op_schema import OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def to_spec(s: Any) -> Any:
        if isinstance(s, OpStrategy):
            return s.strategies[0].output_spec
        if isinstance(s, TupleStrategy):
            return tuple(to_spec(c) for c in s.children)
        return s

    mesh = op_schema.get_mesh_from_args()
    args = tuple(to_spec(a) for a in op_schema.args_schema)
    kwargs = {k: to_spec(v) for k, v in op_schema.kwargs_schema.items()}
    names = [a.name for a in spec.schema.arguments]
    order = tensor_positions(spec, args, kwargs)
    by_pos = by_position(spec, args, kwargs)
    flat = []
    for outs, ins in declared_rows(spec, args, kwargs):
        missing = [names[i] for i in order if ins[i] is None]
        if missing:
            raise ValueError(f"{spec.qualname}: a sharding strategy gives no placement for the tensor argument {', '.join(missing)}: {ins}")
        flat.append([*outs, *(ins[i] for i in order)])
    if not flat:
        raise NotImplementedError(f"{spec.qualname}: its sharding function declares no strategy for these arguments")
    expanded = expand_to_full_mesh_op_strategy(mesh, op_schema, flat, input_index=_tensor_returns(spec))
    fixed = fixed_positions(spec, args, kwargs)
    keep_at = [(j, by_pos[i].placements) for j, i in enumerate(order) if i in fixed]
    kept = [s for s in expanded.strategies if all(tuple(s.input_specs[j].placements) == tuple(p) for j, p in keep_at)]
    if not kept:
        held = ", ".join(f"{names[order[j]]} {tuple(p)}" for j, p in keep_at)
        raise RuntimeError(
            f"{spec.qualname}: no declared sharding strategy keeps {held} where it is, and DTensor cannot move "
            f"{'it' if len(keep_at) == 1 else 'them'} (an argument the operator writes, or a keyword argument); "
            f"the declared strategies: {[tuple(str(p) for p in r) for r in flat]}"
        )
    return OpStrategy(kept)


def _schema_info(spec: OpSpec) -> Any:
    """Every non-tensor argument in DTensor's cache key (alpha, group_size, output_mask: they may
    change what the outputs are), and pytree flattening where a tensor list is an argument."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    arguments = spec.schema.arguments
    non_tensor = [i for i, a in enumerate(arguments) if not _tensor_type(a.type)]
    static_argnum = min(non_tensor) if non_tensor else 100
    kwarg_keys = [a.name for a in arguments if a.kwarg_only and not _tensor_type(a.type)]
    needs_pytree = any(isinstance(a.type, torch.ListType) and _tensor_type(a.type.getElementType()) for a in arguments)
    return RuntimeSchemaInfo(static_argnum, kwarg_keys or None, needs_pytree=needs_pytree)


def _tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _register_now(spec: OpSpec) -> None:
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.register_op_strategy(spec.overload, partial(_strategy, spec), _schema_info(spec))
    # A strategy registered again (a spec file loaded twice) must not answer from the old one's cache.
    clear = getattr(propagator.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()
    _registered[spec.qualname] = spec


def _flush() -> None:
    with _lock:
        while _pending:
            _register_now(_pending.pop(0))


def _dtensor_loaded() -> bool:
    module = sys.modules.get(_DTENSOR)
    # Fully imported: the module's own import has bound DTensor (a partly imported one has not yet).
    return module is not None and hasattr(module, "DTensor")


def register(spec: OpSpec) -> None:
    """Gives DTensor ``spec``'s strategies: now if DTensor is imported, else the moment it is."""
    validate(spec)
    if spec.sharding is None or not available():
        return
    with _lock:
        _pending.append(spec)
        if _dtensor_loaded():
            _flush()
        else:
            _install_hook()


def registered(qualname: str) -> bool:
    """Whether DTensor has been given the strategies of ``qualname`` (false while DTensor is not imported)."""
    return qualname in _registered


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch.distributed.tensor`` as the other finders do, and registers the pending
    strategies once its module has run: DTensor costs a second or more to import, which
    ``import opforge`` does not pay."""

    def __init__(self) -> None:
        self._spec: importlib.machinery.ModuleSpec | None = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DTENSOR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            found = finder.find_spec(fullname, path, target)
            if found is not None and found.loader is not None:
                self._spec = found
                wrapped = importlib.machinery.ModuleSpec(
                    fullname, self, origin=found.origin, is_package=found.submodule_search_locations is not None
                )
                wrapped.submodule_search_locations = found.submodule_search_locations
                wrapped.has_location = found.has_location
                wrapped.cached = found.cached
                return wrapped
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        assert self._spec is not None and self._spec.loader is not None
        return self._spec.loader.create_module(self._spec)

    def exec_module(self, module: Any) -> None:
        assert self._spec is not None and self._spec.loader is not None
        # The module is the real loader's to run: give it the real spec (its __spec__, __loader__).
        module.__spec__ = self._spec
        module.__loader__ = self._spec.loader
        self._spec.loader.exec_module(module)
        _remove_hook()
        _flush()


_hook: _AfterImport | None = None


def _install_hook() -> None:
    global _hook
    if _hook is None:
        _hook = _AfterImport()
        sys.meta_path.insert(0, _hook)


def _remove_hook() -> None:
    global _hook
    with _lock:
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None


def ensure_registered() -> None:
    """Imports DTensor and registers every pending strategy (for the check, which needs them now)."""
    # lazy: import time (torch.distributed.tensor, 0.75 s): loaded here on purpose, for the check
    import torch.distributed.tensor  # noqa: F401 - the hook (or the line below) registers them

    _flush()


__all__ = [
    "POINTWISE",
    "POINTWISE_LINEAR",
    "DeclarationError",
    "by_position",
    "declared_rows",
    "describe",
    "ensure_registered",
    "is_linear",
    "pointwise_rows",
    "register",
    "registered",
    "validate",
]
