"""The public function of an operator (``opforge.<name>``, ``OpSpec.function``):
the eager fast path (opforge.fast) when it applies, else the dispatcher."""

from __future__ import annotations

import dis
import inspect
import keyword
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opforge import fast as fast_path
from opforge.arguments import check_number_arguments, check_tensor_arguments
from opforge.fast import Context

if TYPE_CHECKING:
    from opforge.opspec import OpSpec


def public_function(spec: OpSpec) -> Callable[..., Any]:
    """``opforge.<name>``: the eager fast path when it applies (opforge.fast),
    else the dispatcher (torch.ops), which also serves torch.compile and export."""
    op = spec.overload
    # The fast-path callable, set when the module attaches (now, or when its
    # background build finishes). An owner's operator is called through
    # torch.ops (or the owner's own function over it), so that is what
    # `opforge bench` times for it.
    # Until then (or for an operator it cannot call) a stand-in that always declines, so that a
    # call reads one closure variable and tests nothing else.
    fast: Any = _declined

    def bind(module: Any) -> None:
        nonlocal fast
        bound = module.fast_op(spec.qualname)
        if bound is not None and spec.backward is not None and spec.setup_context is not None and _fast_can_call(spec.setup_context):
            setup = None if _does_nothing(spec.setup_context) else spec.setup_context
            saves = _saves_one(spec.setup_context)
            if saves is None:
                tensors = [isinstance(a.type, torch._C.TensorType) for a in op._schema.arguments]
                saves = _sets_attributes(spec.setup_context, tensors)
            bound.set_autograd(setup, spec.backward, Context, saves)
        fast = bound if bound is not None else _declined
        fn._opforge_fast = bound  # type: ignore[attr-defined]

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            # The dispatcher's words for a None or a number where a tensor is
            # due ("no fallback function is registered") blame the operator's
            # writer, and for a number out of a double's range speak of its
            # type ("found type 'int'"); name the argument and value instead.
            check_tensor_arguments(spec, args, kwargs)
            check_number_arguments(spec, args, kwargs)
            raise

    # Dynamo folds is_dynamo_compiling() to True while tracing (graphs and
    # torch.export get the dispatcher op); eagerly it is a bare return, where
    # is_compiling() costs 8-10 us on a cold call (2^16-element adds on the CPU).
    is_compiling = torch.compiler.is_dynamo_compiling

    def fn(*args: Any, **kwargs: Any) -> Any:
        # is_compiling() first: under Dynamo `fast` is never read, so no guard is made on the
        # fast path's object (a C++ one Dynamo cannot guard on).
        if not kwargs and not is_compiling():
            out = fast(*args)
            if out is not NotImplemented:
                return out
        return dispatch(*args, **kwargs)

    exact = _exact_signature_function(spec, dispatch, is_compiling)
    if exact is not None:
        fn, namespace = exact

        def bind_exact(module: Any) -> None:
            bind(module)
            namespace["_of_fast"] = fast

        bind_at_attach = bind_exact
    else:
        bind_at_attach = bind

    fn._opforge_fast = None  # type: ignore[attr-defined]
    if not spec.owner_registered:
        fast_path.on_attach(bind_at_attach)

    fn.__name__ = fn.__qualname__ = spec.name
    fn.__module__ = spec.namespace
    fn.__signature__ = spec.signature()  # type: ignore[attr-defined]
    fn.__doc__ = f"{spec.doc.strip()}\n\nSchema: {spec.schema}\n"
    return fn


_MISSING = object()


def _exact_signature_function(
    spec: OpSpec, dispatch: Callable[..., Any], is_compiling: Callable[[], bool]
) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """The public function with the schema's own parameters (a required one defaults to a
    sentinel), and the namespace whose ``_of_fast`` it calls: CPython calls a function of plain
    parameters without building an argument tuple and dict, which ``*args, **kwargs`` needs on
    every call. A missing argument, or a call the fast path declines, goes to ``dispatch`` with the
    arguments given, as the generic function passes them. None where the schema does not fit
    (keyword-only arguments, or names Python cannot take as parameters)."""
    names = [a.name for a in spec.schema.arguments]
    if any(a.kwarg_only for a in spec.schema.arguments) or not all(
        n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_of_") for n in names
    ):
        return None
    defaults = [a.default_value if a.has_default_value() else _MISSING for a in spec.schema.arguments]
    required = [n for n, d in zip(names, defaults, strict=True) if d is _MISSING]
    params = ", ".join(f"{n}=_of_defaults[{i}]" for i, n in enumerate(names))
    given = " and ".join(f"{n} is not _of_missing" for n in required) or "True"
    call = ", ".join(names)
    code = (
        f"def {spec.name}({params}):\n"
        # Dynamo folds _of_compiling() to True, so _of_fast is never read while tracing.
        f"    if {given} and not _of_compiling():\n"
        f"        _of_out = _of_fast({call})\n"
        "        if _of_out is not NotImplemented:\n"
        "            return _of_out\n"
        f"    if {given}:\n"
        f"        return _of_dispatch({call})\n"
        f"    return _of_dispatch(**{{_of_n: _of_v for _of_n, _of_v in zip({names!r}, ({call},)) if _of_v is not _of_missing}})\n"
    )
    namespace: dict[str, Any] = {
        "_of_defaults": defaults,
        "_of_missing": _MISSING,
        "_of_compiling": is_compiling,
        "_of_dispatch": dispatch,
        "_of_fast": _declined,
        "NotImplemented": NotImplemented,
    }
    exec(compile(code, f"<opforge.{spec.name}>", "exec"), namespace)
    return namespace[spec.name], namespace


def _nothing(ctx: Any, inputs: Any, output: Any) -> None:
    pass


def _does_nothing(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a plain function whose body is ``pass``: the fast path then skips calling it
    (and building its ``inputs``) on every call that records a gradient."""
    return _same_code(fn, _nothing)


def _save_output(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(output)


def _save_input(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(inputs[0])


def _same_code(fn: Callable[..., Any], ref: Callable[..., Any], consts: tuple[Any, ...] | None = None) -> bool:
    code = getattr(fn, "__code__", None)
    want = ref.__code__
    return (
        code is not None
        and code.co_code == want.co_code
        and code.co_consts == (want.co_consts if consts is None else consts)
        and code.co_names == want.co_names
        and code.co_argcount == want.co_argcount
        and code.co_varnames[: code.co_argcount] == want.co_varnames[: want.co_argcount]
        and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
        and getattr(fn, "__kwdefaults__", None) is None
    )


def _saves_one(fn: Callable[..., Any]) -> str | int | None:
    """What ``fn`` saves when its whole body is ``ctx.save_for_backward(output)`` ("output") or
    ``ctx.save_for_backward(inputs[i])`` (i): the fast path then saves that tensor itself instead
    of calling it on every call that records a gradient. None for any other setup_context."""
    if _same_code(fn, _save_output):
        return "output"
    code = getattr(fn, "__code__", None)
    ref = _save_input.__code__.co_consts
    if code is None or len(code.co_consts) != len(ref):
        return None
    # The reference's constant 0 is the index: any other index is the same code with another constant.
    at = ref.index(0)
    i = code.co_consts[at]
    if type(i) is int and i >= 0 and _same_code(fn, _save_input, (*ref[:at], i, *ref[at + 1 :])):
        return i
    return None


# What torch's ctx has already: a setup_context that sets one of them fails there, or acts on the graph.
_TORCH_CTX = frozenset(dir(torch.autograd.function.BackwardCFunction))
# Python 3.13's instructions that do two of one kind at once, and 3.12-3.14's variants of LOAD_FAST.
_PAIRS = {"STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST"), "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
          "LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST")}  # fmt: skip
_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")


def _fast_can_call(fn: Callable[..., Any]) -> bool:
    """Whether the fast path may record ``fn``'s gradient itself: torch calls a
    setup_context as ``fn(ctx=, inputs=, output=)`` and raises where it cannot
    be called so; one that sets an attribute torch's ctx has (``saved_tensors``,
    ``needs_input_grad``) fails there or acts on the graph. Such calls go
    through torch.ops, which does what torch does."""
    try:
        inspect.signature(fn).bind(ctx=None, inputs=None, output=None)
    except (TypeError, ValueError):
        return False
    code = getattr(fn, "__code__", None)
    return code is None or not any(i.opname == "STORE_ATTR" and i.argval in _TORCH_CTX for i in dis.get_instructions(code))


def _instructions(code: Any) -> list[tuple[str, Any]]:
    """(name, argument) of ``code``'s instructions, Python 3.13's pairs split, loads of a local all LOAD_FAST."""
    found: list[tuple[str, Any]] = []
    for i in dis.get_instructions(code):
        if i.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG"):
            continue
        if i.opname in _PAIRS:
            found += list(zip(_PAIRS[i.opname], i.argval, strict=True))
        else:
            found.append(("LOAD_FAST" if i.opname in _LOADS else i.opname, i.argval))
    return found


def _sets_attributes(fn: Callable[..., Any], tensors: Sequence[bool]) -> tuple[tuple[str, int], ...] | None:
    """The (attribute, position) pairs when ``fn``'s whole body is one unpacking of its inputs,
    one target per argument (``tensors``: per argument, whether it is a tensor), each a plain name
    or an attribute of the ctx set to a non-tensor argument (``_, _, ctx.alpha, ctx.beta = inputs``):
    the fast path then keeps those arguments and sets them on the ctx when a backward runs, instead
    of calling ``fn`` on every call that records a gradient. Read from the code that runs (its
    instructions), never from a source file that may differ. None for any other setup_context (a
    tensor kept as an attribute, which would escape the saved tensors' checks; an attribute torch's
    ctx has; parameters other than torch's ctx, inputs, output)."""
    code = getattr(fn, "__code__", None)
    if (
        code is None
        or code.co_argcount != 3
        or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
        or code.co_varnames[:3] != ("ctx", "inputs", "output")
        or code.co_freevars
    ):
        return None
    steps = _instructions(code)
    if steps[:2] != [("LOAD_FAST", "inputs"), ("UNPACK_SEQUENCE", len(tensors))]:
        return None
    if steps[-1:] == [("RETURN_CONST", None)]:
        body = steps[2:-1]
    elif steps[-2:] == [("LOAD_CONST", None), ("RETURN_VALUE", None)]:
        body = steps[2:-2]
    else:
        return None
    pairs: list[tuple[str, int]] = []
    k = 0
    for i, is_tensor in enumerate(tensors):
        if k < len(body) and body[k][0] == "STORE_FAST" and body[k][1] not in ("ctx", "inputs", "output"):
            k += 1
        elif body[k : k + 2] == [("LOAD_FAST", "ctx"), ("STORE_ATTR", body[k + 1][1] if k + 1 < len(body) else None)]:
            attr = body[k + 1][1]
            if is_tensor or attr in _TORCH_CTX:
                return None
            pairs.append((attr, i))
            k += 2
        else:
            return None
    return tuple(pairs) or None if k == len(body) else None


def _declined(*args: Any) -> Any:
    """The fast path's place before it attaches: every call goes to the dispatcher."""
    return NotImplemented
