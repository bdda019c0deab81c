"""The eager fast path of the public functions (csrc/fast/fast_python.cpp):
the same answers and errors as torch.ops, and the full path wherever the fast
one may not go (gradients, keywords, subclasses, modes, torch.compile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge.check.run import generator
from opforge.registry import all_specs

from .conftest import DEVICES, SRC, cache_with_library

SPECS = {s.name: s for s in all_specs()}


def test_which_ops_take_the_fast_path():
    fast = {name for name, s in SPECS.items() if s.function._opforge_fast is not None}
    # add_out writes its argument: the fast path bumps its version, as the operator's Autograd kernel does.
    assert {"add", "square", "axpby", "sigmoid", "add_out"} <= fast


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_on_the_fast_path_does_what_torch_ops_does(device, seed):
    dev = torch.device(device)
    g = generator(dev, seed)
    a, b = (torch.randn(37, 5, device=dev, generator=g) for _ in range(2))
    out = torch.full((37, 5), float("nan"), device=dev)
    fast = SPECS["add_out"].function._opforge_fast
    version = out._version
    assert fast(a, b, out) is None  # the fast path itself answered, not the fallback
    assert out._version == version + 1
    torch.testing.assert_close(out, a + b, atol=0, rtol=0)
    # A tensor saved for backward, then written: backward refuses, as after a write through torch.ops.
    x = torch.randn(5, device=dev, generator=g).requires_grad_()
    y = x.sigmoid()
    with torch.no_grad():
        opforge.add_out(a[0], b[0], y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # What it leaves to torch.ops: an argument that needs a gradient (which raises there), inference mode.
    assert fast(a.clone().requires_grad_(), b, out) is NotImplemented
    with pytest.raises(RuntimeError, match="a requires grad, but this operator writes into an argument"):
        opforge.add_out(a.clone().requires_grad_(), b, out)
    with torch.inference_mode():
        assert fast(a, b, out) is NotImplemented
        inference = torch.empty(37, 5, device=dev)
    # A write to an inference tensor outside inference mode raises as torch.ops's does.
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        fast(a, b, inference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("op", "dtype"),
    # Every dtype each operator takes (qqq_gemm's outputs are float16, bfloat16 and float32 only).
    [(n, d) for n, s in sorted(SPECS.items()) if not s.mutated_args for d in s.dtypes],
    ids=str,
)
def test_fast_path_matches_the_dispatcher(op, dtype, device, seed):
    spec = SPECS[op]
    dev = torch.device(device)
    for sample in spec.samples(dev, dtype, generator(dev, seed)):
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in sample.args)
        want = spec.overload(*args, **sample.kwargs)
        got = spec.function(*args, **sample.kwargs)
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True, msg=lambda m, s=sample: f"[{s.desc}] {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_are_recorded_on_the_fast_path(device):
    x = torch.randn(33, device=device, requires_grad=True)
    y = torch.randn(33, device=device)
    out = opforge.axpby(x, y, 2.0, 3.0)
    assert out.grad_fn is not None and out.grad_fn.name() == "opforge::axpbyBackward"  # our node, not torch.ops's
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    with torch.no_grad():
        assert opforge.axpby(x, y, 2.0, 3.0).grad_fn is None
    s = opforge.sigmoid(x)  # saves its output
    s.backward(torch.ones_like(s))
    torch.testing.assert_close(x.grad, 2.0 + torch.sigmoid(x) * (1 - torch.sigmoid(x)))


# The fast path records gradients for one-output operators; the others take torch.ops when a gradient is needed.
@pytest.mark.parametrize(
    "op", sorted(n for n, s in SPECS.items() if s.differentiable and s.function._opforge_fast is not None and len(s.schema.returns) == 1)
)
def test_gradcheck_through_the_public_function(op, seed):
    spec = SPECS[op]
    dev = torch.device("cpu")
    checked = 0
    for sample in spec.samples(dev, torch.float64, generator(dev, seed)):
        bound = spec.signature().bind(*sample.args, **sample.kwargs)
        bound.apply_defaults()
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in bound.args)
        # gradcheck builds dense Jacobians: small samples only.
        if any(not 0 < a.numel() <= 64 for a in args if isinstance(a, torch.Tensor)):
            continue
        assert torch.autograd.gradcheck(spec.function, args)
        out = spec.function(*args)
        assert out.grad_fn.name() == f"opforge::{op}Backward"
        checked += 1
    assert checked >= 1


def test_saved_tensors_are_version_checked_freed_and_leak_nothing():
    import gc
    import weakref

    x = torch.randn(8, requires_grad=True)
    s = opforge.sigmoid(x)
    with torch.no_grad():
        s.mul_(2)  # the saved output changed under it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()
    q = opforge.square(x)
    q.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        q.sum().backward()
    # A saved output must not keep itself alive through its own grad_fn.
    s = opforge.sigmoid(x)
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    # needs_input_grad: only x's gradient is asked for.
    y = torch.randn(8)
    opforge.axpby(x, y, 2.0, 3.0).sum().backward()
    assert y.grad is None


def test_each_recorded_call_sees_its_own_needs_input_grad_and_may_save_none(seed):
    from opforge.fast import Context, fast_op

    # A fresh callable with a formula of the test's own: ctx.needs_input_grad is shared between
    # calls of one pattern, and save_for_backward may hold None, as torch.autograd.Function's.
    fast = fast_op("opforge::axpby")
    assert fast is not None
    seen = []

    def setup_context(ctx, inputs, output):
        seen.append(ctx.needs_input_grad)
        ctx.save_for_backward(None, inputs[0], None)
        ctx.alpha, ctx.beta = inputs[2], inputs[3]

    def backward(ctx, grad):
        nothing, x, nothing_either = ctx.saved_tensors
        assert nothing is None and nothing_either is None and x.shape == grad.shape
        gx = grad * ctx.alpha if ctx.needs_input_grad[0] else None
        gy = grad * ctx.beta if ctx.needs_input_grad[1] else None
        return gx, gy, None, None

    fast.set_autograd(setup_context, backward, Context)
    g = generator(torch.device("cpu"), seed)
    masks = [(True, False), (False, True), (True, True), (True, False), (False, True)]
    for wants_x, wants_y in masks:
        x = torch.randn(6, generator=g).requires_grad_(wants_x)
        y = torch.randn(6, generator=g).requires_grad_(wants_y)
        alpha, beta = torch.randn(2, generator=g).tolist()
        out = fast(x, y, alpha, beta)
        assert out.grad_fn is not None and out.grad_fn.name() == "opforge::axpbyBackward"
        torch.testing.assert_close(out, alpha * x.detach() + beta * y.detach())
        out.sum().backward()
        for t, wants, scale in ((x, wants_x, alpha), (y, wants_y, beta)):
            if wants:
                torch.testing.assert_close(t.grad, torch.full_like(t, scale))
            else:
                assert t.grad is None
    assert seen == [(a, b, False, False) for a, b in masks]
    with torch.no_grad():
        assert fast(x, y, 1.0, 2.0).grad_fn is None
    assert len(seen) == len(masks)  # no recording without grad mode


def test_keywords_defaults_and_int_scalars():
    x, y = torch.randn(17), torch.randn(17)
    # The schema's defaults (alpha=3, beta=-1: the autograd tutorial's 3x - y), filled in by the fast path.
    torch.testing.assert_close(opforge.axpby(x, y, alpha=2.0), opforge.axpby(x, y, 2.0, -1.0))
    torch.testing.assert_close(opforge.axpby(x, y), 3 * x - y)
    torch.testing.assert_close(opforge.axpby(x, y, 2.0), 2 * x - y)
    torch.testing.assert_close(opforge.axpby(x, y, 2, 3), 2 * x + 3 * y)


class _Tagged(torch.Tensor):
    pass


def test_subclasses_and_modes_take_the_full_path():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    x, y = torch.randn(9), torch.randn(9)
    out = opforge.add(x.as_subclass(_Tagged), y)
    assert type(out) is _Tagged  # __torch_function__ rewraps: the dispatcher path ran
    torch.testing.assert_close(out.as_subclass(torch.Tensor), x + y)

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        opforge.add(x, y)
    assert seen, "a __torch_function__ mode must see the call"
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fy = mode.from_tensor(y)
        f = opforge.add(fx, fy)
        assert f.shape == x.shape and type(f).__name__ == "FakeTensor"


def test_bad_inputs_raise_the_same_errors_on_both_paths():
    cases = [
        ((torch.randn(3), torch.randn(4)), RuntimeError),
        ((torch.randn(3, dtype=torch.float64), torch.randn(3)), ValueError),
        ((torch.randint(0, 5, (3,)), torch.randint(0, 5, (3,))), ValueError),
    ]
    for args, error in cases:
        with pytest.raises(error) as fast_exc:
            opforge.add(*args)
        with pytest.raises(error) as full_exc:
            torch.ops.opforge.add(*args)
        assert str(fast_exc.value).splitlines()[0] == str(full_exc.value).splitlines()[0]
        assert "opforge::add" in str(fast_exc.value)
    with pytest.raises(TypeError, match=r"^opforge::add: b must be a Tensor, got str \('a string'\)$"):
        opforge.add(torch.randn(3), "a string")  # not a tensor: refused by the full path, named by the public function


def test_compile_fullgraph_uses_the_dispatcher():
    x, y = torch.randn(21), torch.randn(21)
    f = torch.compile(lambda a, b: opforge.add(opforge.square(a), b), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x, y), x * x + y)


def test_opforge_fast_0_turns_it_off(tmp_path):
    code = "import opforge; print(opforge.add._opforge_fast)"
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_FAST": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "None", res.stderr


@pytest.mark.slow
def test_a_short_process_leaves_the_module_built_and_the_next_ones_find_it(tmp_path):
    """A cache with the op library but no fast-path module: a process that exits at once still gets the
    module built (its build process outlives it); one started meanwhile waits for that build when it asks
    to; one started after finds it at import."""
    cache = cache_with_library(tmp_path / "cache", fast=False)
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(cache)}
    env.pop("OPFORGE_FAST", None)

    def run(code: str) -> str:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout.strip()

    assert run("import opforge; print(opforge.fast.module() is None)") == "True"
    assert run("import opforge; opforge.load(wait_fast=True); print(opforge.fast.module() is not None)") == "True"
    assert len(list(cache.glob("opforge_fast-*/COMPLETE.json"))) == 1
    assert run("import opforge; print(opforge.fast.module() is not None, opforge.add._opforge_fast is not None)") == "True True"
    assert not list(cache.glob("opforge_fast-build-*.log"))


def test_a_compile_during_which_the_fast_path_attaches_still_works(seed):
    # The fast path's module attaches in the background. Dynamo reading the function's slot while
    # it was None, then guarding on it once it held the C++ object, raised "Unexpected type
    # FastOp" (seen compiling a tensor-parallel model under torchrun). A backend that attaches it
    # in the middle of the compile makes that moment certain.
    from opforge.public import _declined

    fn = opforge.sigmoid
    fast = fn._opforge_fast
    assert fast is not None
    # Where the function reads the fast path's object: its namespace (a function with the schema's
    # parameters) or a closure cell (the generic one).
    cells = [c for c in fn.__closure__ or () if c.cell_contents is fast]
    if cells:
        (cell,) = cells

        def hold(value):
            cell.cell_contents = value
    else:
        assert fn.__globals__["_of_fast"] is fast

        def hold(value):
            fn.__globals__["_of_fast"] = value

    def backend(gm, example_inputs):
        hold(fast)
        return gm.forward

    x = torch.randn(5, generator=generator(torch.device("cpu"), seed))
    torch._dynamo.reset()
    hold(_declined)  # what the function holds before the module attaches
    try:
        compiled = torch.compile(lambda t: opforge.sigmoid(t) * 2, backend=backend, fullgraph=True)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x) * 2)
    finally:
        hold(fast)
        torch._dynamo.reset()


def test_only_a_setup_context_that_does_nothing_is_skipped():
    from opforge.public import _does_nothing

    def empty(ctx, inputs, output):
        pass

    def saves(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    assert _does_nothing(empty) and _does_nothing(SPECS["add"].setup_context)
    assert not _does_nothing(saves) and not _does_nothing(SPECS["square"].setup_context)
    assert not _does_nothing(lambda ctx, inputs, output: ctx.__setattr__("k", 1))
    assert not _does_nothing(print)  # a builtin: no code to read, called as given
    # add skips it and still records its node and gradients.
    x = torch.randn(4, requires_grad=True)
    out = opforge.add(x, x)
    assert out.grad_fn.name() == "opforge::addBackward"
    out.backward(torch.ones(4))
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


def test_a_setup_context_that_only_saves_one_tensor_is_recognised():
    from opforge.public import _saves_one

    def output(ctx, inputs, result):
        ctx.save_for_backward(result)

    def second(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    # torch calls setup_context(ctx=, inputs=, output=): a parameter named otherwise raises there, so it is no saves form.
    assert _saves_one(output) is None and _saves_one(SPECS["sigmoid"].setup_context) == "output"
    assert _saves_one(second) == 1 and _saves_one(SPECS["square"].setup_context) == 0
    for other in (
        lambda ctx, inputs, output: ctx.save_for_backward(inputs[-1]),
        lambda ctx, inputs, output: ctx.save_for_backward(inputs[True]),
        lambda ctx, inputs, output: ctx.save_for_backward(inputs[0], output),
        lambda ctx, inputs, output: ctx.save_for_backward(inputs),
        lambda ctx, inputs, output: ctx.save(output),
        SPECS["axpby"].setup_context,
        SPECS["add"].setup_context,
        print,
    ):
        assert _saves_one(other) is None


@pytest.mark.parametrize("saves", ["output", 0, 1])
def test_a_recognised_setup_context_is_not_called_and_its_backward_gets_the_saved_tensor(saves, seed):
    from opforge.fast import Context, fast_op

    fast = fast_op("opforge::axpby")
    assert fast is not None
    calls = []

    def setup_context(ctx, inputs, output):  # what `saves` says it does; counted if called
        calls.append(1)
        ctx.save_for_backward(output if saves == "output" else inputs[saves])

    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        seen.append((ctx.needs_input_grad, kept))
        return grad * 2.0, grad * -1.0, None, None

    fast.set_autograd(setup_context, backward, Context, saves)
    g = generator(torch.device("cpu"), seed)
    for wants_x, wants_y in ((True, False), (False, True), (True, True)):
        seen: list = []
        x = torch.randn(5, generator=g).requires_grad_(wants_x)
        y = torch.randn(5, generator=g).requires_grad_(wants_y)
        out = fast(x, y, 2.0, -1.0)
        torch.testing.assert_close(out, 2.0 * x.detach() - y.detach())
        out.backward(torch.randn(5, generator=g))
        (needs, kept), *rest = seen
        assert not rest and needs == (wants_x, wants_y, False, False)
        want = out if saves == "output" else (x, y)[saves]
        torch.testing.assert_close(kept, want.detach(), rtol=0, atol=0)
    assert calls == []
    with pytest.raises(ValueError, match="saves=2 is not a required tensor argument"):
        fast.set_autograd(setup_context, backward, Context, 2)
    with pytest.raises(TypeError, match="saves must be None"):
        fast.set_autograd(setup_context, backward, Context, 1.5)


def _keeps_two(ctx, inputs, output):
    _, _, ctx.alpha, ctx.beta = inputs


def _keeps_and_saves(ctx, inputs, output):
    _, _, ctx.alpha, ctx.beta = inputs
    ctx.save_for_backward(output)


def _keeps_by_index(ctx, inputs, output):
    ctx.alpha = inputs[2]


def _keeps_its_inputs(ctx, inputs, output):
    _, _, ctx.alpha, inputs = inputs


def _keeps_a_star(ctx, inputs, output):
    _, *ctx.rest = inputs


def test_a_setup_context_that_only_sets_attributes_to_arguments_is_recognised():
    from opforge.public import _sets_attributes

    axpby = [True, True, False, False]  # x, y, alpha, beta: which are tensors
    assert _sets_attributes(_keeps_two, axpby) == (("alpha", 2), ("beta", 3))
    assert _sets_attributes(SPECS["axpby"].setup_context, axpby) == (("alpha", 2), ("beta", 3))
    assert _sets_attributes(SPECS["axpby_backward"].setup_context, [True, False, False]) == (("alpha", 1), ("beta", 2))
    assert _sets_attributes(_keeps_two, [*axpby, False]) is None  # one target per argument, or the unpacking would fail
    assert _sets_attributes(_keeps_two, [True, True, True, False]) is None  # a tensor kept outside the saved tensors
    for other in (
        _keeps_and_saves,
        _keeps_by_index,
        _keeps_its_inputs,
        _keeps_a_star,
        SPECS["square"].setup_context,
        SPECS["add"].setup_context,
        lambda ctx, inputs, output: ctx.__setattr__("alpha", inputs[2]),
        print,
    ):
        assert _sets_attributes(other, axpby) is None


def test_a_setup_context_that_sets_attributes_is_not_called_and_the_ctx_has_them(seed):
    from opforge.fast import Context, fast_op

    fast = fast_op("opforge::axpby")
    assert fast is not None
    calls = []

    def setup_context(ctx, inputs, output):  # counted if called
        calls.append(1)
        _, _, ctx.alpha, ctx.beta = inputs

    def backward(ctx, grad):
        seen.append((ctx.needs_input_grad, ctx.alpha, ctx.beta))
        return grad * ctx.alpha, grad * ctx.beta, None, None

    fast.set_autograd(setup_context, backward, Context, (("alpha", 2), ("beta", 3)))
    g = generator(torch.device("cpu"), seed)
    # Given as ints, as floats, and left to the schema's defaults (3.0, -1.0).
    for extra, want in (((2, -1), (2, -1)), ((0.5, 1.25), (0.5, 1.25)), ((), (3.0, -1.0))):
        seen: list = []
        x = torch.randn(5, generator=g, requires_grad=True)
        y = torch.randn(5, generator=g)
        out = fast(x, y, *extra)
        torch.testing.assert_close(out, want[0] * x.detach() + want[1] * y)
        grad = torch.randn(5, generator=g)
        out.backward(grad)
        (needs, alpha, beta), *rest = seen
        assert not rest and needs == (True, False, False, False)
        assert (alpha, beta) == want and (type(alpha), type(beta)) == tuple(type(w) for w in want)
        torch.testing.assert_close(x.grad, want[0] * grad)
    assert calls == []
    for bad in ((("alpha", 0),), (("alpha", 4),), ((2, 2),), (("alpha",),), (("alpha", 2.0),)):
        with pytest.raises(ValueError, match="non-tensor arguments"):
            fast.set_autograd(setup_context, backward, Context, bad)


def test_the_public_function_takes_the_schemas_parameters_and_keywords_take_the_fast_path(seed):
    import inspect

    from opforge.public import _exact_signature_function

    for name in ("add", "add_out", "square", "sigmoid", "axpby"):
        code = SPECS[name].function.__code__
        # Plain parameters: CPython calls it without building an argument tuple and dict.
        assert not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS), name
        assert code.co_varnames[: code.co_argcount] == tuple(a.name for a in SPECS[name].schema.arguments)
    g = generator(torch.device("cpu"), seed)
    x, y = torch.randn(7, generator=g), torch.randn(7, generator=g)
    seen = []

    def fake_fast(*args):
        seen.append(args)
        return NotImplemented  # declined: the dispatcher answers

    fn = SPECS["axpby"].function
    real = fn.__globals__["_of_fast"]
    fn.__globals__["_of_fast"] = fake_fast
    try:
        torch.testing.assert_close(opforge.axpby(y=y, x=x, beta=0.5), 3.0 * x + 0.5 * y)
    finally:
        fn.__globals__["_of_fast"] = real
    # Keywords and defaults reach the fast path as positional arguments, in the schema's order.
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1] is y and seen[0][2:] == (3.0, 0.5)
    # A missing argument is the dispatcher's to name, as before.
    with pytest.raises(TypeError, match=r"^opforge::axpby: missing a required argument: 'x'$"):
        opforge.axpby(y=y)

    class Schema:
        def __init__(self, names, kwarg_only=False):
            self.arguments = [
                type("A", (), {"name": n, "kwarg_only": kwarg_only, "has_default_value": lambda self: False})() for n in names
            ]

    for names, kwarg_only in ((["x", "_of_fast"], False), (["x", "lambda"], False), (["x"], True)):
        spec = type("S", (), {"schema": Schema(names, kwarg_only), "name": "f"})()
        assert _exact_signature_function(spec, print, lambda: False) is None  # the generic function serves


def test_the_attribute_form_is_read_from_the_code_that_runs_not_its_source_file(tmp_path, monkeypatch, seed):
    """A module's source rewritten after its import (an edit while a notebook runs): its setup_context
    runs as it was imported, and the gradient is what calling it gives, as torch.ops' autograd calls it."""
    import importlib
    import types

    from opforge.fast import Context, fast_op
    from opforge.public import _sets_attributes

    module = tmp_path / "stale_setup.py"
    module.write_text("def setup_context(ctx, inputs, output):\n    _, _, ctx.alpha, ctx.beta = inputs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stale = importlib.import_module("stale_setup")
    module.write_text("def setup_context(ctx, inputs, output):\n    _, _, ctx.beta, ctx.alpha = inputs\n")

    def backward(ctx, grad):
        return grad * ctx.alpha, grad * ctx.beta, None, None

    saves = _sets_attributes(stale.setup_context, [True, True, False, False])
    assert saves == (("alpha", 2), ("beta", 3))
    fast = fast_op("opforge::axpby")
    assert fast is not None
    fast.set_autograd(stale.setup_context, backward, Context, saves)
    g = generator(torch.device("cpu"), seed)
    x = torch.randn(3, generator=g, requires_grad=True)
    y = torch.randn(3, generator=g)
    fast(x, y, 3.0, 0.5).backward(torch.ones(3))
    ctx = types.SimpleNamespace()
    stale.setup_context(ctx=ctx, inputs=(x, y, 3.0, 0.5), output=None)
    torch.testing.assert_close(x.grad, backward(ctx, torch.ones(3))[0])
    assert x.grad.tolist() == [3.0, 3.0, 3.0]


def _renamed(c, i, o):
    _, _, c.alpha, c.beta = i


def _renamed_saves_output(c, i, o):
    c.save_for_backward(o)


def _keeps_saved_tensors(ctx, inputs, output):
    _, _, ctx.saved_tensors, ctx.beta = inputs


def _keeps_needs_input_grad(ctx, inputs, output):
    _, _, ctx.alpha, ctx.needs_input_grad = inputs


@pytest.mark.parametrize("setup", [_renamed, _renamed_saves_output, _keeps_saved_tensors, _keeps_needs_input_grad])
def test_a_setup_context_torch_refuses_is_left_to_torch(setup):
    """torch calls setup_context(ctx=, inputs=, output=) and its ctx refuses saved_tensors and the like:
    the fast path neither recognises such a setup_context nor records its gradient (torch.ops does, and raises)."""
    from opforge.public import _fast_can_call, _saves_one, _sets_attributes

    assert _sets_attributes(setup, [True, True, False, False]) is None
    assert _saves_one(setup) is None
    assert not _fast_can_call(setup)
    assert _fast_can_call(_keeps_two) and _fast_can_call(SPECS["axpby"].setup_context)
