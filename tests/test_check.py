"""The checker and the benchmark catch wrong kernels: each fixture in
tests/fixtures/wrong_ops is a real bug, built through the same engine as the
library, and must fail its reference check and be refused by bench."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from opforge.bench import bench_op
from opforge.build import BuildConfig, csrc_dir, load_library
from opforge.check import check_bad_inputs, check_reference, compare, poisoned_allocations
from opforge.spec import OpSpec, get_specs, register

FIXTURE = Path(__file__).parent / "fixtures" / "wrong_ops" / "wrong_ops.cpp"
WRONG = ["add_missing_tail", "add_off_by_one", "add_clobbers_input", "add_unchecked"]


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


@pytest.mark.parametrize("name", ["add_missing_tail", "add_off_by_one", "add_clobbers_input"])
def test_reference_check_catches_wrong_kernels(wrong_specs, name, seed):
    result = check_reference(wrong_specs[name], torch.device("cpu"), seed)
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


def test_missing_tail_is_reported_where_it_is(wrong_specs, seed):
    result = check_reference(wrong_specs["add_missing_tail"], torch.device("cpu"), seed)
    msg = next(f for f in result.failures if "[59]" in f and "float32" in f)
    assert "1/59 elements off" in msg and "first at [58]" in msg and "got nan" in msg


def test_clobbered_input_is_reported(wrong_specs, seed):
    result = check_reference(wrong_specs["add_clobbers_input"], torch.device("cpu"), seed)
    assert any("input 0 was modified" in f for f in result.failures)


def test_missing_checks_are_caught(wrong_specs, seed):
    result = check_bad_inputs(wrong_specs["add_unchecked"], torch.device("cpu"), seed)
    assert result.status == "fail"
    assert any("did not raise" in f for f in result.failures)


def test_bench_refuses_a_wrong_kernel(wrong_specs, seed):
    rows = bench_op(wrong_specs["add_off_by_one"], torch.device("cpu"), seed=seed, budget_s=0.01, compile=False)
    assert len(rows) == 1
    assert rows[0].status.startswith("refused: fails its reference check")
    assert not rows[0].timings


def test_bench_times_a_right_kernel(seed):
    (spec,) = get_specs(["add"])
    rows = bench_op(spec, torch.device("cpu"), seed=seed, dtypes=[torch.float32], budget_s=0.01)
    assert rows and all(r.status == "ok" for r in rows)
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


def test_worst_error_report_names_the_first_mismatch(wrong_specs, seed):
    result = check_reference(wrong_specs["add_missing_tail"], torch.device("cpu"), seed)
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
