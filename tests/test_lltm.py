"""The LLTM cell: opforge::lltm_forward / lltm_backward against the
plain-PyTorch LLTM, autograd against autograd through that reference (not only
against the hand-written backward formulas), gradcheck, the module, the
training example. tests/test_ops.py runs the spec's generic checks besides."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge
from opforge.check.run import generator, measure_error
from opforge.ops.lltm import TOLERANCES, backward_args, make_cell, reference_backward, reference_forward
from opforge.registry import get_specs

from .conftest import DEVICES, cache_with_library

ROOT = Path(__file__).resolve().parents[1]
HALF = [torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float64, torch.float32, *HALF]

# Odd sizes: B = 1, F != S both ways, F == S, F = 0.
SHAPES = [(1, 5, 3), (7, 13, 5), (3, 1, 17), (4, 9, 9), (2, 0, 4), (33, 59, 97)]


def _ids(shape: tuple[int, int, int]) -> str:
    return "B{}-F{}-S{}".format(*shape)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert got.dtype == dtype and got.shape == want.shape, f"{what}: {got.dtype} {list(got.shape)} vs {list(want.shape)}"
    e = measure_error(got, want, atol, rtol)
    assert e.n_bad == 0, f"{what}: {e.n_bad}/{e.numel} off, first at {e.first_bad}: got {e.got} want {e.want}; max abs {e.max_abs:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_matches_reference(shape, dtype, device, seed):
    dev = torch.device(device)
    cell = make_cell(*shape, dtype, dev, generator(dev, seed))
    got = opforge.lltm_forward(*cell)
    want = reference_forward(*(t.double() for t in cell))
    for name, g, w in zip(("new_h", "new_cell", "gates"), got, want, strict=True):
        _close(g, w, dtype, name)


def _grads(fn, cell, weights_of_outputs, use):
    """Gradients of sum(w_k * out_k) over the outputs `use` names, for every input."""
    args = [t.detach().clone().requires_grad_() for t in cell]
    outs = fn(*args)
    loss = sum((outs[k] * weights_of_outputs[k]).sum() for k in use)
    loss.backward()
    # An input no used output depends on (old_cell, for gates alone) gets None: zero.
    return [torch.zeros_like(a) if a.grad is None else a.grad for a in args]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("use", [(0, 1, 2), (0, 1), (0,), (1,), (2,)], ids=["all", "h+cell", "h", "cell", "gates"])
@pytest.mark.parametrize("shape", [(1, 5, 3), (7, 13, 5), (33, 59, 97)], ids=_ids)
def test_backward_matches_autograd_through_the_reference(shape, use, dtype, device, seed):
    # Autograd through the plain-PyTorch forward in float64 is the reference
    # here: it shares nothing with reference_backward's formulas. Leaving
    # outputs unused sends None gradients, the path a recurrent loop's last step takes.
    dev = torch.device(device)
    gen = generator(dev, seed)
    cell = make_cell(*shape, dtype, dev, gen)
    B, _, S = shape
    out_w = [torch.randn(s, generator=gen, device=dev).to(dtype) / math.sqrt(B) for s in ((B, S), (B, S), (B, 3 * S))]
    got = _grads(opforge.lltm_forward, cell, out_w, use)
    want = _grads(reference_forward, [t.double() for t in cell], [w.double() for w in out_w], use)
    for name, g, w in zip(("input", "weights", "bias", "old_h", "old_cell"), got, want, strict=True):
        _close(g, w, dtype, f"d_{name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_errors_within_twice_pytorchs_own(dtype, device, seed):
    """flash-attention's rule: |opforge - ref64| <= 2 |torch's LLTM in dtype - ref64|
    (max over the spec's samples), the bound the spec's tolerances come from."""
    dev = torch.device(device)
    for spec in get_specs(["lltm_forward", "lltm_backward"]):
        ours = torch_own = 0.0
        for s in spec.samples(dev, dtype, generator(dev, seed)):
            if s.desc.startswith("B=1025") and dev.type == "cpu":
                continue  # the CPU's float16 matmuls are slow at this size
            ref = spec.reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in s.args))
            own = spec.reference(*s.args)
            got = spec.overload(*s.args)
            for r, o, g in zip(ref, own, got, strict=True):
                scale = 1 + r.double().abs()
                ours = max(ours, ((g.double() - r) / scale).abs().max().item() if r.numel() else 0.0)
                torch_own = max(torch_own, ((o.double() - r) / scale).abs().max().item() if r.numel() else 0.0)
        assert ours <= 2 * torch_own + 1e-7, f"{spec.name} {dtype}: opforge {ours:.3g} vs PyTorch's own {torch_own:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 4, 3), (5, 2, 7), (6, 7, 4), (3, 0, 5)], ids=_ids)
def test_gradcheck_float64(shape, device, seed):
    dev = torch.device(device)
    cell = [t.detach().requires_grad_() for t in make_cell(*shape, torch.float64, dev, generator(dev, seed))]
    assert torch.autograd.gradcheck(opforge.lltm_forward, cell)
    # new_h alone: the other outputs' gradients arrive as None.
    assert torch.autograd.gradcheck(lambda *a: opforge.lltm_forward(*a)[0], cell)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_with_and_without_grad_gates(device, seed):
    dev = torch.device(device)
    gen = generator(dev, seed)
    cell = make_cell(9, 11, 6, torch.float64, dev, gen)
    args = backward_args(cell, gen, grad_gates=True)
    with_gates = opforge.lltm_backward(*args)
    without = opforge.lltm_backward(*args[:2], None, *args[3:])
    for got, want in zip(with_gates, reference_backward(*args), strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(without, reference_backward(*args[:2], None, *args[3:]), strict=True):
        torch.testing.assert_close(got, want)
    # d_old_cell does not depend on grad_gates; the gate-block gradients do.
    torch.testing.assert_close(with_gates[4], without[4])
    assert not torch.allclose(with_gates[2], without[2])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_output_mask_and_missing_gradients(device, seed):
    dev = torch.device(device)
    gen = generator(dev, seed)
    B, F_, S = 6, 7, 5
    args = list(backward_args(make_cell(B, F_, S, torch.float64, dev, gen), gen, grad_gates=True))
    args[0] = args[0][:1, :1].expand(B, S)  # a sum()'s gradient: strides 0, 0, read in place
    args[1] = args[1].t().contiguous().t()  # column-major
    full = reference_backward(*args)
    for k in range(5):
        mask = [j != k for j in range(5)]
        got = opforge.lltm_backward(*args, mask)
        assert got[k].shape == (0,)
        for j in range(5):
            if j != k:
                torch.testing.assert_close(got[j], full[j])
    # None gradients are zeros.
    for none in range(3):
        partial = [None if j == none else a for j, a in enumerate(args)]
        zeros = [torch.zeros_like(a) if j == none else a for j, a in enumerate(args)]
        for got, want in zip(opforge.lltm_backward(*partial), reference_backward(*zeros), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", [(False, True, True, False, False), (True, False, False, True, True), (False, False, True, False, False)])
def test_autograd_computes_only_the_gradients_asked_for(needs, device, seed):
    dev = torch.device(device)
    cell = make_cell(5, 4, 3, torch.float64, dev, generator(dev, seed))
    args = [t.detach().requires_grad_(n) for t, n in zip(cell, needs, strict=True)]
    ref_args = [t.detach().requires_grad_(n) for t, n in zip(cell, needs, strict=True)]
    new_h, new_cell, _ = opforge.lltm_forward(*args)
    (new_h.sum() + new_cell.square().sum()).backward()
    r_h, r_c, _ = reference_forward(*ref_args)
    (r_h.sum() + r_c.square().sum()).backward()
    for a, r, n in zip(args, ref_args, needs, strict=True):
        assert (a.grad is not None) == n
        if n:
            torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_op_and_the_value(device):
    dev = torch.device(device)
    x, w, b, h, c = make_cell(4, 5, 3, torch.float32, dev, generator(dev, 0))
    with pytest.raises(RuntimeError, match=r"^opforge::lltm_forward: weights must have shape .* = \[9, 8\], got \[9, 7\]"):
        opforge.lltm_forward(x, w[:, :7], b, h, c)
    with pytest.raises(ValueError, match=r"^opforge::lltm_forward: input must be float32, float16, bfloat16 or float64, got torch\.int64"):
        opforge.lltm_forward(x.long(), w, b, h, c)
    with pytest.raises(RuntimeError, match=r"^opforge::lltm_forward: input must be 2-D \[batch, input_features\], got shape \[4, 5, 1\]"):
        opforge.lltm_forward(x[..., None], w, b, h, c)
    # Under torch.compile the fake kernel raises the same words at trace time.
    compiled = torch.compile(opforge.lltm_forward, fullgraph=True)
    with pytest.raises(Exception, match=r"opforge::lltm_forward: bias must have shape \[3 \* state_size\] = \[9\], got \[8\]"):
        compiled(x, w, b[:8], h, c)


# --- the module ---


@pytest.mark.parametrize("device", DEVICES)
def test_module_matches_the_reference_and_trains(device):
    dev = torch.device(device)
    torch.manual_seed(0)
    F_, S, B = 7, 5, 3
    cell = opforge.nn.LLTM(F_, S).to(dev, torch.float64)
    assert cell.weights.shape == (3 * S, F_ + S) and cell.bias.shape == (3 * S,)
    bound = 1 / math.sqrt(S)
    assert all(p.abs().max() <= bound and p.abs().max() > 0.5 * bound for p in cell.parameters())
    assert "input_features=7, state_size=5" in repr(cell)

    x = torch.randn(B, F_, device=dev, dtype=torch.float64)
    h = torch.randn(B, S, device=dev, dtype=torch.float64, requires_grad=True)
    c = torch.randn(B, S, device=dev, dtype=torch.float64)
    new_h, new_cell = cell(x, (h, c))
    want_h, want_cell, _ = reference_forward(x, cell.weights, cell.bias, h, c)
    torch.testing.assert_close(new_h, want_h)
    torch.testing.assert_close(new_cell, want_cell)

    # Two steps, then the gradients against the same through the reference.
    def loss(step):
        s = (h, c)
        for _ in range(2):
            s = step(x, s)
        return s[0].square().sum() + s[1].sum()

    params = [cell.weights, cell.bias, h]
    got = torch.autograd.grad(loss(cell), params)
    want = torch.autograd.grad(loss(lambda x, s: reference_forward(x, cell.weights, cell.bias, *s)[:2]), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)

    # torch.compile(fullgraph=True) of the module, forward and backward, equals eager.
    compiled = torch.compile(cell, fullgraph=True)
    got_c = torch.autograd.grad(loss(compiled), params)
    for g, w in zip(got_c, got, strict=True):
        torch.testing.assert_close(g, w)


# --- the training example ---


def _run_example(cache_dir: Path, *args: str, timeout: float) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["OPFORGE_CACHE_DIR"] = str(cache_dir)
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lltm" / "run.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def test_example_readme_names_its_origin():
    first = (ROOT / "examples" / "lltm" / "README.md").read_text().splitlines()[0]
    assert "autograd tutorial" in first and "LLTM" in first, first


def _check_example_output(out: str, device: str) -> None:
    assert f"device: {device}" in out
    assert "check: opforge's loss fell from" in out and "check: loss curves match within rtol" in out
    assert "FAILED" not in out
    assert out.rstrip().endswith("lltm: all checks passed")


@pytest.mark.slow
def test_example_trains_on_cpu(tmp_path):
    # A cache of its own, holding this run's op library: the example's own code, not the library, is what it builds and runs.
    out = _run_example(cache_with_library(tmp_path / "cache"), "--device", "cpu", "--steps", "40", timeout=900)
    _check_example_output(out, "cpu")


@pytest.mark.slow
@pytest.mark.cuda
def test_example_trains_on_cuda(tmp_path):
    out = _run_example(cache_with_library(tmp_path / "cache"), "--device", "cuda", "--steps", "100", timeout=900)
    _check_example_output(out, "cuda")


# --- CUDA only ---


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_matches_cpu(dtype, seed):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    cell = make_cell(65, 33, 129, dtype, cpu, generator(cpu, seed))
    got = opforge.lltm_forward(*(t.to(gpu) for t in cell))
    want = reference_forward(*(t.double() for t in cell))
    for g, w in zip(got, want, strict=True):
        _close(g.cpu(), w, dtype, "forward on CUDA")
    bargs = backward_args(cell, generator(cpu, seed + 1), grad_gates=True)
    got_b = opforge.lltm_backward(*(a.to(gpu) if isinstance(a, torch.Tensor) else a for a in bargs))
    want_b = reference_backward(*(a.double() if isinstance(a, torch.Tensor) else a for a in bargs))
    for g, w in zip(got_b, want_b, strict=True):
        _close(g.cpu(), w, dtype, "backward on CUDA")


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream():
    cell = make_cell(300, 50, 127, torch.float32, torch.device("cuda"), generator(torch.device("cuda"), 0))
    want = opforge.lltm_forward(*cell)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = opforge.lltm_forward(*cell)
    s.synchronize()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.xdist_group("gpu-memory")  # 8-17 GB at once: one such test at a time under pytest-xdist
@pytest.mark.cuda
def test_cuda_gates_past_two_to_the_31_elements():
    # gates is [B, 3S]: row b's candidate block starts at b * 3S + 2S, past
    # 2^31 for the last rows here, although B * S (the kernel's n) is not.
    B, F_, S = 700_000, 1, 1024
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs about 14 GB of GPU memory")
    assert B * 3 * S > 2**31 > B * S
    dev = torch.device("cuda")
    gen = generator(dev, 0)
    x, w, b, h, c = make_cell(B, F_, S, torch.float16, dev, gen)
    new_h, new_cell, gates = opforge.lltm_forward(x, w, b, h, c)
    rows = slice(B - 3, B)  # rows are independent: the reference on the last three
    want = reference_forward(x[rows].double(), w.double(), b.double(), h[rows].double(), c[rows].double())
    for g, r in zip((new_h[rows], new_cell[rows], gates[rows]), want, strict=True):
        _close(g, r, torch.float16, "last rows")
    del x, h, c, new_h, new_cell, gates
    torch.cuda.empty_cache()
