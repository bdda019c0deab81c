"""The autograd tutorial, runnable: the C++ op z = 3x - y with its own forward and backward,
used through ``torch.autograd.Function`` and an ``nn.Module``; the same op
registered the modern way (``torch.library.custom_op`` + ``register_autograd``
+ ``register_fake``, checked by ``opcheck``, run under
``torch.compile(fullgraph=True)``); the custom sigmoid; and why ``gradcheck``
fails in float32 and passes in float64.

    python examples/my_op_autograd/run.py                 # the GPU if torch sees one, else the CPU
    python examples/my_op_autograd/run.py --device cpu

Exits 1 when a check fails.
"""

import argparse
import os
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This example builds its own module; opforge's op library is not needed, so
# importing opforge does not build or load it.
os.environ.setdefault("OPFORGE_NO_AUTOLOAD", "1")

import torch
from torch import nn

from opforge.builder.inline import build_pybind_folder

HERE = Path(__file__).resolve().parent

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"check: {what}: {'ok' if ok else 'FAILED'}")
    if not ok:
        failures.append(what)


def section(title: str) -> None:
    print(f"\n== {title}")


# --- 1. the tutorial's way: autograd.Function over the C++ forward and backward, wrapped in a Module ---


def make_function(ext: types.ModuleType) -> type[torch.autograd.Function]:
    class MyOpFunction(torch.autograd.Function):
        """z = 3x - y: forward and backward are the C++ module's."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # Nothing to save: the gradients do not depend on x or y.
            return ext.forward(x, y)

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # One gradient per input of forward, in order (None for an input that needs none).
            grad_x, grad_y = ext.backward(grad_output)
            return grad_x, grad_y

    return MyOpFunction


class MyOp(nn.Module):
    """The op as a layer: ``MyOp(fn)(x, y) == 3 * x - y``, differentiable."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, y)


def show_autograd_function(ext: types.ModuleType, device: torch.device) -> type[torch.autograd.Function]:
    section("1. torch.autograd.Function + nn.Module over the C++ forward/backward (the autograd tutorial)")
    fn = make_function(ext)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 5, device=device, generator=gen, requires_grad=True)
    y = torch.randn(4, 5, device=device, generator=gen, requires_grad=True)
    z = MyOp(fn)(x, y)
    check(torch.equal(z, 3 * x.detach() - y.detach()), "MyOp()(x, y) == 3 * x - y")
    grad = torch.randn(4, 5, device=device, generator=gen)
    z.backward(grad)
    check(x.grad is not None and torch.equal(x.grad, 3 * grad), "x.grad == 3 * grad")
    check(y.grad is not None and torch.equal(y.grad, -grad), "y.grad == -grad")
    xd = torch.randn(3, 4, device=device, dtype=torch.float64, generator=gen, requires_grad=True)
    yd = torch.randn(3, 4, device=device, dtype=torch.float64, generator=gen, requires_grad=True)
    check(torch.autograd.gradcheck(fn.apply, (xd, yd)), "gradcheck(MyOpFunction.apply) in float64")

    # Dynamo cannot look inside a pybind11 function: it is an opaque Python callable with no fake-tensor rule.
    try:
        torch.compile(MyOp(fn), fullgraph=True)(x, y)
        print("torch.compile(fullgraph=True) on the autograd.Function version: compiled (this torch traces through it)")
    except Exception as exc:  # noqa: BLE001 - any failure is the point being shown
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        print(f"torch.compile(fullgraph=True) on the autograd.Function version: fails, {type(exc).__name__}: {first[:150]}")
    torch._dynamo.reset()
    return fn


# --- 2. the modern way: a custom op with a fake kernel and an autograd formula ---


def register_ops(ext: types.ModuleType) -> tuple[Callable[..., torch.Tensor], Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """my_op and its backward as operators of torch.ops.opforge_examples."""

    @torch.library.custom_op("opforge_examples::my_op", mutates_args=())
    def my_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ext.forward(x, y)

    # The backward is an operator too, so that torch.compile can trace the
    # backward graph (it cannot look inside ext.backward either).
    @torch.library.custom_op("opforge_examples::my_op_backward", mutates_args=())
    def my_op_backward(grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad_x, grad_y = ext.backward(grad_output)
        return grad_x, grad_y

    # Fake kernels: the output's shape, dtype and device without computing it,
    # which is what torch.compile traces with.
    @my_op.register_fake
    def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape == y.shape, lambda: f"my_op: x and y must have the same shape, got {list(x.shape)} and {list(y.shape)}")
        return torch.empty_like(x)

    @my_op_backward.register_fake
    def _(grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(grad_output), torch.empty_like(grad_output)

    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return my_op_backward(grad_output)

    my_op.register_autograd(backward)
    return my_op, my_op_backward


def show_custom_op(ext: types.ModuleType, device: torch.device) -> None:
    section("2. the same op registered the modern way: torch.library.custom_op + register_fake + register_autograd")
    my_op, my_op_backward = register_ops(ext)
    print("registered: torch.ops.opforge_examples.my_op, torch.ops.opforge_examples.my_op_backward")
    gen = torch.Generator(device=device).manual_seed(1)

    def inputs(grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(8, 3, device=device, generator=gen, requires_grad=grad) for _ in range(2))  # type: ignore[return-value]

    # opcheck: schema, autograd registration, fake tensor, AOT dispatch (static and dynamic shapes).
    for args in (inputs(False), inputs(True)):
        result = torch.library.opcheck(my_op, args)
        grads = "with" if args[0].requires_grad else "without"
        check(all(v == "SUCCESS" for v in result.values()), f"opcheck(my_op) {grads} requires_grad: {', '.join(result)}")
    result = torch.library.opcheck(my_op_backward, (torch.randn(8, 3, device=device, generator=gen),))
    check(all(v == "SUCCESS" for v in result.values()), "opcheck(my_op_backward)")

    xd = torch.randn(3, 4, device=device, dtype=torch.float64, generator=gen, requires_grad=True)
    yd = torch.randn(3, 4, device=device, dtype=torch.float64, generator=gen, requires_grad=True)
    check(torch.autograd.gradcheck(my_op, (xd, yd)), "gradcheck(my_op) in float64")

    def model(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return my_op(my_op(x, y), y)  # 3(3x - y) - y = 9x - 4y

    compiled = torch.compile(model, fullgraph=True)
    x, y = inputs(True)
    xc, yc = (t.detach().clone().requires_grad_() for t in (x, y))
    eager_out, compiled_out = model(x, y), compiled(xc, yc)
    check(torch.equal(eager_out, compiled_out), "torch.compile(fullgraph=True) forward == eager")
    # Equal up to rounding: 3 (3x - y) - y is not rounded as 9x - 4y is.
    expected = 9 * x.detach() - 4 * y.detach()
    check(torch.allclose(eager_out, expected, rtol=1e-5, atol=1e-5), "my_op(my_op(x, y), y) == 9x - 4y (up to rounding)")
    grad = torch.randn_like(eager_out)
    eager_out.backward(grad)
    compiled_out.backward(grad)
    same = x.grad is not None and xc.grad is not None and torch.equal(x.grad, xc.grad) and torch.equal(y.grad, yc.grad)  # type: ignore[arg-type]
    check(same, "torch.compile(fullgraph=True) backward == eager (x.grad == 9 grad, y.grad == -4 grad)")


# --- 3. the custom sigmoid ---


class Sigmoid(torch.autograd.Function):
    """y = 1 / (1 + exp(-x)); dy/dx = y (1 - y), so forward saves its output, not its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = 1 / (1 + torch.exp(-x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad_output * y * (1 - y)


def show_sigmoid(device: torch.device) -> None:
    section("3. a custom sigmoid: forward saves y, backward is grad * y * (1 - y)")
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(1000, device=device, generator=gen, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y, yt = Sigmoid.apply(x), torch.sigmoid(xt)
    err = (y - yt).abs().max().item()
    check(err <= 1e-6, f"Sigmoid forward == torch.sigmoid (max |diff| {err:.1e})")
    grad = torch.randn(1000, device=device, generator=gen)
    y.backward(grad)
    yt.backward(grad)
    assert x.grad is not None and xt.grad is not None
    err = (x.grad - xt.grad).abs().max().item()
    check(err <= 1e-6, f"Sigmoid backward == torch.sigmoid's (max |diff| {err:.1e})")


# --- 4. the gradcheck trap ---


def central_difference_error(x: torch.Tensor, eps: float) -> float:
    """The largest error of the finite difference gradcheck computes, (f(x + eps) - f(x - eps)) / 2 eps
    in x's dtype, against the true derivative (computed in float64)."""
    with torch.no_grad():
        numeric = (Sigmoid.apply(x + eps) - Sigmoid.apply(x - eps)) / (2 * eps)
        s = torch.sigmoid(x.double())
        return (numeric.double() - s * (1 - s)).abs().max().item()


def show_gradcheck_trap(device: torch.device) -> None:
    section("4. gradcheck in float32 vs float64")
    gen = torch.Generator(device=device).manual_seed(3)
    x64 = torch.randn(16, device=device, dtype=torch.float64, generator=gen)
    results: dict[tuple[str, float, str], bool] = {}
    print("gradcheck (atol 1e-5, rtol 1e-3) on 16 random inputs; 'error' is the finite difference's largest error")
    print(f"  {'dtype':<8} {'eps':>6}  {'Sigmoid':>8}  {'torch.sigmoid':>13}  {'error':>8}")
    for dtype in (torch.float32, torch.float64):
        x = x64.to(dtype).requires_grad_()
        dname = str(dtype).removeprefix("torch.")
        for eps in (1e-2, 1e-3, 1e-4, 1e-6):
            row = []
            for name, f in (("Sigmoid", Sigmoid.apply), ("torch.sigmoid", torch.sigmoid)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # gradcheck warns that a float32 input is not double precision
                    ok = torch.autograd.gradcheck(f, (x,), eps=eps, raise_exception=False)
                results[(dname, eps, name)] = ok
                row.append("pass" if ok else "FAIL")
            print(f"  {dname:<8} {eps:>6.0e}  {row[0]:>8}  {row[1]:>13}  {central_difference_error(x.detach(), eps):>8.1e}")
    err32, err64 = central_difference_error(x64.float(), 1e-6), central_difference_error(x64, 1e-6)
    passes_3 = "passes" if results[("float32", 1e-3, "Sigmoid")] else "still fails"
    print(
        "why: gradcheck compares the analytical gradient with the finite difference (f(x + eps) - f(x - eps)) / (2 eps), "
        "computed in the input's dtype. float32 keeps about 7 digits: x + eps is itself rounded (float32 numbers near 1 are "
        "1.2e-7 apart, an eighth of eps = 1e-6), and so are f(x +- eps) (6e-8 apart near sigmoid's 0.5). Dividing by "
        f"2 eps = 2e-6 magnifies those roundings into an error of {err32:.0e} in the gradient, far over gradcheck's tolerance "
        f"(1e-5 + 1e-3 * |gradient|), so a correct backward FAILS. A larger eps shrinks the rounding error (eps = 1e-3 {passes_3} "
        "here) but adds truncation error (eps^2 * f'''(x) / 6), so a float32 gradcheck passes or fails by the choice of eps "
        f"and the luck of the inputs. In float64 (16 digits) the same eps = 1e-6 leaves an error of {err64:.0e}, and gradcheck "
        "passes: give gradcheck float64 inputs (it warns about any other dtype)."
    )
    for name in ("Sigmoid", "torch.sigmoid"):
        check(results[("float64", 1e-6, name)], f"gradcheck({name}) passes in float64 with eps = 1e-6")
        check(not results[("float32", 1e-6, name)], f"gradcheck({name}) fails in float32 with eps = 1e-6 (the trap)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"device: {device}, torch {torch.__version__}")
    # ATen calls only, no .cu: one C++ build serves CPU and CUDA tensors.
    ext = build_pybind_folder(HERE / "csrc", name="my_op")
    print(f"built {HERE / 'csrc'} through opforge.builder.inline.build_pybind_folder: module {ext.__name__}")
    show_autograd_function(ext, device)
    show_custom_op(ext, device)
    show_sigmoid(device)
    show_gradcheck_trap(device)
    if failures:
        print(f"\nFAILED: {'; '.join(failures)}")
        return 1
    print("\nmy_op_autograd: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
