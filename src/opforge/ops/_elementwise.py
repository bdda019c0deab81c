"""Shared pieces of the elementwise specs: random inputs in every layout the
kernels must handle and the bad inputs every elementwise operator must refuse.
The fake-kernel checks and their messages live in ``rules`` (re-exported here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from opforge.ops import _rules as rules
from opforge.ops._rules import expect_floating, expect_out, expect_same
from opforge.opspec import BadInput, Cost, Sample, SampleFn

__all__ = ["expect_floating", "expect_out", "expect_same"]  # re-exported for the specs


def randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Fresh normal samples (never zeros) at ``dtype``'s full precision: float64
    draws have all 53 bits of mantissa (float32 values widened would hide a kernel
    that rounds through float32); the narrower types are drawn in float32 and rounded."""
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=draw).to(dtype)


Transform = Callable[[torch.Tensor], torch.Tensor]


def _layout(
    desc: str, n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator, values: Transform | None
) -> list[torch.Tensor]:
    """``n`` independent random tensors laid out as ``desc`` says; ``values``
    maps the random base tensor before the view is taken, so it keeps the layout."""

    def base(*shape: int) -> torch.Tensor:
        t = randn(shape, dtype, device, gen)
        return t if values is None else values(t)

    def one() -> torch.Tensor:
        match desc:
            case "transposed 33x17":
                return base(17, 33).t()
            case "channels_last 2x3x5x7":
                return base(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)
            case "permuted 6x4x5":  # dense, in neither row- nor column-major order
                return base(4, 5, 6).permute(2, 0, 1)
            case "strided [::2] 61":
                return base(122)[::2]
            case "offset 1, 1025":  # starts one element past an aligned address
                return base(1026)[1:]
            case "expanded 9x31":  # stride 0: every row the same memory
                return base(1, 31).expand(9, 31)
            case _:
                return base(*_SHAPES[desc])

    return [one() for _ in range(n)]


_SHAPES: dict[str, tuple[int, ...]] = {
    "scalar": (),
    "1": (1,),
    "59": (59,),
    "97x3": (97, 3),
    "7x13x5": (7, 13, 5),
    "1025": (1025,),
    # Past one grid's worth of threads on a GPU and several CPU tasks.
    "2^20+3": (2**20 + 3,),
    "empty 0": (0,),
    "empty 3x0": (3, 0),
}
LAYOUTS: tuple[str, ...] = (
    *_SHAPES,
    "transposed 33x17",
    "channels_last 2x3x5x7",
    "permuted 6x4x5",
    "strided [::2] 61",
    "offset 1, 1025",
    "expanded 9x31",
)
# An out= tensor cannot be expanded: its elements would share memory.
OUT_LAYOUTS: tuple[str, ...] = tuple(d for d in LAYOUTS if not d.startswith("expanded"))


def tensor_samples(
    n: int,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    layouts: Sequence[str] = LAYOUTS,
    values: Transform | None = None,
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(description, n tensors) for every layout; ``values`` reshapes the
    distribution (a scale, a sigmoid) without losing the layout."""
    for desc in layouts:
        yield desc, _layout(desc, n, dtype, device, gen, values)


def elementwise_samples(n: int, values: Transform | None = None) -> SampleFn:
    """A spec's ``samples``: ``n`` random tensors of one layout, for every layout."""

    def samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for desc, tensors in tensor_samples(n, device, dtype, gen, values=values):
            yield Sample(tuple(tensors), desc=desc)

    return samples


def elementwise_bench(n: int, *extra: Any, sweep: bool = False, **kwargs: Any) -> SampleFn:
    """A spec's ``bench_cases`` (or, with ``sweep``, its ``sweep_cases``): ``n``
    random tensors per case (``bench_tensors``), then ``extra`` and ``kwargs``."""

    def cases(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for desc, tensors in bench_tensors(n, device, dtype, gen, sweep=sweep):
            yield Sample((*tensors, *extra), kwargs, desc=desc)

    return cases


def result_like(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """An empty result laid out as torch's elementwise ops lay out theirs, as
    the kernels do (a transposed or channels_last input gives a transposed or
    channels_last result): what a fake kernel returns. For two inputs torch's
    own ``add`` decides, on fake tensors, where nothing is computed."""
    return torch.empty_like(x if y is None else torch.add(x, y))


def like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh random tensor with ``t``'s shape, dtype, device and strides."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(randn(t.shape, t.dtype, t.device, gen))


def bench_sizes(device: torch.device, *, sweep: bool = False) -> tuple[int, ...]:
    # CPU sizes stay small enough for CI's two cores; GPU sizes go from
    # launch-bound (2^16) to several times the 50-60 MB L2 (2^26 float32 = 256 MB).
    # A sweep covers 2^12 (a few us, all launch) to 2^28 (1 GiB of float32).
    if device.type == "cpu":
        return tuple(2**k for k in range(10, 23, 2)) if sweep else (2**16, 2**20, 2**22)
    return tuple(2**k for k in range(12, 29, 2)) if sweep else (2**16, 2**20, 2**24, 2**26)


def bench_layouts(device: torch.device) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    # A transposed matrix and a channels_last NCHW tensor, both 2^26 elements
    # on a GPU (the size of the largest contiguous case) and 2^20 on the CPU.
    if device.type == "cpu":
        return (1024, 1024), (16, 64, 32, 32)
    return (8192, 8192), (64, 256, 64, 64)


def bench_tensors(
    n_tensors: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator, *, sweep: bool = False
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """``n_tensors`` contiguous random tensors per size, then (not in a sweep)
    the same number in each layout of ``bench_layouts``: the kernels must keep
    torch's pace there without copying."""
    for n in bench_sizes(device, sweep=sweep):
        yield f"2^{int(math.log2(n))}", [randn((n,), dtype, device, gen) for _ in range(n_tensors)]
    if sweep:
        return
    (rows, cols), nchw = bench_layouts(device)
    yield f"transposed {rows}x{cols}", [randn((cols, rows), dtype, device, gen).t() for _ in range(n_tensors)]
    yield (
        "channels_last " + "x".join(map(str, nchw)),
        [randn(nchw, dtype, device, gen).contiguous(memory_format=torch.channels_last) for _ in range(n_tensors)],
    )


def streaming_cost(*tensors: torch.Tensor, flops_per_element: int) -> Cost:
    """Each tensor read or written once; FLOPs per element of the first."""
    return Cost(bytes=sum(t.numel() * t.element_size() for t in tensors), flops=flops_per_element * tensors[0].numel())


# --- bad inputs every elementwise operator must refuse ---


def bad_elementwise(op: str, names: Sequence[str], device: torch.device, extra: tuple = ()) -> list[BadInput]:
    """Integer and complex dtypes, and (with two or more tensors) mismatched
    dtypes, shapes and devices. ``extra`` is appended to every call's arguments."""
    qual = f"opforge::{op}"
    k = len(names)

    def f32(*shape: int, dev: torch.device = device) -> torch.Tensor:
        return torch.randn(shape, device=dev)

    cases = [
        rules.FLOATING.bad(
            f"{dtype_name} input",
            (torch.ones(4, device=device).to(dtype), *[f32(4)] * (k - 1), *extra),
            qual,
            name=names[0],
            got=dtype,
        )
        for dtype_name, dtype in (("int32", torch.int32), ("complex", torch.complex64))
    ]
    if k >= 2:
        a, b = names[0], names[1]
        rest = [f32(4)] * (k - 2)
        cases += [
            rules.SAME_DTYPE.bad(
                "dtype mismatch", (f32(4), f32(4).double(), *rest, *extra), qual, a=a, b=b, got_a=torch.float32, got_b=torch.float64
            ),
            rules.SAME_SHAPE.bad("shape mismatch", (f32(3), f32(4), *rest, *extra), qual, a=a, b=b, got_a=[3], got_b=[4]),
            rules.SAME_SHAPE.bad("broadcastable shapes", (f32(3, 4), f32(4), *rest, *extra), qual, a=a, b=b, got_a=[3, 4], got_b=[4]),
        ]
        if device.type == "cuda":
            cases.append(
                rules.SAME_DEVICE.bad(
                    "device mismatch",
                    (f32(4), f32(4, dev=torch.device("cpu")), *rest, *extra),
                    qual,
                    a=a,
                    b=b,
                    got_a=rules.ANY_CUDA,
                    got_b="cpu",
                )
            )
    return cases
