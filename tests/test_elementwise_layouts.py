"""Elementwise operators on every layout: values equal to torch's, and the
result laid out as torch's own elementwise op lays out its result (a
transposed, channels_last or permuted input gives a result in that layout;
scattered inputs give the layout torch picks), on the CPU and the GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import opforge

from .conftest import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@dataclass(frozen=True)
class Op:
    """An elementwise operator with ``arity`` tensor inputs; ``torch_op`` is
    torch's own operator of the same shape of work, whose result's strides
    ours must equal; ``reference`` computes the values in float64."""

    arity: int
    call: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    torch_op: Callable[..., torch.Tensor]


OPS: dict[str, Op] = {
    "add": Op(2, opforge.add, torch.add, torch.add),
    "square": Op(1, opforge.square, lambda x: x * x, torch.square),
    "sigmoid": Op(1, opforge.sigmoid, torch.sigmoid, torch.sigmoid),
    "sigmoid_backward": Op(2, opforge.sigmoid_backward, lambda g, y: g * y * (1 - y), torch.ops.aten.sigmoid_backward),
    "axpby": Op(2, lambda x, y: opforge.axpby(x, y, 1.5, -0.75), lambda x, y: 1.5 * x - 0.75 * y, torch.add),
    "axpby_backward": Op(
        1,
        lambda g: opforge.axpby_backward(g, 1.5, -0.75),
        lambda g: (1.5 * g, -0.75 * g),
        # A one-input op: torch's one-input ops' layout (g * 1.5 is a two-input
        # op with a 0-d scalar, which lays out an empty result otherwise).
        torch.neg,
    ),
}

# Each layout makes one tensor from a base of random values; a layout of two
# names gives the first input the first and every other input the second.
Make = Callable[[Callable[..., torch.Tensor]], torch.Tensor]
LAYOUTS: dict[str, Make] = {
    "contiguous 7x13": lambda base: base(7, 13),
    "transposed 33x17": lambda base: base(17, 33).t(),
    # 2-D transposes with more elements than one CPU task (32K), and a size
    # whose tail is not a whole vector.
    "transposed 300x250": lambda base: base(250, 300).t(),
    "transposed 1025x3": lambda base: base(3, 1025).t(),
    "channels_last 2x3x5x7": lambda base: base(2, 3, 5, 7).contiguous(memory_format=torch.channels_last),
    "channels_last 4x16x9x11": lambda base: base(4, 16, 9, 11).contiguous(memory_format=torch.channels_last),
    "permuted 6x4x5": lambda base: base(4, 5, 6).permute(2, 0, 1),
    "permuted with a size-1 dim": lambda base: base(7, 1, 5).permute(2, 1, 0),
    "sliced [:, ::2]": lambda base: base(10, 40)[:, ::2],
    "sliced transposed": lambda base: base(24, 10).t()[:, ::2],
    "expanded 9x31": lambda base: base(1, 31).expand(9, 31),
    "offset 1, 1025": lambda base: base(1026)[1:],
    "empty 3x0": lambda base: base(3, 0),
    "empty transposed": lambda base: base(0, 3).t(),
    "empty permuted": lambda base: base(5, 0, 3).permute(2, 0, 1),
}
MIXED: dict[str, tuple[str, str]] = {
    "transposed, contiguous": ("transposed 33x17", "contiguous 33x17"),
    "contiguous, transposed": ("contiguous 33x17", "transposed 33x17"),
    "channels_last, contiguous": ("channels_last 4x16x9x11", "contiguous 4x16x9x11"),
    "contiguous, channels_last": ("contiguous 4x16x9x11", "channels_last 4x16x9x11"),
    "transposed, sliced": ("transposed 33x17", "sliced 33x17"),
    "expanded, transposed": ("expanded 33x17", "transposed 33x17"),
}
_MIXED_PARTS: dict[str, Make] = {
    "contiguous 33x17": lambda base: base(33, 17),
    "contiguous 4x16x9x11": lambda base: base(4, 16, 9, 11),
    "sliced 33x17": lambda base: base(33, 34)[:, ::2],
    "expanded 33x17": lambda base: base(1, 17).expand(33, 17),
}


def _inputs(layout: str, arity: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def base(*shape: int) -> torch.Tensor:
        # Fresh normal values, drawn in float32 and rounded to dtype.
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    names = MIXED.get(layout, (layout, layout))
    makers = [LAYOUTS.get(name) or _MIXED_PARTS[name] for name in names]
    return [makers[min(i, 1)](base) for i in range(arity)]


def _cases() -> list[tuple[str, str]]:
    cases = [(op, layout) for op in OPS for layout in LAYOUTS]
    cases += [(op, layout) for op in OPS if OPS[op].arity > 1 for layout in MIXED]
    return cases


def _as_tuple(x: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("op", "layout"), _cases())
def test_values_and_strides_match_torch(op: str, layout: str, dtype: torch.dtype, device: str, seed: int) -> None:
    spec = OPS[op]
    args = _inputs(layout, spec.arity, dtype, device, seed)
    if op == "sigmoid_backward":  # y is a sigmoid output, in (0, 1)
        args[1] = torch.sigmoid(args[1])
    before = [a.clone() for a in args]
    outs = _as_tuple(spec.call(*args))
    refs = _as_tuple(spec.reference(*(a.double() for a in args)))
    expected = spec.torch_op(*args)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == args[0].shape and out.dtype == dtype and out.device == args[0].device
        assert out.stride() == expected.stride(), f"strides {out.stride()}, torch's {expected.stride()}"
        assert all(out.data_ptr() != a.data_ptr() for a in args if a.numel() > 0)
        torch.testing.assert_close(out, ref.to(dtype), equal_nan=False)
    for a, b in zip(args, before, strict=True):  # inputs untouched
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("op", "layout"), _cases())
def test_fake_kernel_gives_the_same_strides(op: str, layout: str, device: str, seed: int) -> None:
    # torch.compile and export plan memory from the fake kernel's strides.
    spec = OPS[op]
    args = _inputs(layout, spec.arity, torch.float32, device, seed)
    real = _as_tuple(spec.call(*args))
    with FakeTensorMode() as mode:
        fake = _as_tuple(spec.call(*(mode.from_tensor(a) for a in args)))
    assert [f.stride() for f in fake] == [r.stride() for r in real]


OUT_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transposed": lambda like: torch.empty(like.shape[::-1], dtype=like.dtype, device=like.device).t(),
    "contiguous": lambda like: torch.empty(like.shape, dtype=like.dtype, device=like.device),
    "sliced": lambda like: torch.empty(like.shape[0], 2 * like.shape[1], dtype=like.dtype, device=like.device)[:, ::2],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inputs", ["transposed 300x250", "contiguous 7x13", "transposed, contiguous", "sliced [:, ::2]"])
@pytest.mark.parametrize("out_layout", list(OUT_LAYOUTS))
def test_add_out_keeps_the_out_layout(out_layout: str, inputs: str, dtype: torch.dtype, device: str, seed: int) -> None:
    a, b = _inputs(inputs, 2, dtype, device, seed)
    out = OUT_LAYOUTS[out_layout](a).fill_(float("nan"))
    stride, ptr = out.stride(), out.data_ptr()
    assert opforge.add_out(a, b, out) is None
    assert out.stride() == stride and out.data_ptr() == ptr
    torch.testing.assert_close(out, (a.double() + b.double()).to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed 300x250", "channels_last 4x16x9x11", "transposed, contiguous"])
@pytest.mark.parametrize("op", ["add", "square", "sigmoid", "axpby"])
def test_gradients_through_layouts(op: str, layout: str, device: str, seed: int) -> None:
    spec = OPS[op]
    args = [a.requires_grad_() for a in _inputs(layout, spec.arity, torch.float64, device, seed)]
    out = spec.call(*args)
    assert out.stride() == spec.torch_op(*args).stride()
    grad = torch.randn(out.shape[::-1], dtype=out.dtype, device=device).t() if out.dim() == 2 else torch.randn_like(out)
    got = torch.autograd.grad(out, args, grad)
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    want = torch.autograd.grad(spec.reference(*ref_args), ref_args, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["add", "square", "sigmoid", "axpby"])
def test_gradcheck_with_transposed_inputs(op: str, device: str, seed: int) -> None:
    spec = OPS[op]
    args = [a.requires_grad_() for a in _inputs("transposed 33x17", spec.arity, torch.float64, device, seed)]
    assert torch.autograd.gradcheck(spec.call, args)
