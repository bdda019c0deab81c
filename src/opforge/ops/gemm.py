"""gemm: C = A @ B for A [M, K] and B [K, N], the GEMM tutorial's GEMM operator grown up.

One dtype for A, B and C (float32, float16, bfloat16 or float64); accumulation
in float32 (float64 for float64), a half-type C rounded once. CUDA: tiled
float32 and tensor-core bfloat16/float16 kernels (csrc/ops/gemm/gemm_kernel.h);
CPU: opforge's own blocked, threaded kernel (csrc/ops/gemm/gemm_cpu.h).
Differentiable through the same operator: dA = dC @ B^T, dB = A^T @ dC.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from opforge.autograd import add_tangents
from opforge.ops import _rules as rules
from opforge.ops._elementwise import randn
from opforge.ops._rules import expect_2d, expect_floating, expect_like
from opforge.opspec import BadInput, Cost, OpSpec, Sample

OP = "opforge::gemm"

# M, N and K are 32-bit in the kernels (csrc/ops/gemm/gemm.cpp: kMaxDim).
MAX_DIM = 2**31 - 1


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


# --- fake kernel: the C++ checks, same words (csrc/ops/gemm/gemm.cpp) ---


def _fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    expect_floating(OP, "a", a)
    expect_like(OP, "a", a, "b", b)
    expect_2d(OP, "a", a, "[M, K]")
    expect_2d(OP, "b", b, "[K, N]")
    torch._check(
        a.shape[1] == b.shape[0],
        lambda: (
            f"{OP}: a [M, K] and b [K, N] must agree in K: a.size(1) must equal b.size(0), got shapes {list(a.shape)} and {list(b.shape)}"
        ),
    )
    for what, value in (("M (a.size(0))", a.shape[0]), ("K (a.size(1))", a.shape[1]), ("N (b.size(1))", b.shape[1])):
        torch._check(
            value <= MAX_DIM,
            lambda what=what, value=value: (
                f"{OP}: {what} = {value} is past the kernels' limit of 2^31 - 1 (a has shape {list(a.shape)}, b {list(b.shape)})"
            ),
        )
    return a.new_empty(a.shape[0], b.shape[1])


# --- autograd: both gradients are gemms ---


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    # Inputs, saved by reference (no copy): dA needs B and dB needs A.
    a, b = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    # The transposes are views; the operator copies them to row-major (a
    # [K, N] or [M, K] copy against the 2MNK of the product).
    grad_a = torch.ops.opforge.gemm(grad, b.t()) if need_a else None  # [M, N] @ [N, K]
    grad_b = torch.ops.opforge.gemm(a.t(), grad) if need_b else None  # [K, M] @ [M, N]
    return grad_a, grad_b


# --- operands and samples ---


def make_operands(
    M: int, N: int, K: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator | None, layout: str = "contiguous"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random A [M, K] and B [K, N] laid out as ``layout`` says. A ~ N(0, 1) and
    B ~ N(0, 1 / K), so every entry of C is about N(0, 1) whatever K is: the
    tolerances below are in units of the output."""
    scale = 1 / math.sqrt(max(K, 1))

    def draw(rows: int, cols: int, how: str) -> torch.Tensor:
        match how:
            case "transposed":
                return randn((cols, rows), dtype, device, gen).t()
            case "strided":  # every other column of a wider matrix
                return randn((rows, 2 * cols), dtype, device, gen)[:, ::2]
            case "offset":  # starts one element past an aligned address
                return randn((rows * cols + 1,), dtype, device, gen)[1:].view(rows, cols)
            case "sliced":  # a block inside a larger matrix: row stride != cols
                return randn((rows + 3, cols + 5), dtype, device, gen)[2 : rows + 2, 3 : cols + 3]
            case _:
                return randn((rows, cols), dtype, device, gen)

    how_a, how_b = _LAYOUTS[layout]
    a = draw(M, K, how_a)
    b = draw(K, N, how_b)
    with torch.no_grad():
        b.mul_(scale)  # in place, so a view keeps its layout
    return a, b


# layout -> (A's, B's)
_LAYOUTS: dict[str, tuple[str, str]] = {
    "contiguous": ("", ""),
    "transposed a": ("transposed", ""),
    "transposed b": ("", "transposed"),
    "transposed a and b": ("transposed", "transposed"),
    "strided a and b": ("strided", "strided"),
    "offset a and b": ("offset", "offset"),
    "sliced a, transposed b": ("sliced", "transposed"),
}

# (M, N, K, layout). The first ones are small (gradcheck perturbs every input
# element; torch.compile's check takes the first), then odd shapes,
# vectors (M = 1, N = 1, K = 1), every layout, the empty cases, and sizes past
# the CPU kernel's register tiles (12 x 32), cache blocks (144 x 512 x 192)
# and one task per thread.
_SAMPLES: tuple[tuple[int, int, int, str], ...] = (
    (9, 11, 10, "contiguous"),
    (1, 1, 1, "contiguous"),
    (7, 1, 13, "contiguous"),
    (1, 7, 13, "transposed a"),
    (13, 7, 1, "contiguous"),
    (8, 6, 12, "transposed b"),
    (10, 9, 8, "strided a and b"),
    (6, 5, 7, "offset a and b"),
    (12, 14, 9, "transposed a and b"),
    (11, 13, 15, "sliced a, transposed b"),
    (59, 97, 1025, "contiguous"),
    (33, 65, 17, "transposed a and b"),
    (97, 59, 130, "strided a and b"),
    (145, 513, 193, "contiguous"),
    (300, 77, 385, "transposed a"),
    (5, 6, 0, "contiguous"),
    (0, 6, 5, "contiguous"),
    (4, 0, 5, "contiguous"),
    (0, 0, 0, "contiguous"),
)


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for M, N, K, layout in _SAMPLES:
        yield Sample(make_operands(M, N, K, dtype, device, gen, layout), desc=f"M={M} N={N} K={K}, {layout}")


# --- tolerances: they grow with K ---

# Unit roundoff of each dtype (half an ulp at 1) and of its accumulator.
_U_OUT: dict[torch.dtype, float] = {torch.float64: 2**-53, torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}
_U_ACC: dict[torch.dtype, float] = {torch.float64: 2**-53, torch.float32: 2**-24, torch.float16: 2**-24, torch.bfloat16: 2**-24}


def tolerance(dtype: torch.dtype, K: int) -> tuple[float, float]:
    """(atol, rtol) against the float64 reference for a product over ``K``,
    operands from ``make_operands`` (outputs of unit scale).

    The output is the accumulated sum rounded once to ``dtype``: off by at most
    u_out |C| (rtol = 2 u_out, the factor 2 leaving room for the rounding of
    an already inexact sum) plus the accumulation's error (atol):

    * float32 and float64 accumulate in their own type with round-to-nearest
      FMAs. A plain sequential float32 sum over K (unfused multiply and add,
      the least accurate order a kernel uses; blocked and split-K sums do
      better) was measured at most 3.9 u sqrt(K) from float64 over 4M outputs
      (K = 64 ... 8192, u = 2^-24), RMS 0.30 u sqrt(K): atol = 8 u sqrt(K).
      float64 doubles it, the reference being a float64 sum in another order.
      float32 at K = 8192: 4.3e-5, far under the 1e-3 bound.
    * float16 and bfloat16 accumulate in float32, but tensor cores add products
      into the accumulator with truncation (Fasi, Higham, Mikaitis, Pranesh,
      "Numerical behavior of NVIDIA tensor cores", 2021): biased errors that
      can grow like K rather than sqrt(K). atol = u32 K: 4.9e-4 at K = 8192,
      an eighth of bfloat16's half-ulp at 1. rtol: 2^-7 for bfloat16 (between
      the 1e-3 and 1e-2 bounds), 2^-10 for float16.
    """
    k = max(K, 1)
    u_acc = _U_ACC[dtype]
    half = dtype in (torch.float16, torch.bfloat16)
    atol = u_acc * k if half else (16 if dtype == torch.float64 else 8) * u_acc * math.sqrt(k)
    return atol, 2 * _U_OUT[dtype]


def _sample_tolerance(sample: Sample, dtype: torch.dtype) -> tuple[float, float]:
    return tolerance(dtype, sample.args[0].shape[1])


# Without a sample (nothing in opforge asks so): the bound at the largest K benchmarked.
_K_MAX = 8192
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {d: tolerance(d, _K_MAX) for d in _U_OUT}


# --- bad inputs: each names the op and the bad value ---


def _bad_inputs(device: torch.device) -> list[BadInput]:
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = make_operands(3, 5, 4, torch.float32, device, gen)
    f32 = lambda *shape: torch.randn(shape, device=device)  # noqa: E731
    big = 2**31

    def bad(desc: str, args: tuple[Any, ...], match: str, error: type[Exception] = RuntimeError) -> BadInput:
        return BadInput(desc, args, match=rf"^{OP}: {match}", error=error)

    # Shapes of 2^31 rows or columns as expanded views (stride 0): no memory.
    huge_m = torch.zeros(1, 4, device=device).expand(big, 4)
    huge_n = torch.zeros(4, 1, device=device).expand(4, big)
    huge_k_a = torch.zeros(3, 1, device=device).expand(3, big)
    huge_k_b = torch.zeros(1, 5, device=device).expand(big, 5)
    cases = [
        *[
            rules.FLOATING.bad(f"{desc} a", (a.to(dtype), b.to(dtype) if both else b), OP, name="a", got=dtype)
            for desc, dtype, both in (("int32", torch.int32, False), ("int64", torch.int64, True), ("complex", torch.complex64, False))
        ],
        *[
            rules.SAME_DTYPE.bad(desc, (a.to(da), b.to(db)), OP, a="a", b="b", got_a=da, got_b=db)
            for desc, da, db in (
                ("float64 b", torch.float32, torch.float64),
                ("int32 b", torch.float32, torch.int32),
                ("bfloat16 a, float16 b", torch.bfloat16, torch.float16),
            )
        ],
        *[
            rules.TWO_D.bad(f"{x.dim()}-D {name}", (x, b) if name == "a" else (a, x), OP, name=name, layout=layout, got=x.shape)
            for name, layout, x in (
                ("a", "[M, K]", f32(4)),
                ("a", "[M, K]", f32()),
                ("a", "[M, K]", f32(2, 3, 4)),
                ("b", "[K, N]", f32(4)),
                ("b", "[K, N]", f32(1, 4, 5)),
            )
        ],
        bad(
            "inner dimensions differ",
            (a, f32(5, 5)),
            r"a \[M, K\] and b \[K, N\] must agree in K: a\.size\(1\) must equal b\.size\(0\), got shapes \[3, 4\] and \[5, 5\]",
        ),
        bad("b transposed by mistake", (a, b.t()), r"a \[M, K\] and b \[K, N\] must agree in K: .*got shapes \[3, 4\] and \[5, 4\]"),
        bad(
            "M past 2^31 - 1",
            (huge_m, b),
            rf"M \(a\.size\(0\)\) = {big} is past the kernels' limit of 2\^31 - 1 \(a has shape \[{big}, 4\], b",
        ),
        bad("N past 2^31 - 1", (a, huge_n), rf"N \(b\.size\(1\)\) = {big} is past the kernels' limit of 2\^31 - 1 .*b \[4, {big}\]\)"),
        bad("K past 2^31 - 1", (huge_k_a, huge_k_b), rf"K \(a\.size\(1\)\) = {big} is past the kernels' limit of 2\^31 - 1"),
    ]
    if device.type == "cuda":
        cpu = torch.device("cpu")
        cases += [
            rules.SAME_DEVICE.bad("b on the CPU", (a, b.to(cpu)), OP, a="a", b="b", got_a=rules.ANY_CUDA, got_b="cpu"),
            rules.SAME_DEVICE.bad("a on the CPU", (a.to(cpu), b), OP, a="a", b="b", got_a="cpu", got_b=rules.ANY_CUDA),
        ]
    else:
        # No second device on a CPU-only machine: a meta tensor stands in for one.
        cases.append(rules.SAME_DEVICE.bad("b on the meta device", (a, b.to("meta")), OP, a="a", b="b", got_a="cpu", got_b="meta"))
    return cases


# --- cost and benchmark cases ---


def _cost(a: torch.Tensor, b: torch.Tensor) -> Cost:
    # A and B read once and C written once: what a kernel whose tiles are
    # reused from cache must move at least. FLOPs: a multiply and an add per
    # term of every output.
    M, K = a.shape
    N = b.shape[1]
    return Cost(bytes=(M * K + K * N + M * N) * a.element_size(), flops=2 * M * N * K)


# The GPU shapes (M, N, K): square, odd (every dimension a tail), a
# short K and a 16-row C (decode-like, bandwidth-bound on B).
GPU_BENCH: tuple[tuple[int, int, int], ...] = (
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (4095, 4097, 4093),
    (8192, 8192, 512),
    (16, 8192, 8192),
)
# CPU shapes small enough for CI's two cores; 1024^3 only where torch.matmul
# itself is fast (its float16 path runs at ~3 GFLOP/s on CPUs without
# AVX512-FP16, and would take minutes to time).
CPU_BENCH: tuple[tuple[int, int, int], ...] = ((256, 256, 256), (512, 512, 512), (253, 259, 509))
CPU_BENCH_LARGE: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024),)


def _bench_desc(M: int, N: int, K: int) -> str:
    return f"{M}^3" if M == N == K else f"{M}x{N}x{K}"


def _bench_cases(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    shapes = GPU_BENCH if device.type != "cpu" else CPU_BENCH + (CPU_BENCH_LARGE if dtype != torch.float16 else ())
    for M, N, K in shapes:
        yield Sample(make_operands(M, N, K, dtype, device, gen), desc=_bench_desc(M, N, K))


def _jvp(inputs, tangents, output):  # noqa: ANN001, ANN202
    # d(a @ b) = da @ b + a @ db, each product by the operator itself.
    (a, b), (t_a, t_b) = inputs, tangents
    return add_tangents(
        None if t_a is None else torch.ops.opforge.gemm(t_a, b),
        None if t_b is None else torch.ops.opforge.gemm(a, t_b),
    )


def _sharding(a: Any, b: Any) -> list[tuple[list[Any], list[Any]]]:
    """The matmul strategies, so that column- and row-parallel layers compose."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, P = Replicate(), Partial()
    return [
        ([Shard(0)], [Shard(0), R]),  # rows of a: data and sequence parallel
        ([Shard(1)], [R, Shard(1)]),  # columns of b: column-parallel
        ([P], [Shard(1), Shard(0)]),  # K: row-parallel, each rank a partial sum
        ([P], [P, R]),  # linear in a ...
        ([P], [R, P]),  # ... and in b
        ([R], [R, R]),
    ]


SPECS = [
    OpSpec(
        name="gemm",
        jvp=_jvp,
        doc=(
            "C = a @ b for a [M, K] and b [K, N] of one floating dtype, accumulated in float32 (float64 for "
            "float64) and rounded once: a tiled float32 kernel and a tensor-core bfloat16/float16 kernel on CUDA, "
            "a blocked, threaded kernel on the CPU. Any M, N, K (K = 0 gives zeros); non-contiguous operands are "
            "copied to row-major first. Differentiable: dA = dC @ b^T and dB = a^T @ dC, through the same operator."
        ),
        reference=reference,
        samples=_samples,
        bad_inputs=_bad_inputs,
        cost=_cost,
        bench_cases=_bench_cases,
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
        tolerances=TOLERANCES,
        sample_tolerance=_sample_tolerance,
        # An Inf meets a zero in some product (NaN) and huge entries overflow or
        # not by the order of a K-long sum, which the reference does not share:
        # no one answer for special values to be held to.
        special_values=False,
        sharding=_sharding,
    ),
]
