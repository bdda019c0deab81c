"""qqq_gemm: the QQQ GEMM tutorial's W4A8 GEMM (the QQQ method).

    out[M, N] = (a[M, K] @ Wq[K, N]) * s_tok[M, None] * s_ch[None, N]

``a`` int8 activations quantised per token (``opforge.quant.quantize_act_int8``),
``Wq`` int4 weights packed for the kernel (``opforge.quant.quantize_weight_w4``),
times integer group scales ``s_group`` in the per-group scheme. The sum is
exact in int32 on every device; the one float32 epilogue,
``cvt(((float)acc * s_tok[m]) * s_ch[n])``, is the same on the CPU and the GPU,
so their outputs are bitwise equal. Layout and schemes:
``csrc/ops/qqq_gemm/LAYOUT.md``. Not differentiable (a quantised inference op).

Tolerances, against the float64 value of the same quantised product: the int32
sum is exact, so the only errors are the epilogue's. ``(float)acc`` and the two
float32 products each round once (at most 2^-24 relative each, 3 x 2^-24 in
all), then the output rounds once to its dtype (at most 2^-11 relative in
float16, 2^-8 in bfloat16, nothing more in float32). Hence rtol = the output's
half ulp + 2^-21 (a bound on the float32 part), and atol = half the smallest
subnormal step of the output, for results so small they are subnormal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from opforge.ops import _rules as rules
from opforge.ops._rules import expect_2d, expect_shape
from opforge.opspec import BadInput, Cost, OpSpec, Sample
from opforge.quant import MAX_K, UNIT, dequantize_weight_w4, pack_int4, packed_view, quantize_act_int8, quantize_weight_w4, stripe_view

OP = "opforge::qqq_gemm"
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (2.0**-25, 2.0**-11 + 2.0**-21),
    torch.bfloat16: (2.0**-134, 2.0**-8 + 2.0**-21),
    torch.float32: (2.0**-150, 2.0**-21),
}


# --- the reference: dequantise, then a floating matmul ---


def reference(
    a: torch.Tensor,
    w_packed: torch.Tensor,
    s_tok: torch.Tensor,
    s_ch: torch.Tensor,
    s_group: torch.Tensor | None = None,
    group_size: int = -1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The integer weight ``q * s_group`` dequantised to the scales' dtype
    (float32 as users call it), ``torch.matmul`` with the activations, then the
    scales: ``(a @ (q * s_group)) * s_tok[:, None] * s_ch[None, :]``, returned in
    ``out_dtype``. With float64 scales (opforge's checks convert every argument
    to float64) the integer tensors arrive as exact float64 values, the matmul
    of integers below 2^53 is exact, and the product is returned in float64:
    the value that the kernel's output rounds."""
    dt = s_ch.dtype
    ones = torch.ones_like(s_ch)
    w_packed = packed_view(w_packed)  # the 3-D stripe view: the same packed weight
    qs = dequantize_weight_w4(w_packed.to(torch.int32), ones, None if s_group is None else s_group.to(torch.int32), group_size, dtype=dt)
    out = torch.matmul(a.to(dt), qs) * s_tok.to(dt).unsqueeze(1) * s_ch.unsqueeze(0)
    return out if dt == torch.float64 else out.to(out_dtype or torch.float16)


# --- the fake kernel: the C++ checks, same words (csrc/ops/qqq_gemm/qqq_gemm.cpp) ---

_WHY = {
    "a": "per-token quantised activations",
    "w_packed": "int4 weights packed by opforge.quant.quantize_weight_w4",
    "s_tok": "per-token activation scales",
    "s_ch": "per-channel weight scales",
    "s_group": "integer group scales in [1, 16]",
}


def _expect_dtype(name: str, t: torch.Tensor, want: torch.dtype) -> None:
    torch._check_value(t.dtype == want, lambda: f"{OP}: {name} must be {want} ({_WHY[name]}), got {t.dtype}")


def _expect_device(name: str, t: torch.Tensor, a: torch.Tensor) -> None:
    rules.SAME_DEVICE.check(t.device == a.device, OP, a="a", b=name, got_a=a.device, got_b=t.device)


def _fake(
    a: torch.Tensor,
    w_packed: torch.Tensor,
    s_tok: torch.Tensor,
    s_ch: torch.Tensor,
    s_group: torch.Tensor | None = None,
    group_size: int = -1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    _expect_dtype("a", a, torch.int8)
    expect_2d(OP, "a", a, "[M, K]")
    _expect_dtype("w_packed", w_packed, torch.int32)
    torch._check(
        w_packed.dim() in (2, 3),
        lambda: f"{OP}: w_packed must be 2-D [K / 8, N] or 3-D [N / 32, K / 32, 128], got shape {list(w_packed.shape)}",
    )
    stripes = w_packed.dim() == 3
    _expect_dtype("s_tok", s_tok, torch.float32)
    _expect_dtype("s_ch", s_ch, torch.float32)
    for name, t in (("w_packed", w_packed), ("s_tok", s_tok), ("s_ch", s_ch)):
        _expect_device(name, t, a)
    M, K, N = a.shape[0], a.shape[1], w_packed.shape[0] * UNIT if stripes else w_packed.shape[1]
    torch._check(K % UNIT == 0, lambda: f"{OP}: K = a.size(1) must be a multiple of {UNIT} (the packed unit), got {K}")
    torch._check(N % UNIT == 0, lambda: f"{OP}: N = w_packed.size(1) must be a multiple of {UNIT} (the packed unit), got {N}")
    torch._check(K <= MAX_K, lambda: f"{OP}: K must be at most {MAX_K} so that the int32 accumulator cannot overflow, got {K}")
    if stripes:
        expect_shape(OP, "w_packed", w_packed, [N // UNIT, K // UNIT, 4 * UNIT], "[N / 32, K / 32, 128]")
    else:
        expect_shape(OP, "w_packed", w_packed, [K // 8, N], "[K / 8, N]")
    torch._check(
        w_packed.is_contiguous(),
        lambda: f"{OP}: w_packed must be contiguous (its memory is the packed layout), got strides {list(w_packed.stride())}",
    )
    expect_shape(OP, "s_tok", s_tok, [M], "[M]")
    expect_shape(OP, "s_ch", s_ch, [N], "[N]")
    if s_group is not None:
        _expect_dtype("s_group", s_group, torch.int8)
        _expect_device("s_group", s_group, a)
        torch._check(
            group_size > 0 and group_size % UNIT == 0 and K % group_size == 0,
            lambda: f"{OP}: group_size must be a positive multiple of {UNIT} that divides K = {K} when s_group is given, got {group_size}",
        )
        expect_shape(OP, "s_group", s_group, [K // group_size, N], "[K / group_size, N]")
    else:
        torch._check(group_size == -1, lambda: f"{OP}: group_size must be -1 (per channel) when s_group is None, got {group_size}")
    dt = out_dtype or torch.float16
    torch._check_value(dt in OUT_DTYPES, lambda: f"{OP}: out_dtype must be float16, bfloat16 or float32, got {dt}")
    return a.new_empty((M, N), dtype=dt)


# --- samples ---


QArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]


def make_args(M: int, K: int, N: int, group_size: int, device: torch.device, gen: torch.Generator | None) -> QArgs:
    """(a, w_packed, s_tok, s_ch, s_group, group_size) from realistic floats:
    unit-normal activations and a Kaiming-scaled weight, quantised by opforge.quant."""
    x = torch.randn(M, K, generator=gen, device=device)
    w = torch.randn(K, N, generator=gen, device=device) / max(K, 1) ** 0.5
    a, s_tok = quantize_act_int8(x)
    qw = quantize_weight_w4(w, group_size)
    return a, qw.w_packed, s_tok, qw.s_ch, qw.s_group, qw.group_size


def extreme_args(M: int, K: int, N: int, group_size: int, device: torch.device, gen: torch.Generator) -> QArgs:
    """The integer extremes: a in {-128, 127}, q in {-8, 7}, group scales in
    {1, 16}, so every product is as large as the format allows (the int32
    bound's worst case), scales small enough that float16 does not overflow."""

    def pick(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.where(torch.rand(shape, generator=gen, device=device) < 0.5, lo, hi)

    a = pick(-128, 127, M, K).to(torch.int8)
    w_packed = pack_int4(pick(-8, 7, K, N))
    s_group = pick(1, 16, K // group_size, N).to(torch.int8) if group_size > 0 else None
    s_tok = (torch.rand(M, generator=gen, device=device) + 0.5) * 1e-4
    s_ch = (torch.rand(N, generator=gen, device=device) + 0.5) * 1e-4
    return a, w_packed, s_tok, s_ch, s_group, group_size


# (M, K, N, group_size, layout): M in {1, 7, 16, 33, 128} and odd
# ones (59, 97, 1025 rows), several multiples of 32 for K and N, per channel
# and per group, K = 0 and M = 0, and the layouts the wrapper copies.
_SAMPLES: tuple[tuple[int, int, int, int, str], ...] = (
    (7, 64, 32, -1, "contiguous"),
    # The 3-D stripe view; sizes that shard over 2 and 4 ranks (columns and K) and M that does not.
    (7, 128, 128, 32, "stripe view"),
    (5, 256, 64, -1, "stripe view"),
    (1, 32, 64, -1, "contiguous"),
    (16, 128, 96, 128, "contiguous"),
    (33, 96, 160, 32, "contiguous"),
    (1, 256, 128, 128, "contiguous"),
    (59, 160, 64, -1, "transposed a"),
    (7, 128, 32, 64, "a offset by one byte"),
    (16, 64, 64, -1, "strided s_ch, expanded s_tok"),
    (97, 384, 96, 128, "contiguous"),
    (128, 256, 256, -1, "contiguous"),
    (128, 512, 160, 128, "contiguous"),
    (5, 1024, 64, -1, "extremes"),
    (3, 1024, 96, 128, "extremes"),
    (1025, 64, 96, 32, "contiguous"),
    (4, 0, 32, -1, "contiguous"),
    (0, 64, 32, -1, "contiguous"),
)


def _layout(args: QArgs, layout: str, gen: torch.Generator) -> QArgs:
    a, w_packed, s_tok, s_ch, s_group, gs = args
    match layout:
        case "transposed a":
            a = a.t().contiguous().t()
        case "a offset by one byte":
            a = torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view(a.shape)
        case "stripe view":
            w_packed = stripe_view(w_packed)
        case "strided s_ch, expanded s_tok":
            s_ch = torch.stack([s_ch, s_ch * 3], dim=1)[:, 0]
            s_tok = s_tok[:1].expand(s_tok.shape[0])
    return a, w_packed, s_tok, s_ch, s_group, gs


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for M, K, N, gs, layout in _SAMPLES:
        extremes = layout == "extremes"
        args = extreme_args(M, K, N, gs, device, gen) if extremes else _layout(make_args(M, K, N, gs, device, gen), layout, gen)
        scheme = "per channel" if gs == -1 else f"group {gs}"
        yield Sample((*args, dtype), desc=f"M={M} K={K} N={N}, {scheme}, {layout}")


# --- bad inputs: one per check, each naming the op and the value ---


def _bad(device: torch.device) -> list[BadInput]:
    gen = torch.Generator(device=device).manual_seed(0)
    M, K, N, gs = 4, 256, 64, 128
    a, w, st, sc, sg, _ = make_args(M, K, N, gs, device, gen)
    q = OP

    def bad(desc: str, args: tuple[Any, ...], match: str, error: type[Exception] = RuntimeError, **kwargs: Any) -> BadInput:
        return BadInput(desc, args, kwargs, match=rf"^{q}: {match}", error=error)

    def i32(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, device=device, dtype=torch.int32)

    def i8(*shape: int) -> torch.Tensor:
        return torch.randint(-127, 128, shape, generator=gen, device=device, dtype=torch.int8)

    f32 = lambda *shape: torch.rand(shape, generator=gen, device=device) + 0.5  # noqa: E731
    gs_words = r"group_size must be a positive multiple of 32 that divides K = 256 when s_group is given, got"
    cases = [
        bad(
            "float32 a",
            (a.float(), w, st, sc, sg, gs),
            r"a must be torch\.int8 \(per-token quantised activations\), got torch\.float32",
            ValueError,
        ),
        bad("uint8 a", (a.to(torch.uint8), w, st, sc, sg, gs), r"a must be torch\.int8 .*, got torch\.uint8", ValueError),
        rules.TWO_D.bad("1-D a", (a.reshape(-1), w, st, sc, sg, gs), q, name="a", layout="[M, K]", got=[1024]),
        bad(
            "int8 w_packed",
            (a, w.to(torch.int8), st, sc, sg, gs),
            r"w_packed must be torch\.int32 \(int4 weights .*\), got torch\.int8",
            ValueError,
        ),
        bad(
            "4-D w_packed",
            (a, w[None, None], st, sc, sg, gs),
            r"w_packed must be 2-D \[K / 8, N\] or 3-D \[N / 32, K / 32, 128\], got shape \[1, 1, 32, 64\]",
        ),
        rules.SHAPE.bad(
            "3-D w_packed that is no stripe view",
            (a, w[None], st, sc, sg, gs),
            q,
            name="w_packed",
            how="[N / 32, K / 32, 128]",
            want=[1, 8, 128],
            got=[1, 32, 64],
        ),
        rules.SHAPE.bad(
            "stripe view of another K",
            (a, stripe_view(i32(K // 8 + 4, N)), st, sc, sg, gs),
            q,
            name="w_packed",
            how="[N / 32, K / 32, 128]",
            want=[2, 8, 128],
            got=[2, 9, 128],
        ),
        bad(
            "float16 s_tok", (a, w, st.half(), sc, sg, gs), r"s_tok must be torch\.float32 \(per-token .*\), got torch\.float16", ValueError
        ),
        bad(
            "float64 s_ch",
            (a, w, st, sc.double(), sg, gs),
            r"s_ch must be torch\.float32 \(per-channel .*\), got torch\.float64",
            ValueError,
        ),
        bad(
            "K not a multiple of 32", (i8(M, 48), i32(6, N), st, sc, None, -1), r"K = a\.size\(1\) must be a multiple of 32 \(.*\), got 48"
        ),
        bad(
            "N not a multiple of 32",
            (a, i32(K // 8, 48), st, f32(48), None, -1),
            r"N = w_packed\.size\(1\) must be a multiple of 32 .*, got 48",
        ),
        bad(
            "K past the int32 bound",
            (i8(1, MAX_K + 32), i32((MAX_K + 32) // 8, 32), f32(1), f32(32), None, -1),
            rf"K must be at most {MAX_K} so that the int32 accumulator cannot overflow, got {MAX_K + 32}",
        ),
        rules.SHAPE.bad(
            "w_packed for another K",
            (a, i32(K // 8 + 4, N), st, sc, sg, gs),
            q,
            name="w_packed",
            how="[K / 8, N]",
            want=[32, 64],
            got=[36, 64],
        ),
        bad(
            "w_packed transposed (not contiguous)",
            (a, i32(N, K // 8).t(), st, sc, sg, gs),
            r"w_packed must be contiguous \(its memory is the packed layout\), got strides \[1, 32\]",
        ),
        rules.SHAPE.bad("s_tok of another M", (a, w, f32(M + 1), sc, sg, gs), q, name="s_tok", how="[M]", want=[4], got=[5]),
        rules.SHAPE.bad("2-D s_ch", (a, w, st, sc[None], sg, gs), q, name="s_ch", how="[N]", want=[64], got=[1, 64]),
        bad(
            "int32 s_group",
            (a, w, st, sc, sg.int(), gs),
            r"s_group must be torch\.int8 \(integer group scales .*\), got torch\.int32",
            ValueError,
        ),
        rules.SHAPE.bad(
            "s_group of another group count",
            (a, w, st, sc, sg[:1], gs),
            q,
            name="s_group",
            how="[K / group_size, N]",
            want=[2, 64],
            got=[1, 64],
        ),
        bad("group_size not a multiple of 32", (a, w, st, sc, sg, 100), rf"{gs_words} 100"),
        bad("group_size 0", (a, w, st, sc, sg, 0), rf"{gs_words} 0"),
        bad("group_size not dividing K", (a, w, st, sc, sg, 96), rf"{gs_words} 96"),
        bad(
            "group_size without s_group", (a, w, st, sc, None, 128), r"group_size must be -1 \(per channel\) when s_group is None, got 128"
        ),
        bad(
            "float64 out_dtype",
            (a, w, st, sc, sg, gs, torch.float64),
            r"out_dtype must be float16, bfloat16 or float32, got torch\.float64",
            ValueError,
        ),
        bad(
            "int32 out_dtype",
            (a, w, st, sc, sg, gs, torch.int32),
            r"out_dtype must be float16, bfloat16 or float32, got torch\.int32",
            ValueError,
        ),
    ]
    if device.type == "cuda":
        cpu = torch.device("cpu")
        misaligned = torch.cat([w.new_zeros(1), w.reshape(-1)])[1:].view(w.shape)
        cases += [
            rules.SAME_DEVICE.bad("s_ch on the CPU", (a, w, st, sc.to(cpu), sg, gs), q, a="a", b="s_ch", got_a=rules.ANY_CUDA, got_b="cpu"),
            rules.SAME_DEVICE.bad(
                "w_packed on the CPU", (a, w.to(cpu), st, sc, sg, gs), q, a="a", b="w_packed", got_a=rules.ANY_CUDA, got_b="cpu"
            ),
            # An address, which a fake tensor does not have: the kernel alone refuses it.
            BadInput(
                "w_packed not 16-byte aligned",
                (a, misaligned, st, sc, sg, gs),
                match=rf"^{q}: w_packed must be 16-byte aligned on the GPU, got",
                traced=False,
            ),
        ]
    else:
        # No second device on a CPU-only machine: a meta tensor stands in for one.
        bad_scale = sg.clone()
        bad_scale[1, 3] = 17
        cases += [
            rules.SAME_DEVICE.bad(
                "s_ch on the meta device", (a, w, st, sc.to("meta"), sg, gs), q, a="a", b="s_ch", got_a="cpu", got_b="meta"
            ),
            # The CUDA kernel writes NaN instead (a value check would need a sync): tests/test_qqq_gemm.py.
            BadInput(
                "group scale 17",
                (a, w, st, sc, bad_scale, gs),
                match=rf"^{q}: s_group values must lie in \[1, 16\], got values in \[\d+, 17\]",
                traced=False,
            ),
        ]
    return cases


# --- cost, benchmark cases and the fp16 baselines ---


def _cost(
    a: torch.Tensor,
    w_packed: torch.Tensor,
    s_tok: torch.Tensor,
    s_ch: torch.Tensor,
    s_group: torch.Tensor | None = None,
    group_size: int = -1,
    out_dtype: torch.dtype | None = None,
) -> Cost:
    M, K = a.shape
    N = w_packed.shape[1]
    out_size = torch.empty((), dtype=out_dtype or torch.float16).element_size()
    scales = 4 * M + 4 * N + (s_group.numel() if s_group is not None else 0)
    return Cost(bytes=M * K + K * N // 2 + scales + M * N * out_size, flops=2 * M * N * K)


# (K, N): K = N = 8192 and the LLM shapes 4096 x 11008, 11008 x 4096.
BENCH_SHAPES = ((8192, 8192), (4096, 11008), (11008, 4096))
BENCH_M = (1, 16, 32, 64, 128)


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    # The CPU kernel is a correctness path: small sizes there, so that
    # `opforge bench` on a CPU-only machine finishes.
    shapes = BENCH_SHAPES if device.type != "cpu" else ((1024, 1024),)
    ms = BENCH_M if device.type != "cpu" else (1, 16)
    for K, N in shapes:
        for M in ms:
            for gs in (-1, 128):
                if device.type == "meta":  # counting cases: no data
                    yield Sample((), desc="")
                    continue
                args = make_args(M, K, N, gs, device, gen)
                scheme = "per channel" if gs == -1 else f"group {gs}"
                yield Sample((*args, dtype), desc=f"M={M} K={K} N={N} {scheme}")


def _fp16_inputs(sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """The float16 activations and weight the quantised ones stand for."""
    a, w_packed, s_tok, s_ch, s_group, gs = sample.args[:6]
    x = (a.float() * s_tok.unsqueeze(1)).half()
    w = dequantize_weight_w4(w_packed, s_ch, s_group, gs, dtype=torch.float32).half()
    return x, w


def _matmul_baseline(sample: Sample) -> tuple[Callable[..., Any], Sample]:
    x, w = _fp16_inputs(sample)
    return torch.matmul, Sample((x, w.contiguous()), desc=sample.desc)


def _linear_baseline(sample: Sample) -> tuple[Callable[..., Any], Sample]:
    x, w = _fp16_inputs(sample)
    return torch.nn.functional.linear, Sample((x, w.t().contiguous()), desc=sample.desc)


# --- sharding: tokens, columns (N) and K, as serving engines shard their quantised linears ---


def _sharding(a: Any, w_packed: Any, s_tok: Any, s_ch: Any, s_group: Any = None, group_size: int = -1, out_dtype: Any = None) -> list:
    """Replicated; tokens (rows of a and s_tok); and on the stripe view of the packed weight
    (quant.stripe_view: its stripes and units of K are dimensions there): column-parallel (the
    weight's stripes, s_ch and the group scales' columns along N; bit for bit one device's columns)
    and row-parallel (a, the weight's units and the group scales' rows along K, s_tok of the whole
    rows replicated: each rank's output a partial sum). Only where the mesh divides the stripes,
    units and groups evenly: a rank's share of K must be whole units and groups, a's share too."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    g = None if s_group is None else R
    rows = [([R], [R, R, R, R, g]), ([Shard(0)], [Shard(0), R, Shard(0), R, g])]
    if w_packed.ndim != 3:
        return rows  # [K / 8, N]: the packed memory's stripes are no dimension of it
    ranks = w_packed.mesh.size()
    stripes, units = w_packed.shape[0], w_packed.shape[1]
    K = units * UNIT
    if stripes % ranks == 0:
        rows.append(([Shard(1)], [R, Shard(0), R, Shard(0), None if s_group is None else Shard(1)]))
    if units % ranks == 0 and (s_group is None or (K // group_size) % ranks == 0):
        rows.append(([Partial()], [Shard(1), Shard(1), R, R, None if s_group is None else Shard(0)]))
    return rows


SPECS = [
    OpSpec(
        name="qqq_gemm",
        no_derivative="an inference kernel on quantised weights: train the float layer",
        doc="W4A8 GEMM: int8 activations [M, K] x packed int4 weights -> [M, N] (opforge.quant makes the arguments).",
        reference=reference,
        samples=_samples,
        bad_inputs=_bad,
        cost=_cost,
        bench_cases=_bench,
        fake=_fake,
        dtypes=OUT_DTYPES,
        tolerances=TOLERANCES,
        # Integer operands and positive finite scales, as opforge.quant makes them:
        # a NaN or an Inf has no quantised form to feed it.
        special_values=False,
        sharding=_sharding,
        baselines={
            # What the quantised layer replaces: torch.matmul in float16 of the
            # same (dequantised) activations and weight, [K, N] row-major ...
            "fp16 matmul": _matmul_baseline,
            # ... and F.linear with the weight as nn.Linear stores it ([N, K]).
            "fp16 linear": _linear_baseline,
        },
    ),
]
