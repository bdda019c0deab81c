"""opforge check against kernels with a bug planted where a checker is easiest
to fool (tests/fixtures/planted_ops): an in-place kernel that does nothing or
adds too much, an out= kernel that writes nothing, a kernel wrong on its
optional tensor, one wrong past 50,000 elements, one that flushes subnormals
or writes -0 for +0, and kernels of integer, bool and complex dtypes. Each
must fail, and its correct twin pass."""

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
from opforge.bench.run import bench_op
from opforge.check.run import check_op, check_reference
from opforge.check.values import measure_error
from opforge.derive import DeriveError
from opforge.spec import Sample, SpecError

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
def test_a_kernel_that_flushes_subnormals_fails(dtype, seed):
    assert _reference(opforge.spec(OPS.copy.default, reference=torch.clone, dtypes=(dtype,)), seed).status == "pass"
    res = _reference(opforge.spec(OPS.copy_ftz.default, reference=torch.clone, dtypes=(dtype,)), seed)
    assert res.status == "fail"
    # float16's subnormals (under 6.1e-5) are drawn in plain samples too.
    assert any("special values" in f for f in res.failures), res.failures
    assert all(re.search(r"got -?0 want -?\d", f) for f in res.failures), res.failures


def test_a_kernel_that_writes_minus_zero_for_zero_fails(seed):
    res = _reference(opforge.spec(OPS.copy_negzero.default, reference=torch.clone), seed)
    assert res.status == "fail"
    assert all("special values" in f and "got -0 want 0" in f for f in res.failures), res.failures


def test_measure_error_sees_flushed_subnormals_and_signed_zeros():
    fi = torch.finfo(torch.float32)
    sub = fi.tiny * fi.eps * 3
    ref = torch.tensor([sub, -sub, 0.0, -0.0, 1.0], dtype=torch.float64)
    assert measure_error(ref.float(), ref, 1e-6, 1e-6, subnormals=True).n_bad == 0
    flushed = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0])
    e = measure_error(flushed, ref, 1e-6, 1e-6, subnormals=True)
    assert (e.n_bad, e.first_bad) == (2, (0,))
    # In an ordinary sample a result among the subnormals carries the absolute tolerance (a float16 matmul's may).
    assert measure_error(flushed, ref, 1e-6, 1e-6).n_bad == 0
    signs = torch.tensor([sub, -sub, -0.0, 0.0, 1.0])
    # In an ordinary sample a zero's sign is free: a sum's zero takes it from the order of its terms.
    assert measure_error(signs, ref, 1e-6, 1e-6).n_bad == 0
    e = measure_error(signs, ref, 1e-6, 1e-6, subnormals=True)
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
