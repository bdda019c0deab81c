"""W4A8 qqq_gemm: the packed layout and the quantisers (opforge.quant),
the operator's exact integer path against an int64 reference, every bad input,
torch.compile through the fake kernel, opcheck, opforge.nn.QQQLinear, and on a
GPU the CUDA kernel bit for bit against the CPU kernel. tests/test_ops.py runs
the spec's generic checks besides."""

from __future__ import annotations

import re

import pytest
import torch

import opforge
from opforge.check.run import generator
from opforge.ops.qqq_gemm import OUT_DTYPES, _bad, extreme_args, make_args, reference
from opforge.quant import (
    MAX_K,
    dequantize_weight_w4,
    pack_int4,
    quantize_act_int8,
    quantize_weight_w4,
    unpack_int4,
)
from opforge.registry import get_specs

from .conftest import DEVICES

CPU = torch.device("cpu")


def exact(a, w_packed, s_tok, s_ch, s_group, group_size, out_dtype):
    """The kernels' result computed independently: the sum in int64 (exact,
    no overflow possible), then the float32 epilogue cvt(((float)acc * s_tok) * s_ch)."""
    q = unpack_int4(w_packed.cpu()).to(torch.int64)
    if s_group is not None:
        q = q * s_group.cpu().to(torch.int64).repeat_interleave(group_size, dim=0)
    acc = a.cpu().to(torch.int64) @ q
    assert acc.abs().max() < 2**31 if acc.numel() else True  # what the int32 accumulator holds
    v = (acc.to(torch.float32) * s_tok.cpu().unsqueeze(1)) * s_ch.cpu().unsqueeze(0)
    return v.to(out_dtype)


# --- the layout and the quantisers ---


def test_layout_matches_layout_md():
    """Every nibble where LAYOUT.md says: word ((nb*KB + kb)*32 + g*4 + t)*4 + j,
    nibble 2i + h holds q[kb*32 + h*16 + t*4 + i, nb*32 + g*4 + j]."""
    K, N = 96, 64
    q = torch.randint(-8, 8, (K, N), dtype=torch.int8)
    words = pack_int4(q).reshape(-1)
    assert pack_int4(q).shape == (K // 8, N)
    KB = K // 32
    for nb in range(N // 32):
        for kb in range(KB):
            for g in range(8):
                for t in range(4):
                    for j in range(4):
                        w = int(words[((nb * KB + kb) * 32 + g * 4 + t) * 4 + j]) & 0xFFFFFFFF
                        for i in range(4):
                            for h in range(2):
                                nib = (w >> (4 * (2 * i + h))) & 0xF
                                assert nib - 16 * (nib >= 8) == q[kb * 32 + h * 16 + t * 4 + i, nb * 32 + g * 4 + j]


@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (1024, 160), (0, 32)], ids=str)
def test_pack_unpack_round_trip_bit_exact(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    # Every 32-bit pattern is a valid packed tensor: the other direction too.
    w = torch.randint(-(2**31), 2**31 - 1, (shape[0] // 8, shape[1]), generator=gen, dtype=torch.int32)
    assert torch.equal(pack_int4(unpack_int4(w)), w)


@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_quantize_weight_bounds_and_exact_dequantisation(group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    K, N = 256, 96
    w = torch.randn(K, N, generator=gen) / 16
    qw = quantize_weight_w4(w, group_size)
    q = unpack_int4(qw.w_packed)
    assert qw.w_packed.dtype == torch.int32 and qw.s_ch.dtype == torch.float32 and qw.group_size == group_size
    step = qw.s_ch.expand(K, N).clone()
    qs = q.float()
    if group_size == -1:
        assert qw.s_group is None
        torch.testing.assert_close(qw.s_ch, w.abs().amax(0) / 7)
        assert q.abs().max() <= 7
    else:
        assert qw.s_group.dtype == torch.int8 and qw.s_group.shape == (K // group_size, N)
        assert qw.s_group.min() >= 1 and qw.s_group.max() <= 16
        assert (qw.s_group.amax(0) == 16).all()  # the group with the column's maximum uses the full range
        s_rep = qw.s_group.float().repeat_interleave(group_size, 0)
        step, qs = step * s_rep, qs * s_rep
    deq = dequantize_weight_w4(*qw)
    # Exactly s_ch * (s_group * q): the inverse of the packing, computed independently.
    assert torch.equal(deq, qs * qw.s_ch)
    # Round to nearest: within half a step of w (a float32 ulp of slack).
    assert ((deq - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert (deq - w).norm() / w.norm() < 0.2


def test_quantize_act_per_token(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    x[1, 2] = 0
    a, s = quantize_act_int8(x)
    assert a.dtype == torch.int8 and a.shape == (15, 64) and s.shape == (15,)
    x2 = x.reshape(15, 64)
    assert s[7] == 1 and (a[7] == 0).all()  # an all-zero row
    torch.testing.assert_close(s[s != 1], x2.abs().amax(1)[s != 1] / 127)
    assert (a.abs() <= 127).all() and (a.abs().amax(1)[s != 1] == 127).all()
    assert ((a.float() * s[:, None] - x2).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_weight_w4(torch.randn(48, 32)), r"quantize_weight_w4: K and N must be multiples of 32 .*, got K = 48, N = 32"),
        (lambda: quantize_weight_w4(torch.randn(64, 40)), r"got K = 64, N = 40"),
        (
            lambda: quantize_weight_w4(torch.randn(256, 32), 100),
            r"group_size must be -1 or a positive multiple of 32 that divides K = 256, got 100",
        ),
        (lambda: quantize_weight_w4(torch.randn(32, 32).int()), r"w must be a 2-D floating tensor"),
        (lambda: quantize_weight_w4(torch.full((32, 32), float("nan"))), r"NaN or Inf"),
        (lambda: pack_int4(torch.full((32, 32), 8)), r"values must lie in \[-8, 7\], got \[8, 8\]"),
        (lambda: quantize_act_int8(torch.ones(3, 4, dtype=torch.int32)), r"x must be a floating tensor"),
    ],
    ids=["K", "N", "group_size", "dtype", "nan", "pack range", "act dtype"],
)
def test_quantiser_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the operator ---


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [-1, 32, 128, 256])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 59, 97, 128, 1025])
def test_exact_integer_path(M, group_size, out_dtype, device, seed):
    """The op's output equals the int64 sum through the float32 epilogue,
    bit for bit, on realistic and on extreme integers."""
    dev = torch.device(device)
    gen = generator(dev, seed)
    K, N = 256, 96
    for args in (make_args(M, K, N, group_size, dev, gen), extreme_args(M, K, N, group_size, dev, gen)):
        got = opforge.qqq_gemm(*args, out_dtype)
        assert got.dtype == out_dtype and got.shape == (M, N) and got.device.type == dev.type
        want = exact(*args, out_dtype)
        assert torch.equal(got.cpu(), want), f"{(got.cpu().float() != want.float()).sum()} of {want.numel()} differ"
        # And close to the float64 reference within the spec's (justified) tolerance.
        ref = reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in args), out_dtype)
        atol, rtol = get_specs(["qqq_gemm"])[0].tolerance(out_dtype)
        torch.testing.assert_close(got.double().cpu(), ref.cpu(), atol=atol, rtol=rtol)


def test_default_out_dtype_is_float16_and_k_zero_gives_zeros():
    a, w, st, sc, _, _ = make_args(5, 64, 32, -1, CPU, None)
    assert opforge.qqq_gemm(a, w, st, sc).dtype == torch.float16
    a0, w0, st0, sc0, _, _ = make_args(3, 0, 64, -1, CPU, None)
    out = opforge.qqq_gemm(a0, w0, st0, sc0, None, -1, torch.float32)
    assert out.shape == (3, 64) and (out == 0).all()


def test_tolerance_is_tight_enough_to_fail():
    """The spec's float16 tolerance rejects an output one float16 ulp off."""
    args = make_args(16, 256, 64, 128, CPU, torch.Generator().manual_seed(0))
    got = opforge.qqq_gemm(*args, torch.float16)
    ref = reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in args), torch.float16)
    atol, rtol = get_specs(["qqq_gemm"])[0].tolerance(torch.float16)
    off = got.clone()
    i = int(got.abs().argmax())
    off.view(torch.int16).view(-1)[i] += 1  # one ulp further from zero
    with pytest.raises(AssertionError):
        torch.testing.assert_close(off.double(), ref, atol=atol, rtol=rtol)


_BAD = {b.desc: b for b in _bad(CPU)}


@pytest.mark.parametrize("desc", list(_BAD))
def test_bad_input_raises_a_clear_error(desc):
    bad = _BAD[desc]
    with pytest.raises(bad.error, match=bad.match):
        torch.ops.opforge.qqq_gemm(*bad.args, **bad.kwargs)


def test_bad_inputs_under_the_fake_kernel():
    """The fake kernel (torch.compile, FakeTensor) raises the same words at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for desc, bad in _BAD.items():
        if "meta" in desc or "group scale" in desc:
            continue  # a value check (CPU only) and the meta device's own case
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(bad.error, match=bad.match.removeprefix("^")):
            torch.ops.opforge.qqq_gemm(*bad.args, **bad.kwargs)


def test_compile_fullgraph_with_the_fake_kernel(seed):
    torch._dynamo.reset()
    args = make_args(7, 128, 64, 32, CPU, torch.Generator().manual_seed(seed))

    def f(a, w, st, sc, sg):
        return torch.ops.opforge.qqq_gemm(a, w, st, sc, sg, 32, torch.bfloat16) * 2

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(*args[:5]), f(*args[:5]))


def test_opcheck(seed):
    gen = torch.Generator().manual_seed(seed)
    for M, K, N, gs, dt in ((7, 64, 32, -1, torch.float16), (16, 256, 64, 128, torch.bfloat16), (1, 96, 32, 32, torch.float32)):
        torch.library.opcheck(torch.ops.opforge.qqq_gemm.default, (*make_args(M, K, N, gs, CPU, gen), dt))


def test_threaded_cpu_kernel_matches_one_thread(seed):
    args = make_args(9, 512, 512, 128, CPU, torch.Generator().manual_seed(seed))
    many = opforge.qqq_gemm(*args, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = opforge.qqq_gemm(*args, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)


def test_max_k_is_the_int32_bound():
    assert MAX_K == 131040 and MAX_K * 2**14 < 2**31 <= (MAX_K + 32) * 2**14


# --- opforge.nn.QQQLinear ---


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    for layer in (mlp[0], mlp[2]):
        torch.nn.init.kaiming_normal_(layer.weight)  # a Gaussian weight: harder for 4 bits than the default uniform
    return mlp.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size, bound", [(-1, 0.23), (128, 0.20)])
def test_qqq_linear_relative_error_on_a_small_mlp(group_size, bound, device):
    """Measured on this MLP (512 -> 1024 -> GELU -> 256, Kaiming-normal weights,
    64 unit-normal tokens, CPU, 3 input seeds): relative error ||y_q - y|| / ||y||
    of 0.200-0.203 per channel and 0.175-0.178 per group of 128 (round-to-nearest
    4-bit weights, 8-bit per-token activations, no GPTQ, clipping search or
    smoothing). With nn.Linear's default (uniform) initialisation: 0.104 both
    ways. The bounds leave ~13 % of room for other devices and seeds."""
    dev = torch.device(device)
    mlp = _mlp().to(dev)
    q = torch.nn.Sequential(
        opforge.nn.QQQLinear.from_linear(mlp[0], group_size), torch.nn.GELU(), opforge.nn.QQQLinear.from_linear(mlp[2], group_size)
    )
    x = torch.randn(64, 512, generator=generator(dev, 1), device=dev)
    y, yq = mlp(x), q(x)
    assert yq.dtype == torch.float32 and yq.shape == y.shape
    rel = ((yq - y).norm() / y.norm()).item()
    print(f"QQQLinear relative error, group_size {group_size}: {rel:.4f}")
    assert 0.02 < rel < bound


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_act_marks_non_finite_rows(bad, seed):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
    x[2, 17] = bad
    a, s = quantize_act_int8(x)
    assert s[2].isnan() and (a[2] == 0).all()
    assert torch.isfinite(s[[0, 1, 3]]).all()
    ref, _ = quantize_act_int8(x[[0, 1, 3]])
    assert torch.equal(a[[0, 1, 3]], ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_qqq_linear_non_finite_token_gives_nan_row(bad, device):
    dev = torch.device(device)
    lin = _mlp()[0].to(dev)
    q = opforge.nn.QQQLinear.from_linear(lin, 128)
    x = torch.randn(5, 512, generator=generator(dev, 2), device=dev)
    x[3, 100] = bad
    y, yq = lin(x), q(x)
    assert not torch.isfinite(y[3]).all()  # what the float layer does
    assert yq[3].isnan().all()
    assert torch.isfinite(yq[[0, 1, 2, 4]]).all()


@pytest.mark.parametrize("cast, want", [("half", torch.float16), ("bfloat16", torch.bfloat16), ("float", torch.float32)])
def test_qqq_linear_cast_sets_the_output_dtype(cast, want):
    lin = _mlp()[0]
    q = opforge.nn.QQQLinear.from_linear(lin, -1, out_dtype=torch.float16 if want == torch.float32 else torch.float32)
    x = torch.randn(3, 512).to(want)  # values the cast layer's inputs can hold
    before = q(x.float()).float()
    q = getattr(q, cast)()
    assert q.out_dtype == want and q.s_ch.dtype == torch.float32 and q.w_packed.dtype == torch.int32 and q.bias.dtype == want
    y = q(x)
    assert y.dtype == want
    # The same integer product, rounded to the new dtype once more.
    torch.testing.assert_close(y.float(), before, rtol=2e-2, atol=2e-2 * before.abs().max().item())
    with pytest.raises(TypeError, match=r"QQQLinear: the kernel writes .* outputs, cannot cast the layer to torch\.float64"):
        q.double()
    assert q.s_ch.dtype == torch.float32 and q.bias.dtype == want and q(x.to(want)).dtype == want


def test_qqq_linear_module_shapes_dtypes_and_errors():
    lin = torch.nn.Linear(64, 96, bias=False).half()
    q = opforge.nn.QQQLinear.from_linear(lin, 32)
    assert q.out_dtype == torch.float16 and q.bias is None and q.s_group.shape == (2, 96)
    assert "group_size=32" in repr(q) and "out_features=96" in repr(q)
    x = torch.randn(2, 3, 64).half()
    assert q(x).shape == (2, 3, 96)
    assert list(dict(q.named_buffers())) == ["w_packed", "s_ch", "s_group"]
    with pytest.raises(ValueError, match=r"QQQLinear: input must have 64 features in its last dimension, got shape \[2, 63\]"):
        q(torch.randn(2, 63))
    with pytest.raises(ValueError, match=r"K and N must be multiples of 32 \(the packed unit\), got K = 60, N = 96"):
        opforge.nn.QQQLinear.from_linear(torch.nn.Linear(60, 96))


def test_qqq_linear_under_torch_compile():
    torch._dynamo.reset()
    q = opforge.nn.QQQLinear.from_linear(torch.nn.Linear(128, 64), 128)
    x = torch.randn(5, 128)
    assert torch.equal(torch.compile(q, fullgraph=True)(x), q(x))


# --- CUDA ---


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize(
    "M, K, N",
    [
        (1, 8192, 256),
        (5, 2048, 8192),  # M <= 16 per channel, one wave of two-stripe CTAs: the direct kernel
        (16, 4096, 4096),  # the same with one stripe per CTA
        (16, 4096, 1024),
        (33, 11008, 128),
        (59, 256, 11008),
        (128, 1024, 4096),
        (200, 512, 96),
        (1025, 256, 160),
        (3, 128, 32),
    ],
)
def test_cuda_matches_cpu_bit_for_bit(M, K, N, group_size, out_dtype, seed):
    """Same integers, same epilogue: CUDA output == CPU output exactly, across
    every tile configuration (M ranges) and split counts (large K, few tiles)."""
    args = make_args(M, K, N, group_size, CPU, torch.Generator().manual_seed(seed))
    want = opforge.qqq_gemm(*args, out_dtype)
    got = opforge.qqq_gemm(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args), out_dtype)
    assert got.is_cuda and torch.equal(got.cpu(), want), f"{(got.cpu() != want).sum()} of {want.numel()} differ"


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("M", [20, 64, 100, 300])
def test_cuda_k_and_n_tails_bit_for_bit(M, group_size, out_dtype, seed):
    """K = 1056 is 8 k32 units past a multiple of 128 (the last slot of a
    128-deep ring is short) and N = 352 is 11 stripes (the last tile of 128 or
    256 columns is partial): the units and stripes past the end must add
    nothing, and must not raise the bad-scale flag."""
    args = make_args(M, 1056, 352, group_size, CPU, torch.Generator().manual_seed(seed))
    want = opforge.qqq_gemm(*args, out_dtype)
    got = opforge.qqq_gemm(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args), out_dtype)
    assert torch.equal(got.cpu(), want), f"{(got.cpu() != want).sum()} of {want.numel()} differ"


@pytest.mark.cuda
def test_cuda_extremes_and_target_shape(seed):
    gen = torch.Generator().manual_seed(seed)
    for args in (extreme_args(16, 8192, 8192, 128, CPU, gen), make_args(16, 8192, 8192, -1, CPU, gen)):
        want = exact(*args, torch.float16)
        got = opforge.qqq_gemm(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args), torch.float16)
        assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("group_size", [128, 256])
@pytest.mark.parametrize("M", [1, 8])
def test_cuda_folded_group_scales_at_small_m(M, group_size, seed):
    """Per group at M <= 8 the direct kernel folds the group scales once per
    128 k (partial sums, then scale * sum): bit for bit the exact sum, at the
    integers' extremes and over a long K."""
    gen = torch.Generator().manual_seed(seed)
    for args in (extreme_args(M, 4096, 256, group_size, CPU, gen), make_args(M, 4096, 256, group_size, CPU, gen)):
        want = exact(*args, torch.float16)
        got = opforge.qqq_gemm(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args), torch.float16)
        assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 5, 16, 64, 128])
def test_cuda_bad_group_scale_gives_nan_not_a_number(M):
    a, w, st, sc, sg, gs = make_args(M, 256, 64, 128, torch.device("cuda"), None)
    sg = sg.clone()
    sg[1, 5] = 17
    out = opforge.qqq_gemm(a, w, st, sc, sg, gs)
    assert out[:, 5].isnan().all()
    sg[1, 5] = 0
    assert opforge.qqq_gemm(a, w, st, sc, sg, gs)[:, 5].isnan().all()


@pytest.mark.cuda
def test_cuda_views_copied_and_misaligned_weights_refused():
    dev = torch.device("cuda")
    a, w, st, sc, _, _ = make_args(33, 256, 64, -1, dev, None)
    want = opforge.qqq_gemm(a, w, st, sc)
    a_t = a.t().contiguous().t()
    a_off = torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view(a.shape)
    sc_strided = torch.stack([sc, sc], 1)[:, 0]
    assert torch.equal(opforge.qqq_gemm(a_t, w, st, sc), want)
    assert torch.equal(opforge.qqq_gemm(a_off, w, st, sc_strided), want)
    w_off = torch.cat([w.new_zeros(1), w.reshape(-1)])[1:].view(w.shape)
    with pytest.raises(RuntimeError, match=re.escape("opforge::qqq_gemm: w_packed must be 16-byte aligned on the GPU")):
        opforge.qqq_gemm(a, w_off, st, sc)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [16, 128])  # the mma.sync tiles; the wgmma kernel (its tensor maps by value)
def test_cuda_runs_on_the_current_stream_and_graphs(M):
    dev = torch.device("cuda")
    args = make_args(M, 4096, 4096, 128, dev, None)
    want = opforge.qqq_gemm(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = opforge.qqq_gemm(*args)
    s.synchronize()
    assert torch.equal(got, want)
    # Captured in a CUDA graph (split-K counters are zeroed inside the graph too), replayed twice.
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = opforge.qqq_gemm(*args)
    for _ in range(2):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.parametrize("device", DEVICES)
def test_qqq_linear_gradient_to_its_input_raises(device):
    """The int8 quantisation cuts the input off the graph: a backward must not
    give x a gradient with the W4A8 term silently left out, but raise as a
    gradient through qqq_gemm does, naming it."""
    layer = opforge.nn.QQQLinear.from_linear(torch.nn.Linear(64, 32).to(device))
    x = torch.randn(3, 64, device=device, requires_grad=True)
    loss = layer(x).float().sum() + (x * x).sum()
    with pytest.raises(RuntimeError, match=r"opforge::qqq_gemm: has no derivative .*opforge.nn.QQQLinear"):
        loss.backward()
    assert not layer(x.detach()).requires_grad
    with torch.no_grad():
        assert not layer(x).requires_grad
