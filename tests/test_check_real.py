"""opforge check on operators as other people's projects write them: no false
alarm on an operator that is right in its own way (float32 only, an index
argument, nothing returned, an out= that must be contiguous), and every real
bug named where it is (a wrong gradient, a write the schema does not declare,
a CUDA launch that fails, a kernel that kills the process or never returns).
The operators are in tests/fixtures/real_ops (torch.library, Python),
tests/fixtures/crash_ops and tests/fixtures/empty_grid (C++ and CUDA)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge
from opforge.check.grad import compile_sample
from opforge.check.process import Loads, run_checks
from opforge.check.run import (
    CHECKS,
    check_compile,
    check_gradcheck,
    check_gradgradcheck,
    check_op,
    check_reference,
    generator,
    to_reference,
)
from opforge.opspec import Sample
from opforge.project import load_spec_file
from opforge.registry import get_specs

from .conftest import SRC, opforge_process

FIXTURES = Path(__file__).parent / "fixtures"
REAL = FIXTURES / "real_ops"
CRASH = FIXTURES / "crash_ops"
CPU = torch.device("cpu")

sys.path.insert(0, str(REAL))
import real_ops  # noqa: E402, F401 - registers torch.ops.real_ops.*


def _row(stdout: str, op: str) -> list[str]:
    (line,) = [line for line in stdout.splitlines() if f"│ {op} " in line]
    return [c.strip() for c in line.strip("│ ").split("│")]


# --- gradients of a float32-only operator ---


def test_a_float32_only_spec_file_passes_when_right_and_fails_when_its_gradient_is_wrong(tmp_path, seed, opforge_here):
    right, wrong = REAL / "muladd_f32_spec.py", REAL / "muladd_f32_wrong_grad_spec.py"
    assert len(right.read_text().splitlines()) <= 5 and len(wrong.read_text().splitlines()) <= 5
    code, out, err = opforge_here("check", str(right), "--device", "cpu", "--seed", str(seed), cwd=tmp_path)
    assert code == 0, out + err
    cells = _row(out, "real_ops::muladd_f32")
    assert cells[1:6] == ["pass (14)", "pass (6)", "pass (6) float32", "pass (2) float32", "pass (1)"], cells
    assert "muladd_f32 gradcheck: in float32, the widest dtype the spec declares (dtypes=float32): eps 0.001, atol 0.01, rtol 0.01" in out
    code, out, err = opforge_here("check", str(wrong), "--device", "cpu", "--seed", str(seed), "--checks", "gradcheck")
    assert code == 1, out + err
    # A one-element sample may draw a and b within gradcheck's tolerance of each other, where d/da = a is right.
    assert re.fullmatch(r"FAIL \([4-6]/6\) float32", _row(out, "real_ops::muladd_f32_wrong_grad")[1])
    first = r"x gradcheck: muladd_f32_wrong_grad float32 \[(scalar|1)\]: "
    assert re.search(first + r"Jacobian mismatch for output 0 with respect to input 0 \(a\): numerical", out), out


def _muladd_f32(wrong: bool = False, **fields):
    op = torch.ops.real_ops.muladd_f32_wrong_grad if wrong else torch.ops.real_ops.muladd_f32
    return opforge.spec(op.default, reference=lambda a, b, c: a * b + c, **fields)


def test_gradients_are_checked_in_the_widest_dtype_the_spec_declares(seed):
    right, wrong = _muladd_f32(dtypes=(torch.float32,)), _muladd_f32(True, dtypes=(torch.float32,))
    for check in (check_gradcheck, check_gradgradcheck):
        result = check(right, CPU, seed)
        assert result.status == "pass" and result.tag == "float32", result.failures
    # Every sample whole in float32: fast mode's projections let a wrong d/da through on the large ones.
    result = check_gradcheck(wrong, CPU, seed)
    assert result.status == "fail" and result.count == 6, result.failures
    failed = {f.split(" float32 ", 1)[1].split(":", 1)[0] for f in result.failures}
    # Every sample of many elements fails; a one-element one may draw a close enough to b to pass.
    assert {"[7]", "[3x5]", "[33x17]", "[transposed 33x17]"} <= failed, failed
    assert all(" float32 [" in f and "with respect to input 0 (a)" in f for f in result.failures)
    # Half precision alone cannot carry a numerical derivative; float64, where declared, is what runs.
    half = check_gradcheck(opforge.spec(torch.ops.aten.mul.Tensor, reference=torch.mul, dtypes=(torch.float16, torch.bfloat16)), CPU, seed)
    assert half.status == "n/a" and half.note == "needs float32 or float64; the spec's dtypes are float16, bfloat16"
    (square,) = get_specs(["square"])
    result = check_gradcheck(square, CPU, seed)
    assert result.status == "pass" and result.tag == "" and result.note == ""


# --- arguments the reference must take as they are ---


def test_integer_arguments_reach_the_reference_in_their_own_dtype(seed):
    def samples(device, dtype, gen):
        yield Sample((torch.randn(5, 3, generator=gen, dtype=dtype, device=device), 0, torch.tensor([4, 0, 2], device=device)), desc="5x3")

    index_select = opforge.spec(
        torch.ops.aten.index_select.default, reference=lambda x, dim, index: torch.index_select(x, dim, index), samples=samples,
        bench_cases=samples,
    )  # fmt: skip
    result = check_reference(index_select, CPU, seed)
    assert result.status == "pass" and result.count == 8, result.failures

    def rows(device, dtype, gen):
        yield Sample((torch.randn(6, 4, generator=gen, dtype=dtype, device=device), torch.tensor([5, 1, 1], device=device)), desc="6x4")

    gather = opforge.spec(torch.ops.real_ops.gather_rows.default, reference=lambda x, index: x[index], samples=rows, bench_cases=rows)
    assert check_reference(gather, CPU, seed).status == "pass"
    converted = to_reference([torch.tensor([1, 2]), torch.ones(2, dtype=torch.bool), torch.ones(2), torch.ones(2, dtype=torch.complex64)])
    assert [t.dtype for t in converted] == [torch.int64, torch.bool, torch.float64, torch.complex128]


# --- what an operator returns and writes ---


def test_an_operator_returning_nothing_has_no_gradient_to_check(seed):
    def reference(x, s, out):
        out.copy_(x * s)

    spec = opforge.spec("real_ops::scale_into", reference=reference)
    assert not spec.differentiable
    results = {r.check: r for r in check_op(spec, CPU, seed)}
    for name in ("gradcheck", "gradgradcheck"):
        assert results[name].status == "n/a" and results[name].note == "returns no tensor", results[name]
    assert results["compile"].status == "pass", results["compile"].failures
    assert results["reference"].status == "pass" and results["opcheck"].status == "pass"


def test_the_compile_check_takes_the_best_sample_there_is(seed):
    def samples(device, dtype, gen):
        for n in (1, 7, 33):
            yield Sample(tuple(torch.randn(n, generator=gen, dtype=dtype, device=device) for _ in range(2)), desc=str(n))

    mul = opforge.spec(torch.ops.aten.mul.Tensor, reference=torch.mul, samples=samples, bench_cases=samples)
    result = check_compile(mul, CPU, seed)
    assert result.status == "pass" and result.count == 1, result.failures
    assert compile_sample(list(samples(CPU, torch.float32, generator(CPU, seed)))).desc == "33"


def _scale_out(name: str, **fields):
    def reference(x, out):
        out.copy_(2 * x)

    return opforge.spec(f"real_ops::{name}", reference=reference, **fields)


def test_a_derived_out_layout_the_operator_refuses_is_reported_not_failed(seed):
    results = check_op(_scale_out("scale_out_contiguous"), CPU, seed, ("reference", "opcheck"))
    for r in results:
        assert r.status == "pass", r.failures
        assert r.tag == "1 layout refused"
        assert r.note.startswith("refuses out with strides [1, 33] (transposed 33x17): ")
        assert "out must be contiguous" in r.note and r.note.endswith("; checked with it contiguous instead")
    # A wrong answer in that layout is still a failure; so is a refusal of a layout the spec itself gives.
    wrong = check_reference(_scale_out("scale_out_ignores_strides"), CPU, seed)
    assert wrong.status == "fail" and all("transposed 33x17" in f for f in wrong.failures)

    def own(device, dtype, gen):
        x = torch.randn(5, 3, generator=gen, dtype=dtype, device=device)
        yield Sample((x, torch.empty(3, 5, dtype=dtype, device=device).t()), desc="out transposed")

    declared = check_reference(_scale_out("scale_out_contiguous", samples=own, bench_cases=own), CPU, seed)
    assert declared.status == "fail" and "out must be contiguous" in declared.failures[0]


def test_a_write_the_schema_does_not_declare_is_said_once_with_the_fix(seed):
    def reference(a, b, c):
        c.copy_(a + b)

    spec = opforge.spec("real_ops::add_into", reference=reference)
    results = check_op(spec, CPU, seed)
    first, *rest = results
    assert first.check == "reference" and first.status == "fail"
    assert first.failures == [
        "real_ops::add_into writes into argument c, which its schema does not mark as written: if writing it is the "
        "operator's job, declare it `Tensor(a!) c` in its schema (now: real_ops::add_into(Tensor a, Tensor b, Tensor c) -> ()); "
        "if not, the kernel overwrites an input it must only read"
    ]
    assert [r.status for r in rest] == ["n/a"] * (len(CHECKS) - 1)
    assert all(r.note == "not run: its schema must mark what it writes first" for r in rest)


# --- kernels that kill the process or never return ---


def test_a_kernel_that_kills_the_process_is_named_and_the_rest_is_checked(tmp_path, seed):
    res = opforge_process(
        "check",
        str(CRASH / "crash_spec.py"),
        "--device",
        "cpu",
        "--seed",
        str(seed),
        "--checks",
        "reference,opcheck",
        cwd=tmp_path,
        autoload=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert _row(res.stdout, "crash_ops::twice_by_rows")[1:] == ["FAIL SIGFPE", "pass (6)"]
    assert _row(res.stdout, "crash_ops::twice_or_segfault")[1:] == ["FAIL SIGSEGV", "pass (6)"]
    assert _row(res.stdout, "crash_ops::twice")[1:] == ["pass (14)", "pass (6)"]
    for op, signal in (("twice_by_rows", "SIGFPE (Floating point exception)"), ("twice_or_segfault", "SIGSEGV (Segmentation fault)")):
        assert (
            f"x reference: {op} float32 [empty 0]: killed the process with {signal} in this step; the checks went on in a new process"
        ) in res.stdout
    assert res.stdout.strip().endswith("4 passed, 2 failed")


def test_a_kernel_that_never_returns_is_killed_at_the_time_limit(seed):
    specs = load_spec_file(CRASH / "hang_spec.py")
    results = run_checks(specs, CPU, seed, ["reference"], loads=Loads(targets=[str(CRASH / "hang_spec.py")]), time_limit=3)
    (hang,) = results["crash_ops::twice_or_hang"]
    assert hang.status == "fail" and hang.crashed and hang.tag == "time limit"
    assert hang.failures == [
        "twice_or_hang float32 [empty 0]: still running after 3 s (--time-limit): killed; the checks went on in a new process"
    ]
    (twice,) = results["crash_ops::twice"]
    assert twice.status == "pass" and twice.count == 14


SIDE_BY_SIDE = """
import sys, torch
from opforge.check.process import Loads, run_checks
from opforge.project import load_spec_file
specs = load_spec_file(sys.argv[1])
notes = []
results = run_checks(specs, torch.device("cpu"), int(sys.argv[2]), ["reference", "opcheck"], loads=Loads(targets=[sys.argv[1]]),
                     on_note=notes.append, workers=2)
print("order:", list(results) == [s.qualname for s in specs], "notes:", notes)
for q, rs in results.items():
    print(q, [(r.check, r.status, r.tag if r.crashed else "") for r in rs])
"""


def test_children_side_by_side_give_each_operator_its_own_verdicts(seed):
    """Two children, each with every other operator: a crash in one child's operator is that
    operator's, the other child's go on, and the results come back in the specs' order (in a
    process of its own: the crash fixture's operators are registered once a process)."""
    res = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE, str(CRASH / "crash_spec.py"), str(seed)],
                         env={**os.environ, "PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "1"}, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "order: True notes: []" in lines, res.stdout
    assert "crash_ops::twice_by_rows [('reference', 'fail', 'SIGFPE'), ('opcheck', 'pass', '')]" in lines, res.stdout
    assert "crash_ops::twice_or_segfault [('reference', 'fail', 'SIGSEGV'), ('opcheck', 'pass', '')]" in lines, res.stdout
    assert "crash_ops::twice [('reference', 'pass', ''), ('opcheck', 'pass', '')]" in lines, res.stdout


@pytest.mark.parametrize(("value", "message"), [("two", "a whole number of processes, got 'two'"), ("0", "at least 1, got 0")])
def test_a_bad_worker_count_is_refused_naming_the_variable(monkeypatch, value, message):
    from opforge.check.process import check_workers

    monkeypatch.setenv("OPFORGE_CHECK_WORKERS", value)
    with pytest.raises(ValueError, match=f"OPFORGE_CHECK_WORKERS must be {message}"):
        check_workers(11)
    monkeypatch.setenv("OPFORGE_CHECK_WORKERS", "8")
    assert check_workers(3) == 3 and check_workers(11) == 8


def test_an_operator_the_checks_process_cannot_load_is_checked_here(seed):
    notes: list[str] = []
    spec = _muladd_f32(dtypes=(torch.float32,))  # registered by this test module only
    results = run_checks([spec], CPU, seed, ["reference"], loads=Loads(), on_note=notes.append)
    assert [r.status for r in results["real_ops::muladd_f32"]] == ["pass"] and not notes


# --- CUDA: a failed launch in the step that made it ---


@pytest.mark.cuda
def test_a_failed_cuda_launch_is_reported_by_the_step_and_sample_that_made_it(tmp_path, seed):
    spec_file = FIXTURES / "empty_grid" / "empty_grid_spec.py"
    (spec,) = load_spec_file(spec_file)
    cuda = torch.device("cuda")
    results = {r.check: r for r in check_op(spec, cuda, seed)}
    reference = results["reference"]
    assert reference.status == "fail", reference
    (failure,) = reference.failures
    # A grid of zero blocks: "invalid configuration" on some drivers, "invalid argument" on others (an H100 with 580).
    want = rf"twice float32 \[empty 0\] \(seed {seed}\): CUDA error after the operator's call: invalid (configuration|argument)"
    assert re.match(want, failure), failure
    # Nothing of it leaks into the checks that follow.
    for name in ("opcheck", "compile"):
        assert results[name].status == "pass", results[name].failures
    # The same through the command, whose checks run in a process of their own.
    res = opforge_process("check", str(spec_file), "--device", "cuda", "--seed", str(seed), cwd=tmp_path, autoload=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert _row(res.stdout, "empty_grid::twice")[1:3] == ["FAIL (1/14)", "pass (6)"], res.stdout
    assert "x reference: twice float32 [empty 0]" in res.stdout and re.search("invalid (configuration )?argument", res.stdout)
    assert "AcceleratorError" not in res.stdout + res.stderr
