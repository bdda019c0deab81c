"""opforge check against kernels with a bug planted where a checker is easiest
to fool (tests/fixtures/planted_ops): an in-place kernel that does nothing or
adds too much, an out= kernel that writes nothing, a kernel wrong on its
optional tensor, one wrong past 50,000 elements, kernels of integer, bool and
complex dtypes, an argmax off by one, an overflow that clamps or turns NaN into
0, a kernel that differs between calls, one without a fake kernel, a segment
sum that drops a value. Each must fail, and its correct twin pass, with check
and bench judging what the operator promises: a flush of subnormals or a zero
of the other sign fails only under special_values="strict"."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge
from opforge.bench.run import bench_op, input_sets
from opforge.check.reference import run_reference
from opforge.check.run import check_op, check_reference
from opforge.check.values import difference, measure_error
from opforge.derive import DeriveError
from opforge.opspec import Sample, SpecError
from opforge.registry import wire

PLANTED = Path(__file__).parent / "fixtures" / "planted_ops"
sys.path.insert(0, str(PLANTED))
import planted_ops  # noqa: E402, F401 - registers torch.ops.planted_ops.*

CPU = torch.device("cpu")
OPS = torch.ops.planted_ops


def _reference(spec, seed):
    (res,) = check_op(spec, CPU, seed, ("reference",))
    return res


def _add1_inplace(x):
    x.add_(1)


def _inc_out(a, out):
    out.copy_(a + 1)


# --- operators that write into an argument ---


@pytest.mark.parametrize("reference", [_add1_inplace, lambda x: x.add_(1)], ids=["returns None", "returns x"])
def test_a_right_inplace_kernel_passes_whatever_its_reference_returns(reference, seed):
    res = _reference(opforge.spec(OPS.add1_.default, reference=reference), seed)
    assert res.status == "pass", res.failures
    assert res.count > 10


@pytest.mark.parametrize("op", ["noop_", "add2_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_inplace_kernel_that_does_nothing_or_too_much_fails(op, dtype, seed):
    res = _reference(opforge.spec(getattr(OPS, op).default, reference=_add1_inplace, dtypes=(dtype,)), seed)
    assert res.status == "fail"
    assert "written argument x:" in res.failures[0], res.failures[0]
    assert "elements off" in res.failures[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_out_kernel_is_right_only_when_it_writes(dtype, seed):
    assert _reference(opforge.spec(OPS.inc_out.default, reference=_inc_out, dtypes=(dtype,)), seed).status == "pass"
    res = _reference(opforge.spec(OPS.nothing_out.default, reference=_inc_out, dtypes=(dtype,)), seed)
    assert res.status == "fail"
    assert "written argument out:" in res.failures[0], res.failures[0]


def test_a_reference_that_returns_a_new_tensor_for_an_inplace_schema_is_told_what_to_return(seed):
    res = _reference(opforge.spec(OPS.add1_.default, reference=lambda x: x + 1), seed)
    assert res.status == "fail"
    assert "the reference returned 1 new tensor but the schema returns nothing" in res.failures[0]
    assert "must write it there too" in res.failures[0] and "into x" in res.failures[0]


def test_a_reference_that_writes_into_its_input_is_blamed_not_the_operator(seed):
    def mutating(x):
        return x.mul_(2)

    res = _reference(opforge.spec(OPS.twice.default, reference=mutating, dtypes=(torch.float32, torch.float64)), seed)
    assert res.status == "fail"
    assert all(f.split(": ", 1)[1].startswith("the reference writes into x, which the schema does not mark") for f in res.failures)
    assert not any("kernel" in f for f in res.failures)


def test_bench_refuses_an_inplace_kernel_that_does_nothing(seed):
    spec = opforge.spec(OPS.noop_.default, reference=_add1_inplace)
    assert check_reference(spec, CPU, seed).status == "fail"
    rows = bench_op(spec, CPU, seed=seed, budget_s=0.01, compile=False)
    assert len(rows) == 1 and not rows[0].timings
    assert rows[0].status.startswith("refused: fails its reference check"), rows[0].status


def test_the_bench_command_refuses_an_inplace_kernel_that_does_nothing(tmp_path, seed):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env |= {"PYTHONPATH": str(Path(opforge.__file__).resolve().parent.parent), "OPFORGE_NO_AUTOLOAD": "1", "COLUMNS": "300"}
    spec_file = PLANTED / "noop_inplace_spec.py"
    args = ["bench", str(spec_file), "--device", "cpu", "--no-compile", "--budget", "0.05", "--seed", str(seed)]
    res = subprocess.run([sys.executable, "-m", "opforge", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "refused: fails its reference check (noop_ float32 [scalar]" in res.stdout, res.stdout
    assert "written argument x:" in res.stdout


# --- optional tensors, large samples ---


def test_derived_samples_draw_an_optional_tensor_both_ways():
    s = opforge.spec(OPS.addb.default, reference=lambda x, b=None: x if b is None else x + b)
    samples = list(s.samples(CPU, torch.float32, torch.Generator().manual_seed(0)))
    given = [smp for smp in samples if len(smp.args) > 1 and isinstance(smp.args[1], torch.Tensor)]
    left_out = [smp for smp in samples if len(smp.args) == 1 or smp.args[1] is None]
    assert given and left_out
    assert all("b=tensor" in smp.desc for smp in given) and all("b=None" in smp.desc for smp in left_out)
    assert all(smp.args[1].shape == smp.args[0].shape for smp in given)


def test_a_kernel_wrong_on_its_optional_tensor_fails(seed):
    reference = lambda x, b=None: x.clone() if b is None else x + b  # noqa: E731
    assert _reference(opforge.spec(OPS.addb.default, reference=reference), seed).status == "pass"
    res = _reference(opforge.spec(OPS.subb.default, reference=reference), seed)
    assert res.status == "fail"
    assert all("b=tensor" in f for f in res.failures) and not any("b=None" in f for f in res.failures)


def test_a_kernel_wrong_past_50000_elements_fails_its_reference_check_only(seed):
    right = opforge.spec(OPS.twice.default, reference=lambda x: x * 2)
    assert max(smp.args[0].numel() for smp in right.samples(CPU, torch.float32, torch.Generator().manual_seed(0))) > 65536
    assert _reference(right, seed).status == "pass"
    wrong = opforge.spec(OPS.twice_wrong_late.default, reference=lambda x: x * 2)
    res = _reference(wrong, seed)
    assert res.status == "fail"
    assert len(res.failures) == len(wrong.dtypes), res.failures  # one large sample per dtype
    assert all("[65539]" in f and "first at [50000]" in f for f in res.failures), res.failures
    # The other checks leave it out: the kernel is right on every sample they take.
    (grad, compiled) = check_op(wrong, CPU, seed, ("opcheck", "compile"))
    assert grad.status == "pass" and compiled.status == "pass", (grad.failures, compiled.failures)


# --- subnormals and signed zeros ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_flush_of_subnormals_is_a_note_by_default_and_a_failure_when_strict(dtype, seed):
    assert _reference(opforge.spec(OPS.copy.default, reference=torch.clone, dtypes=(dtype,)), seed).status == "pass"
    res = _reference(opforge.spec(OPS.copy_ftz.default, reference=torch.clone, dtypes=(dtype,)), seed)
    assert res.status == "pass", res.failures
    name = str(dtype).removeprefix("torch.")
    assert re.search(rf"flushes subnormal results to zero \({name} \d+ elements?\)", res.note), res.note
    strict = _reference(opforge.spec(OPS.copy_ftz.default, reference=torch.clone, dtypes=(dtype,), special_values="strict"), seed)
    assert strict.status == "fail"
    # float16's subnormals (under 6.1e-5) are drawn in plain samples too.
    assert any("special values" in f for f in strict.failures), strict.failures
    assert all(re.search(r"got -?0 want -?\d", f) for f in strict.failures), strict.failures
    assert "flushes" not in strict.note


def test_a_zero_of_the_other_sign_is_equal_by_default_and_a_failure_when_strict(seed):
    assert _reference(opforge.spec(OPS.copy_negzero.default, reference=torch.clone), seed).status == "pass"
    res = _reference(opforge.spec(OPS.copy_negzero.default, reference=torch.clone, special_values="strict"), seed)
    assert res.status == "fail"
    assert all("special values" in f and "got -0 want 0" in f for f in res.failures), res.failures


@pytest.mark.parametrize("value", ["loose", 1, None])
def test_special_values_other_than_true_false_or_strict_is_an_error_naming_the_spec(value):
    with pytest.raises(SpecError, match=r"spec of planted_ops::copy: special_values= is True, False or \"strict\", got"):
        opforge.spec(OPS.copy.default, reference=torch.clone, special_values=value)


def test_measure_error_sees_flushed_subnormals_and_signed_zeros():
    fi = torch.finfo(torch.float32)
    sub = fi.tiny * fi.eps * 3
    ref = torch.tensor([sub, -sub, 0.0, -0.0, 1.0], dtype=torch.float64)
    assert measure_error(ref.float(), ref, 1e-6, 1e-6, subnormals=True).n_bad == 0
    flushed = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0])
    e = measure_error(flushed, ref, 1e-6, 1e-6, subnormals=True, strict=True)
    assert (e.n_bad, e.first_bad) == (2, (0,))
    # By default a flush is counted apart, not as a mismatch.
    e = measure_error(flushed, ref, 1e-6, 1e-6, subnormals=True)
    assert (e.n_bad, e.n_flushed) == (0, 2)
    # In an ordinary sample a result among the subnormals carries the absolute tolerance (a float16 matmul's may).
    assert measure_error(flushed, ref, 1e-6, 1e-6).n_bad == 0
    signs = torch.tensor([sub, -sub, -0.0, 0.0, 1.0])
    # In an ordinary sample a zero's sign is free: a sum's zero takes it from the order of its terms.
    assert measure_error(signs, ref, 1e-6, 1e-6).n_bad == 0
    assert measure_error(signs, ref, 1e-6, 1e-6, subnormals=True).n_bad == 0
    e = measure_error(signs, ref, 1e-6, 1e-6, subnormals=True, strict=True)
    assert (e.n_bad, e.first_bad, e.got, e.want) == (2, (2,), -0.0, 0.0)
    assert math.copysign(1, e.got) == -1
    # A subnormal result one ulp off (a kernel that rounds once more) is still right.
    off_by_ulp = torch.tensor([sub + fi.tiny * fi.eps, -sub, 0.0, -0.0, 1.0])
    assert measure_error(off_by_ulp, ref, 1e-6, 1e-6, subnormals=True).n_bad == 0


# --- integer, bool and complex dtypes ---


def _triple(x):
    return x.clone() if x.dtype == torch.bool else x * 3


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_integer_bool_and_complex_kernels_pass_when_right_and_fail_when_wrong(dtype, seed):
    right = _reference(opforge.spec(OPS.triple.default, reference=_triple, dtypes=(dtype,)), seed)
    assert right.status == "pass", right.failures
    wrong = _reference(opforge.spec(OPS.triple_plus1.default, reference=_triple, dtypes=(dtype,)), seed)
    assert wrong.status == "fail"
    assert "elements off (atol 0, rtol 0)" in wrong.failures[0] or dtype.is_complex, wrong.failures[0]


def test_a_complex_kernel_is_compared_in_complex(seed):
    assert _reference(opforge.spec(OPS.neg_conj.default, reference=torch.neg, dtypes=(torch.complex64,)), seed).status == "pass"
    res = _reference(opforge.spec(OPS.neg_conj_wrong.default, reference=torch.neg, dtypes=(torch.complex64, torch.complex128)), seed)
    assert res.status == "fail"
    assert "j" in res.failures[0].split("got ", 1)[1], res.failures[0]


def test_dtypes_may_be_named_and_a_wrong_name_is_an_error_naming_the_spec():
    s = opforge.spec(OPS.triple.default, reference=_triple, dtypes=("float32", "torch.int32"))
    assert s.dtypes == (torch.float32, torch.int32)
    assert s.tolerance(torch.int32) == (0.0, 0.0)
    with pytest.raises(SpecError, match=r"planted_ops::triple.*dtypes=: 'float23' is not a dtype"):
        opforge.spec(OPS.triple.default, reference=_triple, dtypes=("float23",))
    with pytest.raises(SpecError, match=r"planted_ops::triple.*dtypes=: 3 is not a dtype"):
        opforge.spec(OPS.triple.default, reference=_triple, dtypes=(3,))


@pytest.mark.parametrize("tol", [(-1e-6, 1e-6), (1e-6, math.nan), (math.inf, 0.0), ("a", 1.0), (1.0,)])
def test_a_tolerance_that_is_negative_or_not_a_number_is_an_error_naming_the_spec(tol):
    with pytest.raises(SpecError, match=r"spec of planted_ops::twice: tolerances\[float32\]: .* is not an \(atol, rtol\) pair"):
        opforge.spec(OPS.twice.default, reference=lambda x: x * 2, tolerances={torch.float32: tol})


# --- specs that are wrong themselves ---


def _raw_tensor(device, dtype, gen):
    yield torch.randn(3, 4, device=device, dtype=dtype, generator=gen)


def _nothing(device, dtype, gen):
    return iter(())


def _bare_arguments(device, dtype, gen):
    yield Sample(torch.randn(4, device=device, dtype=dtype, generator=gen))


@pytest.mark.parametrize(
    ("samples", "says"),
    [
        (_raw_tensor, r"samples= yielded a Tensor of shape \[3, 4\] as its sample 0, not a Sample: yield Sample\(\(x, \.\.\.\)\)"),
        (_nothing, r"samples= yielded no sample for float32 on cpu"),
        (_bare_arguments, r"samples= yielded Sample\(Tensor\) as its sample 0: Sample takes the call's arguments as a tuple"),
    ],
    ids=["raw tensor", "nothing", "bare arguments"],
)
def test_samples_that_are_not_samples_fail_in_one_line_naming_the_spec(samples, says, seed):
    spec = opforge.spec(OPS.twice.default, reference=lambda x: x * 2, samples=samples, bench_cases=samples)
    first, *rest = check_op(spec, CPU, seed)
    assert first.status == "fail" and len(first.failures) == 1
    (failure,) = first.failures
    assert "\n" not in failure and failure.startswith("spec of planted_ops::twice: "), failure
    assert re.search(says, failure), failure
    assert rest and all(r.status == "n/a" for r in rest)


def test_a_derived_spec_of_a_packet_whose_default_takes_no_tensor_asks_for_the_overload():
    with pytest.raises(
        DeriveError,
        match=r"aten::add: its default overload \(aten::add\(Scalar a, Scalar b\) -> Scalar\) takes no Tensor; .*aten::add\.Tensor",
    ):
        opforge.spec(torch.ops.aten.add, reference=torch.add)
    assert opforge.spec(torch.ops.aten.add.Tensor, reference=torch.add).overload_name == "Tensor"


# --- integer and bool outputs ---


@pytest.mark.parametrize(("right", "wrong"), [("argmax_last", "argmax_last_off"), ("positive", "positive_not")])
def test_integer_and_bool_outputs_of_a_float_input_are_compared_exactly_in_the_references_dtype(right, wrong, seed):
    reference = (lambda x: x.argmax(-1)) if right == "argmax_last" else (lambda x: x > 0)
    results = check_op(opforge.spec(getattr(OPS, right).default, reference=reference), CPU, seed)
    assert all(r.status != "fail" for r in results), [(r.check, r.failures) for r in results]
    res = _reference(opforge.spec(getattr(OPS, wrong).default, reference=reference), seed)
    assert res.status == "fail"
    assert all("elements off (atol 0, rtol 0)" in f and "dtype" not in f for f in res.failures), res.failures


def test_an_integer_output_of_another_dtype_than_the_references_fails_for_its_dtype(seed):
    res = _reference(opforge.spec(OPS.argmax_last.default, reference=lambda x: x.argmax(-1).int()), seed)
    assert res.status == "fail"
    assert "output 0 has dtype torch.int64, expected torch.int32 (the reference's)" in res.failures[0], res.failures[0]


def test_aten_argmax_passes_check_and_bench_with_its_gradient_checks_not_applicable(seed):
    spec = opforge.spec(torch.ops.aten.argmax.default, reference=torch.argmax)
    results = {r.check: r for r in check_op(spec, CPU, seed)}
    assert all(r.status != "fail" for r in results.values()), {k: r.failures for k, r in results.items()}
    # Derived samples of no elements: argmax refuses them, as its reference does.
    assert "both refuse" in results["reference"].note and "[empty" in results["reference"].note
    for check in ("gradcheck", "gradgradcheck"):
        assert results[check].status == "n/a"
        assert results[check].note.startswith("no floating output (returns int64 only)"), results[check].note
    assert results["compile"].status == "pass" and "backward not run" in results["compile"].note
    wire(spec)  # its public function, which bench times
    rows = bench_op(spec, CPU, seed=seed, budget_s=0.01, compile=False)
    assert rows and all(r.status == "ok" and r.timings.get("opforge") for r in rows), [r.status for r in rows]


@pytest.mark.cuda
def test_aten_argmax_passes_check_and_bench_on_cuda(seed):
    cuda = torch.device("cuda")
    spec = opforge.spec(torch.ops.aten.argmax.default, reference=torch.argmax)
    results = check_op(spec, cuda, seed, ("reference", "gradcheck", "gradgradcheck", "compile", "export"))
    assert all(r.status != "fail" for r in results), [(r.check, r.failures) for r in results]
    wire(spec)
    rows = bench_op(spec, cuda, seed=seed, budget_s=0.01, compile=False, dtypes=(torch.float32,))
    assert rows and all(r.status == "ok" for r in rows), [r.status for r in rows]


def test_gradients_are_still_checked_where_one_output_is_floating(seed):
    spec = opforge.spec(torch.ops.aten.sort.default, reference=torch.sort)
    (grad,) = check_op(spec, CPU, seed, ("gradcheck",))
    assert grad.status == "pass" and grad.count > 0, (grad.note, grad.failures)


# --- what eager torch gives in the operator's own dtype ---


def _rot_reference(x1, x2, c, s):
    return x1 * c - x2 * s


def _rot_samples(device, dtype, gen):
    big = torch.finfo(dtype).max
    r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=gen)  # noqa: E731
    yield Sample((r(7, 5), r(7, 5), r(7, 5), r(7, 5)), {}, "ordinary")
    full = lambda v: torch.full((6,), v, device=device, dtype=dtype)  # noqa: E731
    # x1 * c alone past the largest value: +Inf in every dtype.
    yield Sample((full(big), full(1.0), full(2.0), full(1.0)), {}, "one product past the largest value")
    # Both products past it: inf - inf = NaN in the operator's dtype, 0 in float64.
    yield Sample((full(big), full(big), full(2.0), full(2.0)), {}, "both products past the largest value")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_overflow_that_eager_torch_gives_in_the_operators_dtype_is_not_a_failure(dtype, seed):
    spec = lambda op: opforge.spec(op, reference=_rot_reference, samples=_rot_samples, dtypes=(dtype,))  # noqa: E731
    res = _reference(spec(OPS.rot.default), seed)
    assert res.status == "pass", res.failures
    # Broken kernels still fail: infinities clamped, NaN turned into 0, a finite value wrong.
    clamped = _reference(spec(OPS.rot_clamped.default), seed)
    assert clamped.status == "fail"
    assert any("[one product past the largest value]" in f and re.search(r"got 3\.\d+e\+38", f) for f in clamped.failures), clamped.failures
    nan0 = _reference(spec(OPS.rot_nan0.default), seed)
    assert nan0.status == "fail" and any("got 0 want nan" in f for f in nan0.failures), nan0.failures
    wrong = _reference(spec(OPS.rot_wrong.default), seed)
    assert wrong.status == "fail" and any("[ordinary]" in f for f in wrong.failures), wrong.failures


def test_measure_error_takes_the_reference_in_the_operators_own_dtype():
    inf, nan = math.inf, math.nan
    ref = torch.tensor([0.0, inf, 1.0], dtype=torch.float64)
    out = torch.tensor([nan, inf, 1.0])
    assert measure_error(out, ref, 1e-6, 1e-6).n_bad == 1
    e = measure_error(out, ref, 1e-6, 1e-6, own=torch.tensor([nan, inf, 1.0]))
    assert (e.n_bad, e.max_abs) == (0, 0.0)
    # An own-dtype reference does not excuse what it does not give.
    assert measure_error(torch.tensor([0.0, 3.4e38, 2.0]), ref, 1e-6, 1e-6, own=torch.tensor([nan, inf, 1.0])).n_bad == 2


# --- NaN in compile and export, and what a difference says ---


def test_an_operator_whose_result_holds_nan_by_design_passes_compile_and_export(seed):
    spec = opforge.spec(OPS.log.default, reference=torch.log)
    results = {r.check: r for r in check_op(spec, CPU, seed, ("reference", "opcheck", "compile", "export"))}
    assert all(r.status == "pass" for r in results.values()), {k: r.failures for k, r in results.items()}


def test_a_kernel_that_differs_under_compile_and_export_names_the_element_and_both_values(seed):
    spec = opforge.spec(OPS.log_drift.default, reference=torch.log)
    compiled, exported = check_op(spec, CPU, seed, ("compile", "export"))
    assert compiled.status == "fail" and exported.status == "fail"
    for f in compiled.failures + exported.failures:
        assert re.search(r"differs from eager: 1/\d+ elements differ: first at \[\d+, \d+\] got -?[\d.]+(e[-+]\d+)? want -?[\d.]+", f), f
        assert "None" not in f


def test_difference_is_nan_aware_and_names_the_element():
    nan = math.nan
    want = torch.tensor([[1.0, nan], [-0.0, 4.0]])
    assert difference(want.clone(), want) is None
    assert difference(torch.tensor([[1.0, nan], [0.0, 4.0]]), want) is None  # -0 == +0, as torch.equal has it
    got = torch.tensor([[1.0, 2.0], [-0.0, 4.0]])
    assert difference(got, want) == "1/4 elements differ: first at [0, 1] got 2.0 want nan"
    assert difference(got.double(), want) == "dtype torch.float64, eager torch.float32"
    assert difference(got[0], want) == "shape [2], eager [2, 2]"


# --- an operator without a fake kernel ---


def test_a_missing_fake_kernel_is_one_line_naming_the_registration_in_every_check_that_needs_it(seed):
    spec = opforge.spec(OPS.twice_nofake.default, reference=lambda x: x * 2)
    results = {r.check: r for r in check_op(spec, CPU, seed, ("reference", "opcheck", "compile", "export"))}
    assert results["reference"].status == "pass"
    for check in ("opcheck", "compile", "export"):
        res = results[check]
        assert res.status == "fail" and len(res.failures) == 1, (check, res.failures)
        (line,) = res.failures
        assert "\n" not in line and "scroll up" not in line
        assert line.startswith(f"planted_ops::twice_nofake has no fake kernel, which {check} needs"), line
        assert 'torch.library.register_fake("planted_ops::twice_nofake")' in line
        assert "TORCH_LIBRARY_IMPL(planted_ops, Meta, m)" in line
    # Its twin with a fake kernel passes them.
    twin = check_op(opforge.spec(OPS.twice.default, reference=lambda x: x * 2), CPU, seed, ("opcheck", "compile", "export"))
    assert all(r.status == "pass" for r in twin), [r.failures for r in twin]


def test_a_custom_op_without_register_fake_is_told_the_same(seed):
    @torch.library.custom_op("planted_ops_custom::halve", mutates_args=())
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x / 2

    (res,) = check_op(opforge.spec(torch.ops.planted_ops_custom.halve.default, reference=lambda x: x / 2), CPU, seed, ("opcheck",))
    assert res.status == "fail" and len(res.failures) == 1
    assert 'torch.library.register_fake("planted_ops_custom::halve")' in res.failures[0], res.failures[0]


# --- bench: the inputs the spec declares ---


def _segment_samples(device, dtype, gen):
    for counts in ([3, 0, 5, 1], [17, 4, 9, 2, 11, 6]):
        offsets = torch.tensor([0, *counts], device=device).cumsum(0)
        values = torch.randn(int(offsets[-1]), device=device, dtype=dtype, generator=gen)
        yield Sample((values, offsets), {}, f"{len(counts)} segments")


def _segment_reference(values, offsets):
    return torch.stack([values[b:e].sum() for b, e in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)])


def test_bench_keeps_index_inputs_as_declared_and_still_refuses_a_wrong_kernel(seed):
    # float32 and float64: a half type's sum depends on its order of additions.
    fields = {
        "reference": _segment_reference,
        "samples": _segment_samples,
        "bench_cases": _segment_samples,
        "dtypes": ("float32", "float64"),
    }
    spec = opforge.spec(OPS.segment_sum.default, **fields)
    wire(spec)  # its public function, which bench times
    rows = bench_op(spec, CPU, seed=seed, budget_s=0.01, compile=False)
    assert rows and all(r.status == "ok" and r.timings.get("opforge") for r in rows), [r.status for r in rows]
    wrong = bench_op(opforge.spec(OPS.segment_sum_wrong.default, **fields), CPU, seed=seed, budget_s=0.01, compile=False)
    assert len(wrong) == 1 and wrong[0].status.startswith("refused: fails its reference check"), wrong[0].status


def _segment_reference_backwards(values, offsets):
    return _segment_reference(values.flip(0), (offsets[-1] - offsets).flip(0)).flip(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_largest_finite_values_meeting_in_one_sum_are_no_false_alarm_and_a_wrong_sum_still_fails(dtype):
    # One segment holds +max, -max and an ordinary value: summed forwards it is the ordinary value,
    # backwards 0 (float64 rounds it away beside max). Neither order is wrong; the other segment is exact.
    big, small = torch.finfo(dtype).max, float(torch.rand(()) + 0.25)
    values = torch.tensor([big, -big, small, 1.5, -0.75, 2.0], dtype=dtype)
    sample = Sample((values, torch.tensor([0, 3, 6])), {}, "max meets an ordinary value")
    fields = {"reference": _segment_reference_backwards, "samples": _segment_samples, "bench_cases": _segment_samples}
    spec = opforge.spec(OPS.segment_sum.default, **fields)
    assert run_reference(spec, sample, dtype) is not None  # the ordinary tolerance calls it off
    assert run_reference(spec, sample, dtype, special=True) is None
    wrong = opforge.spec(OPS.segment_sum_wrong.default, **fields)
    problem = run_reference(wrong, sample, dtype, special=True)
    assert problem is not None and "1/2 elements off" in problem and "first at [1]" in problem, problem


def test_input_sets_move_floating_values_only():
    gen = torch.Generator().manual_seed(0)
    values, offsets, mask = torch.randn(40), torch.tensor([0, 3, 3, 17, 40]), torch.rand(40) > 0.5
    sets = input_sets(Sample((values, offsets, mask), {}, "csr"), l2_bytes=64_000, gen=gen)
    assert len(sets) > 2
    for s in sets[1:]:
        assert not torch.equal(s.args[0], values) and torch.equal(s.args[0].sort().values, values.sort().values)
        assert torch.equal(s.args[1], offsets) and s.args[1].data_ptr() != offsets.data_ptr()
        assert torch.equal(s.args[2], mask) and s.args[2].data_ptr() != mask.data_ptr()
