"""The checker and the benchmark catch wrong kernels: each fixture in
tests/fixtures/wrong_ops is a real bug, built through the same engine as the
library, and must fail its reference check and be refused by bench."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch

from opforge.bench.run import bench_op
from opforge.builder import BuildConfig, csrc_dir, load_library
from opforge.check.run import (
    CHECKS,
    check_bad_inputs,
    check_gradgradcheck,
    check_reference,
    compare,
    generator,
    measure_error,
    poisoned_allocations,
    with_special_values,
)
from opforge.check.values import special_values
from opforge.opspec import OpSpec
from opforge.registry import get_specs, register

FIXTURE = Path(__file__).parent / "fixtures" / "wrong_ops" / "wrong_ops.cpp"
WRONG = ["add_missing_tail", "add_off_by_one", "add_clobbers_input", "add_unchecked", "add_f64_via_f32", "add_nan_to_zero"]
ELEMENTWISE = ["add", "add_out", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward"]


@pytest.fixture(scope="module")
def wrong_specs() -> dict[str, OpSpec]:
    cfg = BuildConfig(
        name="opforge_wrong",
        sources=(FIXTURE,),
        include_dirs=(csrc_dir(),),
        cflags=("-O1",),
    )
    load_library(cfg, quiet=True)
    (add,) = get_specs(["add"])
    specs = {}
    for name in WRONG:
        spec = dataclasses.replace(add, name=name, namespace="opforge_wrong", fake=None, backward=None, setup_context=None)
        specs[name] = register(spec)
    return specs


@pytest.fixture(scope="module")
def wrong_reference(wrong_specs):
    """check_reference of a wrong kernel on the CPU, run once for every test that reads its report.
    Fresh inputs, as the seed fixture draws them; each failure names its seed."""
    results = {}

    def result(name: str):
        if name not in results:
            env = os.environ.get("OPFORGE_TEST_SEED")
            seed = int(env) if env else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
            print(f"{name}: seed {seed} (reproduce with OPFORGE_TEST_SEED={seed})")
            results[name] = check_reference(wrong_specs[name], torch.device("cpu"), seed)
        return results[name]

    return result


@pytest.mark.parametrize("name", ["add_missing_tail", "add_off_by_one", "add_clobbers_input"])
def test_reference_check_catches_wrong_kernels(wrong_reference, name):
    result = wrong_reference(name)
    assert result.status == "fail"
    # Every non-empty sample is wrong (scalars and 1-element tensors excepted for off-by-one).
    assert len(result.failures) >= result.count // 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_reference_runs_where_asked(wrong_specs, device, seed):
    """--reference-on cpu (what profile --sanitize uses) moves only the float64
    reference: the operator still runs on the device, and a wrong kernel still fails."""
    (add,) = get_specs(["add"])
    seen: list[str] = []

    def traced(*args, **kwargs):
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        return add.reference(*args, **kwargs)

    spec = dataclasses.replace(add, reference=traced)
    assert check_reference(spec, torch.device(device), seed, reference_device="cpu").status == "pass"
    assert seen and set(seen) == {"cpu"}
    seen.clear()
    assert check_reference(spec, torch.device(device), seed).status == "pass"
    assert set(seen) == {device}
    if device == "cpu":  # the wrong kernels have no CUDA implementation
        wrong = dataclasses.replace(wrong_specs["add_missing_tail"], reference=traced)
        result = check_reference(wrong, torch.device(device), seed, reference_device="cpu")
        assert result.status == "fail" and len(result.failures) >= result.count // 2


def test_missing_tail_is_reported_where_it_is(wrong_reference):
    result = wrong_reference("add_missing_tail")
    msg = next(f for f in result.failures if "[59]" in f and "float32" in f)
    assert "1/59 elements off" in msg and "first at [58]" in msg and "got nan" in msg


def test_clobbered_input_is_reported(wrong_reference):
    result = wrong_reference("add_clobbers_input")
    assert any("writes into argument a, which its schema does not mark as written" in f for f in result.failures)


def test_missing_checks_are_caught(wrong_specs, seed):
    result = check_bad_inputs(wrong_specs["add_unchecked"], torch.device("cpu"), seed)
    assert result.status == "fail"
    assert any("did not raise" in f for f in result.failures)


def test_bench_refuses_a_wrong_kernel(wrong_specs, seed):
    rows = bench_op(wrong_specs["add_off_by_one"], torch.device("cpu"), seed=seed, budget_s=0.01, compile=False)
    assert len(rows) == 1
    assert rows[0].status.startswith("refused: fails its reference check")
    assert not rows[0].timings


def test_bench_refuses_a_kernel_that_takes_bad_inputs(wrong_specs, seed):
    """add_unchecked's sums are right (its reference check passes), but it takes
    an int32 input and mismatched shapes without a word: bench does not time it."""
    spec = wrong_specs["add_unchecked"]
    assert check_reference(spec, torch.device("cpu"), seed).status == "pass"
    rows = bench_op(spec, torch.device("cpu"), seed=seed, budget_s=0.01, compile=False)
    assert len(rows) == 1 and not rows[0].timings
    assert rows[0].op == "add_unchecked"
    assert rows[0].status.startswith("refused: fails its bad-input check (add_unchecked [int32 input]: did not raise")


def test_float64_samples_have_every_bit(wrong_specs, seed):
    """A float64 kernel that rounds its inputs through float32 is exact on float32
    values widened: float64 samples are drawn in float64, and it fails there only."""
    for name in ELEMENTWISE:
        (spec,) = get_specs([name])
        for sample in spec.samples(torch.device("cpu"), torch.float64, generator(torch.device("cpu"), seed)):
            x = sample.args[0]
            if x.numel() > 1:
                assert not torch.equal(x, x.float().double()), f"{name} [{sample.desc}]: float64 sample holds float32 values"
    result = check_reference(wrong_specs["add_f64_via_f32"], torch.device("cpu"), seed)
    assert result.status == "fail"
    assert result.failures and all(" float64 [" in f for f in result.failures)
    assert any("[1025]" in f for f in result.failures)
    e = result.worst["float64 [1025]"]
    assert 1e-10 < e.max_abs < 1e-6 and e.n_bad > 1025 // 2  # float32's rounding of N(0, 1) values
    assert all(e.n_bad == 0 for case, e in result.worst.items() if not case.startswith("float64"))


def test_nan_turned_into_zero_is_caught(wrong_specs, seed):
    result = check_reference(wrong_specs["add_nan_to_zero"], torch.device("cpu"), seed)
    assert result.status == "fail"
    assert result.failures and all("special values" in f for f in result.failures)
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        assert any(f" {dtype} [1025, special values]" in f for f in result.failures), dtype
    assert any("got 0 want nan" in f for f in result.failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_special_values_reach_every_input(dtype, seed):
    (spec,) = get_specs(["add"])
    gen = generator(torch.device("cpu"), seed)
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    for sample in spec.samples(torch.device("cpu"), dtype, gen):
        before = [a.clone() for a in sample.args]
        special = with_special_values(spec, sample, dtype, gen)
        if sample.desc.startswith(("expanded", "empty", "2^20")):  # elements sharing memory, none, too many
            assert special is None, sample.desc
            continue
        assert special is not None and special.desc == f"{sample.desc}, special values"
        assert all(torch.equal(a, b) for a, b in zip(sample.args, before, strict=True))  # the sample is left as drawn
        for s, a in zip(special.args, sample.args, strict=True):  # a copy laid out as the sample's input
            assert s.data_ptr() != a.data_ptr() and (s.stride(), s.storage_offset()) == (a.stride(), a.storage_offset())
        a, b = (t.flatten() for t in special.args)
        written.append((a, b))
        # A largest finite value meets only values as drawn in the other input.
        for x, y, y_before in ((a, b, before[1].flatten()), (b, a, before[0].flatten())):
            huge = x.abs() == torch.finfo(dtype).max
            assert torch.equal(y[huge], y_before[huge])
    a, b = (torch.cat(ts) for ts in zip(*written, strict=True))
    meeting, alone = special_values(dtype)
    for t in (a, b):
        for v in (*meeting, *alone):
            want = torch.tensor(v, dtype=dtype).double().item()
            hit = t.isnan() if math.isnan(v) else (t.double() == want) & (t.signbit() == (math.copysign(1, v) < 0))
            assert hit.any(), f"{v!r} missing"
        assert torch.isfinite(t).sum() > t.numel() // 2  # about half of the elements left as drawn


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_library_kernels_take_special_values(name, seed):
    (spec,) = get_specs([name])
    assert spec.special_values
    gen = generator(torch.device("cpu"), seed)
    plain = sum(len(list(spec.samples(torch.device("cpu"), d, gen))) for d in spec.dtypes)
    result = check_reference(spec, torch.device("cpu"), seed)
    assert result.status == "pass", result.failures[:3]
    assert result.count - plain >= 8 * len(spec.dtypes)  # every small layout again, with special values


def test_matmul_ops_leave_special_values_out():
    for spec in get_specs(["gemm", "lltm_forward", "lltm_backward", "qqq_gemm"]):
        assert not spec.special_values, spec.name


def test_measure_error_is_nan_and_overflow_aware():
    nan, inf = math.nan, math.inf
    # float16: the float64 reference 65504 + 65504 = 131008 is Inf once rounded, as the kernel's sum.
    ref = torch.tensor([131008.0, nan, inf, -inf, 1.0, -131008.0], dtype=torch.float64)
    out = torch.tensor([inf, nan, inf, -inf, 1.0, -inf], dtype=torch.float16)
    e = measure_error(out, ref, 1e-5, 1e-3)
    assert e.n_bad == 0 and e.max_abs == 0 and e.max_rel == 0
    for k, got in [(0, 65504.0), (1, 0.0), (2, -inf), (2, 65504.0), (4, nan), (4, inf), (5, inf)]:
        bad = out.clone()
        bad[k] = got
        e = measure_error(bad, ref, 1e-5, 1e-3)
        assert e.n_bad == 1 and e.first_bad == (k,), (k, got)
    # Inf where the reference is finite and inside the dtype's range stays a mismatch.
    assert measure_error(torch.tensor([inf]), torch.tensor([1e38], dtype=torch.float64), 1e-6, 1e-6).n_bad == 1


def test_gradgradcheck_runs_where_declared(seed):
    assert "gradgradcheck" in CHECKS
    for name in ["add", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward", "gemm"]:
        (spec,) = get_specs([name])
        result = check_gradgradcheck(spec, torch.device("cpu"), seed)
        assert result.status == "pass" and result.count == 2, (name, result.failures)
    (lltm,) = get_specs(["lltm_forward"])
    result = check_gradgradcheck(lltm, torch.device("cpu"), seed)
    assert result.status == "n/a" and result.note == "double backward unsupported"
    (add_out,) = get_specs(["add_out"])
    assert check_gradgradcheck(add_out, torch.device("cpu"), seed).status == "n/a"


def test_gradgradcheck_catches_a_wrong_second_derivative(seed):
    """square's backward written as grad * 2 * x.detach(): first derivatives right,
    the second silently zero."""
    (square,) = get_specs(["square"])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x.detach()

    torch.library.define("opforge_wrong_py::square_detached", "(Tensor x) -> Tensor")
    torch.library.impl("opforge_wrong_py::square_detached", "CPU")(lambda x: x * x)
    spec = register(dataclasses.replace(square, name="square_detached", namespace="opforge_wrong_py", backward=backward))
    result = check_gradgradcheck(spec, torch.device("cpu"), seed)
    # The smallest sample's whole Jacobian fails for certain; fast mode's random projections on the
    # strided sample may land under gradgradcheck's tolerance.
    assert result.status == "fail" and result.count == 2
    assert any("[scalar]" in f or "Jacobian mismatch" in f for f in result.failures)


def test_bench_times_a_right_kernel(seed):
    (spec,) = get_specs(["add"])
    # One case: every case's sample comes from the same code, and each compiled baseline is an inductor build.
    rows = bench_op(spec, torch.device("cpu"), seed=seed, dtypes=[torch.float32], budget_s=0.01, only=["2^16"])
    assert [r.case for r in rows] == ["2^16"] and all(r.status == "ok" for r in rows)
    for r in rows:
        assert r.bytes == 12 * r.numel and r.flops == r.numel
        assert all(r.timings[impl].median_us > 0 for impl in ("opforge", "eager", "compiled")), r.notes


def test_check_with_several_seeds_keeps_the_worst_error(seed):
    (spec,) = get_specs(["add"])
    one = check_reference(spec, torch.device("cpu"), seed)
    three = check_reference(spec, torch.device("cpu"), seed, seeds=3)
    assert three.count == 3 * one.count and three.status == "pass"
    assert set(three.worst) == set(one.worst)
    for case, e in three.worst.items():
        assert e.max_abs >= one.worst[case].max_abs and e.n_bad == 0
    # bfloat16 rounding: the worst relative error of a sum is about half an ulp, 2^-8.
    assert 1e-3 < three.worst["bfloat16 [1025]"].max_rel <= 2**-8 + 1e-9


def test_worst_error_report_names_the_first_mismatch(wrong_reference):
    result = wrong_reference("add_missing_tail")
    e = result.worst["float32 [97x3]"]
    assert e.n_bad == 1 and e.first_bad == (96, 2) and math.isnan(e.got)
    assert math.isinf(e.max_abs)


def test_poisoned_allocations_fill_nan_and_restore():
    was = torch.are_deterministic_algorithms_enabled()
    with poisoned_allocations():
        assert torch.empty(5).isnan().all()
        assert torch.empty(3, dtype=torch.bfloat16).isnan().all()
    assert torch.are_deterministic_algorithms_enabled() == was


def test_compare():
    ref = torch.tensor([1.0, 2.0, float("inf"), -3.0], dtype=torch.float64)
    assert compare(ref.float(), ref, 1e-6, 1e-6) is None
    bad = ref.clone()
    bad[3] = float("nan")
    assert "1/4 elements off" in compare(bad, ref, 1e-6, 1e-6)
    assert "first at [1]" in compare(torch.tensor([1.0, 2.5, float("inf"), -3.0]), ref, 1e-3, 1e-3)
    assert "shape" in compare(ref[:2], ref, 0, 0)
