"""``opforge.spec`` and ``opforge check|bench FILE.py``: an operator already in
torch.ops, checked and timed from a reference and a few lines, the rest derived
from its schema (opforge.derive)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor

import opforge
import opforge.opspec
import opforge.registry
from opforge.check.run import check_gradcheck, check_op
from opforge.derive import BENCH_SIZES, DeriveError, describe
from opforge.opspec import DEFAULT_TOLERANCES, OpSpec
from opforge.project import ProjectError, load_spec_file
from opforge.registry import wire

from .conftest import opforge_process

FIXTURE = Path(__file__).parent / "fixtures" / "spec_file"
CPU = torch.device("cpu")
NS = "opforge_test_derive"


# --- operators of a user's, registered here through torch.library, none through opforge ---


@torch.library.custom_op(f"{NS}::muladd", mutates_args=())
def muladd(a: Tensor, b: Tensor, c: float) -> Tensor:
    return a * b + c


@muladd.register_fake
def _(a: Tensor, b: Tensor, c: float) -> Tensor:
    return torch.empty_like(a)


def _muladd_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    return grad * b, grad * a, None


def _muladd_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


muladd.register_autograd(_muladd_backward, setup_context=_muladd_setup)


@torch.library.custom_op(f"{NS}::no_formula", mutates_args=())
def no_formula(x: Tensor) -> Tensor:
    return x * 3


@no_formula.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


# Defined and implemented without custom_op: no Autograd kernel at all.
torch.library.define(f"{NS}::plain", "(Tensor x) -> Tensor")
torch.library.impl(f"{NS}::plain", "CPU")(lambda x: x * 2)
torch.library.register_fake(f"{NS}::plain")(lambda x: torch.empty_like(x))

torch.library.define(f"{NS}::mixed", "(Tensor x, Tensor[] ys, Tensor? w, bool flag, float eps=0.5, *, int n) -> Tensor")
torch.library.impl(f"{NS}::mixed", "CPU")(lambda x, ys, w, flag, eps=0.5, *, n: (x + ys[0] * ys[1]) * n if flag else x - eps)

torch.library.define(f"{NS}::copy_out", "(Tensor a, Tensor(a!) out) -> ()")


@torch.library.impl(f"{NS}::copy_out", "CPU")
def _(a: Tensor, out: Tensor) -> None:
    out.copy_(a)


torch.library.define(f"{NS}::takes_dims", "(Tensor x, int[] dims) -> Tensor")
torch.library.impl(f"{NS}::takes_dims", "CPU")(lambda x, dims: x.sum(dims))

torch.library.define(f"{NS}::matmul", "(Tensor a, Tensor b) -> Tensor")
torch.library.impl(f"{NS}::matmul", "CPU")(lambda a, b: a @ b)


def _copy_out(a: Tensor, out: Tensor) -> None:
    out.copy_(a)


def _muladd_spec(**fields) -> OpSpec:
    return opforge.spec(torch.ops.opforge_test_derive.muladd.default, reference=lambda a, b, c: a * b + c, **fields)


# --- opforge check / bench FILE.py, as users run them ---


def test_check_of_a_spec_file_passes_with_what_the_schema_gives(tmp_path, seed, opforge_here):
    # Run from elsewhere: the file's own folder puts muladd_py beside it on sys.path.
    code, out, err = opforge_here("check", str(FIXTURE / "muladd_spec.py"), "--device", "cpu", "--seed", str(seed), cwd=tmp_path)
    assert code == 0, out + err
    assert "extension_cpp::mymuladd" in out
    assert "samples, bench cases, cost and tolerances derived from the schema; no bad inputs declared" in out
    # reference, opcheck, gradcheck and gradgradcheck (the owner's autograd formula), compile, export; no bad inputs to try.
    assert out.strip().endswith("6 passed, 0 failed")
    assert "none declared" in out


def test_check_of_a_spec_file_fails_when_its_reference_is_wrong(tmp_path, seed):
    # In a process of its own: this one holds muladd_spec.py's spec of the same operator.
    res = opforge_process(
        "check",
        str(FIXTURE / "wrong_reference_spec.py"),
        "--device",
        "cpu",
        "--seed",
        str(seed),
        "--checks",
        "reference",
        cwd=tmp_path,
        autoload=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "x reference: mymuladd float32 [" in res.stdout
    assert res.stdout.strip().endswith("0 passed, 1 failed")


def test_bench_of_a_spec_file_times_it_against_eager_and_compiled(tmp_path, seed, opforge_here):
    case = f"2^{BENCH_SIZES['cpu'][0].bit_length() - 1}"
    code, out, err = opforge_here(
        "bench", str(FIXTURE / "muladd_spec.py"), "--device", "cpu", "--dtype", "float32", "--budget", "0.02", "--case", case,
        "--seed", str(seed), cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, out + err
    (row,) = [line for line in out.splitlines() if "│ mymuladd" in line]
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:3] == ["mymuladd", "float32", case]
    header = next(line for line in out.splitlines() if "operator" in line and "vs compiled" in line)
    columns = [c.strip() for c in header.strip("┃ ").split("┃")]
    timed = dict(zip(columns, cells, strict=True))
    for column in ("opforge us", "eager us", "compiled us"):
        assert any(ch.isdigit() for ch in timed[column]), (column, row)
    for column in ("vs eager", "vs compiled"):
        # A ratio built on an outlier time (a loaded machine) carries marks, "0.41x (1) (2)": the notes say why.
        assert re.sub(r"( \(\d+\))+$", "", timed[column]).endswith("x"), (column, row)


def test_a_missing_spec_file_is_a_usage_error(tmp_path, capsys):
    from opforge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["check", str(tmp_path / "nowhere.py")])
    assert exc.value.code == 2
    assert "nowhere.py: no such file" in capsys.readouterr().err


def test_a_spec_file_without_specs_says_what_it_lacks(tmp_path):
    path = tmp_path / "empty_spec.py"
    path.write_text("import torch\n")
    with pytest.raises(ProjectError, match=r"empty_spec\.py defines no SPECS: .*opforge\.spec\("):
        load_spec_file(path)


def test_a_spec_file_whose_schema_cannot_be_drawn_names_the_argument_and_the_line(tmp_path):
    path = tmp_path / "dims_spec.py"
    path.write_text(
        "import torch\nimport opforge\n\n"
        f"SPECS = [opforge.spec(torch.ops.{NS}.takes_dims.default, reference=lambda x, dims: x.sum(dims))]\n"
    )
    with pytest.raises(ProjectError, match=r"dims_spec\.py:4: DeriveError: .*argument 'dims' is a List\[int\].*give samples="):
        load_spec_file(path)


# --- what opforge.spec derives ---


def test_spec_returns_the_one_opspec_type_exported_from_opforge():
    s = _muladd_spec()
    assert type(s) is OpSpec
    assert "spec" in opforge.__all__
    assert (s.namespace, s.name, s.overload_name) == (NS, "muladd", "default")
    assert s.overload is torch.ops.opforge_test_derive.muladd.default
    # A packet, a string and the custom_op function name the same operator.
    for op in (torch.ops.opforge_test_derive.muladd, f"{NS}::muladd", muladd):
        assert opforge.spec(op, reference=lambda a, b, c: a * b + c).overload is s.overload
    assert s.owner_registered and s.derived == ("samples", "bench_cases", "cost", "tolerances", "bad_inputs")
    assert describe(s) == "samples, bench cases, cost and tolerances derived from the schema; no bad inputs declared"
    assert s.tolerance(torch.float16) == DEFAULT_TOLERANCES[torch.float16]


def test_every_opspec_field_stays_a_keyword():
    s = _muladd_spec(dtypes=(torch.float64,), tolerances={torch.float64: (0.0, 1e-9)}, bad_inputs=lambda device: [], doc="mine")
    assert s.dtypes == (torch.float64,) and s.tolerance(torch.float64) == (0.0, 1e-9) and s.doc == "mine"
    assert describe(s) == "samples, bench cases and cost derived from the schema"
    with pytest.raises(TypeError, match=r"no OpSpec field named sampels"):
        _muladd_spec(sampels=None)
    with pytest.raises(TypeError, match=r"name come from the operator"):
        _muladd_spec(name="other")


def test_derived_samples_cover_odd_sizes_a_transposed_and_an_empty_one():
    s = _muladd_spec()
    samples = list(s.samples(CPU, torch.float32, torch.Generator().manual_seed(0)))
    shapes = [tuple(smp.args[0].shape) for smp in samples]
    assert {(), (1,), (7,), (3, 5), (33, 17)} <= set(shapes)
    assert any(not smp.args[0].is_contiguous() and smp.args[0].numel() > 1 for smp in samples)
    assert any(smp.args[0].numel() == 0 for smp in samples)
    for smp in samples:
        a, b, c = smp.args
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype == torch.float32
        assert isinstance(c, float) and 0.5 <= c < 2
        assert a.numel() == 0 or (a != 0).any()
    (f64,) = [smp for smp in s.samples(CPU, torch.float64, torch.Generator().manual_seed(0)) if smp.desc == "3x5"]
    assert f64.args[0].dtype == torch.float64


def test_derived_samples_fill_lists_optionals_bools_and_keywords():
    s = opforge.spec(f"{NS}::mixed", reference=lambda x, ys, w, flag, eps=0.5, *, n: (x + ys[0] * ys[1]) * n if flag else x - eps)
    samples = list(s.samples(CPU, torch.float32, torch.Generator().manual_seed(0)))
    flags, weights = set(), set()
    for smp in samples:
        x, ys, w, flag = smp.args  # eps keeps its default: not passed
        assert isinstance(ys, list) and len(ys) == 2 and all(y.shape == x.shape for y in ys)
        assert w is None or w.shape == x.shape
        weights.add(w is None)
        assert f"w={'None' if w is None else 'tensor'}" in smp.desc
        flags.add(flag)
        assert f"flag={flag}" in smp.desc
        assert isinstance(smp.kwargs["n"], int) and 1 <= smp.kwargs["n"] <= 4
    assert flags == {True, False} and weights == {True, False}


def test_derived_cost_counts_inputs_and_outputs_once_and_a_flop_per_output_element():
    s = _muladd_spec()
    n = BENCH_SIZES["cpu"][0]
    case = next(iter(s.bench_cases(CPU, torch.float32, torch.Generator().manual_seed(0))))
    assert [tuple(t.shape) for t in case.args[:2]] == [(n,), (n,)]
    cost = s.cost(*case.args, **case.kwargs)
    assert (cost.bytes, cost.flops) == (3 * 4 * n, n)
    # An argument the operator writes is counted once, and its elements are the FLOPs.
    out = opforge.spec(f"{NS}::copy_out", reference=_copy_out)
    case = next(iter(out.bench_cases(CPU, torch.float32, torch.Generator().manual_seed(0))))
    cost = out.cost(*case.args)
    assert (cost.bytes, cost.flops) == (2 * 4 * n, n)


def test_derived_bench_cases_are_named_for_a_gpu_without_one():
    # bench lists a GPU's cases on the meta device: nothing is drawn there.
    from opforge.bench.run import case_names

    names = case_names(_muladd_spec(), torch.device("cuda"), sweep=False)
    assert names == [f"2^{n.bit_length() - 1}" for n in BENCH_SIZES["cuda"]]


def test_a_derived_spec_of_an_out_form_passes_its_reference_check(seed):
    # out is filled with NaN before each run and compared with the reference's out.
    s = opforge.spec(f"{NS}::copy_out", reference=_copy_out)
    (res,) = check_op(s, CPU, seed, ("reference",))
    assert res.status == "pass", res.failures


def test_a_schema_that_cannot_be_drawn_names_the_argument():
    with pytest.raises(DeriveError, match=r"argument 'dims' is a List\[int\].*give samples= and bench_cases="):
        opforge.spec(f"{NS}::takes_dims", reference=lambda x, dims: x.sum(dims))


def test_inputs_that_need_shapes_of_their_own_name_the_arguments():
    with pytest.raises(DeriveError, match=r"every Tensor argument \(a, b\) one shape \(3x5, float32, cpu\).*give samples= and bench_"):
        opforge.spec(f"{NS}::matmul", reference=torch.mm)


def test_an_unknown_operator_is_named():
    with pytest.raises(DeriveError, match=r"'opforge_test_derive::nothing': no such operator in torch.ops"):
        opforge.spec(f"{NS}::nothing", reference=torch.neg)
    with pytest.raises(TypeError, match=r"op must be an operator of torch.ops .*got int \(3\)"):
        opforge.spec(3, reference=torch.neg)


# --- fake kernel and autograd formula: the owner's ---


def test_a_derived_spec_registers_nothing_over_the_owners():
    s = _muladd_spec()
    before = torch._C._dispatch_dump(f"{NS}::muladd")
    wire(s)
    assert torch._C._dispatch_dump(f"{NS}::muladd") == before
    assert s.differentiable
    x = torch.randn(4, requires_grad=True)
    s.function(x, torch.full((4,), 2.0), 1.0).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))


@pytest.mark.parametrize("name", ["plain", "no_formula"])
def test_without_an_autograd_formula_gradcheck_is_not_applicable(name, seed):
    s = opforge.spec(f"{NS}::{name}", reference=lambda x: x * (2 if name == "plain" else 3))
    assert not s.differentiable
    res = check_gradcheck(s, CPU, seed)
    assert res.status == "n/a" and res.note == "no autograd formula"


# --- command lines and spec files that are wrong themselves ---


@pytest.mark.parametrize("checks", ["", ",", "reference,"])
def test_an_empty_check_name_is_a_usage_error(checks, capsys):
    from opforge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["check", "--checks", checks, "--device", "cpu"])
    assert exc.value.code == 2
    assert f"--checks {checks!r} names an empty check" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "says"), [("import torch\n", "defines no SPECS"), ("SPECS = []\n", "SPECS is empty")])
def test_a_spec_file_without_specs_is_a_usage_error_naming_the_file(text, says, tmp_path, capsys):
    from opforge.cli import main

    path = tmp_path / "lacking_spec.py"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["check", str(path), "--device", "cpu"])
    assert exc.value.code == 2
    assert f"lacking_spec.py{':' if 'empty' in says else ''} {says}" in capsys.readouterr().err


def test_a_spec_file_that_exits_is_an_error_naming_the_file_and_line(tmp_path, opforge_here):
    path = tmp_path / "exiting_spec.py"
    path.write_text("import sys\n\nsys.exit(3)\n")
    with pytest.raises(ProjectError, match=r"exiting_spec\.py:3: the spec file called sys\.exit\(3\) while it was loaded"):
        load_spec_file(path)
    # The command in this process: the file registers nothing, and its exit is caught as it loads.
    code, out, err = opforge_here("check", str(path), "--device", "cpu", cwd=tmp_path)
    assert code == 1, out + err
    assert "exiting_spec.py:3: the spec file called sys.exit(3)" in err


def test_a_spec_file_over_opforges_own_operator_is_checked_with_its_reference(tmp_path, seed):
    # In a process of its own, where opforge's op library is not loaded until the spec file names its operator.
    path = tmp_path / "own_spec.py"
    path.write_text("import torch, opforge\n\nSPECS = [opforge.spec(torch.ops.opforge.square.default, reference=lambda x: x * x + 1)]\n")
    res = opforge_process("check", str(path), "--device", "cpu", "--seed", str(seed), "--checks", "reference", cwd=tmp_path, autoload=False)
    # The file's reference (off by one) is the one checked: the operator is found, and fails against it.
    assert res.returncode == 1, res.stdout + res.stderr
    assert "x reference: square float32 [scalar] (seed" in res.stdout and "want" in res.stdout, res.stdout + res.stderr
    assert "no attribute" not in res.stdout + res.stderr


# --- where the names live ---


def test_the_description_imports_nothing_of_opforge():
    """opforge.opspec is read by every floor: an import of opforge there, even a type-only one,
    would tie the description back to the runtime that reads it."""
    tree = ast.parse(Path(opforge.opspec.__file__).read_text())
    found = [
        f"line {n.lineno}"
        for n in ast.walk(tree)
        if (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "opforge"))
        or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "opforge" for a in n.names))
    ]
    assert not found, f"opforge/opspec.py imports opforge at {found}"


def test_the_older_import_path_opforge_spec_still_works_and_opforge_spec_stays_the_function():
    from opforge.spec import OpSpec, Sample, get_specs, register, register_module  # the path of earlier releases

    assert (OpSpec, Sample) == (opforge.opspec.OpSpec, opforge.opspec.Sample)
    assert (get_specs, register, register_module) == (
        opforge.registry.get_specs,
        opforge.registry.register,
        opforge.registry.register_module,
    )
    assert callable(opforge.spec) and opforge.spec.__module__ == "opforge.derive"
    assert opforge.register is opforge.registry.register
