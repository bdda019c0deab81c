"""Every operator, every check of its spec, on every device."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge.check.run import check_bad_inputs, check_compile, check_gradcheck, check_opcheck, generator, run_reference
from opforge.registry import all_specs

from .conftest import DEVICES, SRC

SPECS = {s.name: s for s in all_specs()}
OPS = sorted(SPECS)


def _assert_ok(result) -> None:
    assert result.status in ("pass", "n/a"), "\n".join(result.failures)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, dtype, device, seed):
    spec = SPECS[op]
    if dtype not in spec.dtypes:
        pytest.skip(f"{op} does not take or return {dtype} (its dtypes: {', '.join(map(str, spec.dtypes))})")
    dev = torch.device(device)
    failures = []
    samples = list(spec.samples(dev, dtype, generator(dev, seed)))
    assert len(samples) >= 10
    for sample in samples:
        problem = run_reference(spec, sample, dtype)
        if problem:
            failures.append(f"[{sample.desc}] {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, device, seed):
    _assert_ok(check_opcheck(SPECS[op], torch.device(device), seed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [o for o in OPS if SPECS[o].differentiable])
def test_gradcheck(op, device, seed):
    result = check_gradcheck(SPECS[op], torch.device(device), seed)
    assert result.count >= 5
    _assert_ok(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_compile_fullgraph(op, device, seed):
    _assert_ok(check_compile(SPECS[op], torch.device(device), seed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_bad_inputs_raise_clear_errors(op, device, seed):
    result = check_bad_inputs(SPECS[op], torch.device(device), seed)
    assert result.count >= 2
    _assert_ok(result)


def test_differentiable_ops():
    # sigmoid_backward and axpby_backward: the second derivatives of sigmoid and axpby.
    want = {"add", "square", "axpby", "axpby_backward", "sigmoid", "sigmoid_backward", "lltm_forward", "gemm"}
    assert {o for o in OPS if SPECS[o].differentiable} == want


# --- the seeds' own examples, written out ---


@pytest.mark.parametrize("device", DEVICES)
def test_axpby_defaults_are_the_autograd_tutorials_my_op(device):
    x, y = torch.randn(1000, device=device), torch.randn(1000, device=device)
    torch.testing.assert_close(opforge.axpby(x, y), 3 * x - y)
    torch.testing.assert_close(opforge.axpby(x, y, beta=0.5), 3 * x + 0.5 * y)
    torch.testing.assert_close(opforge.axpby(x, y, 2.0, -2.0), 2 * x - 2 * y)


@pytest.mark.parametrize("device", DEVICES)
def test_axpby_gradients_are_alpha_and_beta(device):
    x = torch.randn(37, device=device, requires_grad=True)
    y = torch.randn(37, device=device, requires_grad=True)
    g = torch.randn(37, device=device)
    opforge.axpby(x, y, 1.5, -0.25).backward(g)
    torch.testing.assert_close(x.grad, 1.5 * g)
    torch.testing.assert_close(y.grad, -0.25 * g)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_backward_uses_saved_output(device):
    x = (torch.randn(513, device=device) * 6).requires_grad_()
    g = torch.randn(513, device=device)
    y = opforge.sigmoid(x)
    y.backward(g)
    s = torch.sigmoid(x.detach().double())
    torch.testing.assert_close(x.grad.double(), g.double() * s * (1 - s), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_add_out_writes_into_a_strided_out(device):
    a, b = torch.randn(40, 30, device=device), torch.randn(40, 30, device=device)
    out = torch.full((30, 40), float("nan"), device=device).t()
    assert opforge.add_out(a, b, out) is None
    torch.testing.assert_close(out, a + b)


# The CPU loops come in tiers: AVX-512 (every elementwise operator but lltm's), AVX2 and plain
# C++, chosen at run time by what the CPU has and ATEN_CPU_CAPABILITY. Lengths around the vector
# widths (8 lanes two vectors a step, 16 lanes four a step) reach every tail.
_TIER_LENGTHS = (1, 7, 8, 15, 16, 17, 31, 33, 47, 63, 64, 65, 81, 1000)
_TIER_CODE = """
import sys, torch, opforge
inputs = torch.load(sys.argv[1])
torch.save({k: _tier_outputs(*args) for k, args in inputs.items()}, sys.argv[2])
"""


def _tier_outputs(x, y, cell):  # also run in the subprocess, from its source
    return (
        opforge.sigmoid(x),
        opforge.sigmoid_backward(y, opforge.sigmoid(x)),
        opforge.square(x),
        opforge.add(x, y),
        opforge.axpby(x, y, 0.75, -1.5),
        *opforge.axpby_backward(y, 0.75, -1.5),
        *opforge.lltm_forward(*cell),
    )


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_cpu_vector_tiers_agree(capability, tmp_path, seed):
    """The AVX2 loops give the bits this process's loops give (AVX-512 where the CPU has it: the
    same operations in the same order), and the plain loops agree within each dtype's tolerance."""
    gen = torch.Generator().manual_seed(seed)

    def cell(dtype: torch.dtype, state: int) -> tuple[torch.Tensor, ...]:
        # An LLTM cell of `state` features a row, so that its rows' runs end in every tail too. Its
        # gate pre-activations are exact in every dtype (a few weights a row, all multiples of 1/128):
        # the matrix product is torch's, whose half-precision kernels round differently in each tier.
        k = 5 + state
        x = torch.randint(-4, 5, (3, 5), generator=gen) / 16
        h = torch.randint(-4, 5, (3, state), generator=gen) / 16
        w = torch.randint(-1, 2, (3 * state, k), generator=gen) / 8 * (torch.rand(3 * state, k, generator=gen) < 8 / k)
        b = torch.randint(-32, 33, (3 * state,), generator=gen) / 64
        c = torch.randn(3, state, generator=gen) * 2
        return tuple(t.to(dtype) for t in (x, w, b, h, c))

    inputs = {
        (str(dtype), n): (
            (torch.randn(n, generator=gen) * 30).to(dtype),
            torch.randn(n, generator=gen).to(dtype),
            cell(dtype, n),
        )
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for n in _TIER_LENGTHS
    }
    torch.save(inputs, tmp_path / "in.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": SRC}
    res = subprocess.run(
        [sys.executable, "-c", inspect.getsource(_tier_outputs) + _TIER_CODE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    names = ("sigmoid", "sigmoid_backward", "square", "add", "axpby", "axpby_backward grad x", "axpby_backward grad y")
    names += ("lltm_forward new_h", "lltm_forward new_cell", "lltm_forward gates")
    for key, args in inputs.items():
        for name, a, b in zip(names, _tier_outputs(*args), theirs[key], strict=True):
            if capability == "avx2":
                assert torch.equal(a, b), f"{name} {key}: {(a.float() - b.float()).abs().max()} apart"
            else:
                torch.testing.assert_close(a, b, msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors(device):
    for shape in [(0,), (4, 0, 3)]:
        x = torch.randn(shape, device=device)
        for out in (opforge.add(x, x), opforge.square(x), opforge.axpby(x, x), opforge.sigmoid(x)):
            assert out.shape == x.shape and out.device == x.device


def test_public_functions_carry_the_schema_signature():
    import inspect

    sig = inspect.signature(opforge.axpby)
    assert list(sig.parameters) == ["x", "y", "alpha", "beta"]
    assert sig.parameters["alpha"].default == 3.0 and sig.parameters["beta"].default == -1.0
    assert "opforge::axpby(Tensor x, Tensor y" in opforge.axpby.__doc__


@pytest.mark.parametrize("op", OPS)
def test_a_missing_tensor_names_the_operator_and_the_argument(op):
    spec = SPECS[op]
    plain = {"Tensor": torch.ones(2), "Optional[Tensor]": None, "float": 1.0, "int": 1, "bool": False}
    args = {a.name: plain[str(a.type)] for a in spec.schema.arguments if not a.has_default_value()}
    tensors = [name for name, v in args.items() if isinstance(v, torch.Tensor)]
    for value, shown in ((None, r"NoneType \(None\)"), (7, r"int \(7\)")):
        with pytest.raises(TypeError, match=rf"^{spec.qualname}: {tensors[0]} must be a Tensor, got {shown}$"):
            spec.function(**{**args, tensors[0]: value})
    with pytest.raises(TypeError, match=rf"^{spec.qualname}: missing a required argument: '{tensors[-1]}'$"):
        spec.function(**{k: v for k, v in args.items() if k != tensors[-1]})


@pytest.mark.parametrize("device", DEVICES)
def test_nn_modules(device):
    x = torch.randn(8, 5, device=device, requires_grad=True)
    y = torch.randn(8, 5, device=device, requires_grad=True)
    out = opforge.nn.Sigmoid()(opforge.nn.AXPBY(2.0, 0.5)(x, y))
    torch.testing.assert_close(out, torch.sigmoid(2 * x + 0.5 * y))
    out.sum().backward()
    s = torch.sigmoid(2 * x + 0.5 * y).detach()
    torch.testing.assert_close(x.grad, 2 * s * (1 - s))
    torch.testing.assert_close(opforge.nn.Square()(x), x * x)
    torch.testing.assert_close(opforge.nn.Add()(x, y), x + y)
    assert "alpha=2.0" in repr(opforge.nn.AXPBY(2.0, 0.5))


@pytest.mark.cuda
def test_cuda_kernel_runs_on_current_stream_and_device():
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    # x is written on the current stream: s must wait for it, or square may read it half-written.
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = opforge.square(x)
    s.synchronize()
    torch.testing.assert_close(y, x * x)
    if torch.cuda.device_count() > 1:
        x1 = torch.randn(1000, device="cuda:1")
        torch.testing.assert_close(opforge.sigmoid(x1), torch.sigmoid(x1))


@pytest.mark.xdist_group("gpu-memory")  # 8-17 GB at once: one such test at a time under pytest-xdist
@pytest.mark.cuda
def test_cuda_past_two_to_the_31_bytes_of_indexing():
    # 2^31 + 5 half elements: any 32-bit index in the kernel wraps and misses the tail.
    n = 2**31 + 5
    if torch.cuda.get_device_properties(0).total_memory < 4 * n * 2:
        pytest.skip("needs about 17 GB of GPU memory")
    a = torch.ones(n, device="cuda", dtype=torch.float16)
    a[-5:] = 2.0
    out = opforge.square(a)
    assert out[-5:].eq(4.0).all() and out[:5].eq(1.0).all()
    del a, out
    torch.cuda.empty_cache()
