"""The opforge command, run as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import opforge

from .conftest import SRC


def test_check_passes_and_prints_the_table(opforge_here):
    code, out, err = opforge_here("check", "add", "axpby", "--device", "cpu", "--seed", "7")
    assert code == 0, out + err
    assert "opforge::add " in out and "opforge::axpby " in out
    for col in ("reference", "opcheck", "gradcheck", "gradgradcheck", "compile", "export", "bad inputs", "sharding"):
        assert col in out
    assert out.strip().endswith("16 passed, 0 failed")
    assert "seed 7" in err


def test_check_unknown_op_is_a_clear_error(opforge_here):
    code, _, err = opforge_here("check", "no_such_op")
    assert code == 2, "a usage error, not a failed check"
    assert "no operator named 'no_such_op'; known: add, add_out" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["check", "ad"], "opforge: no operator named 'ad'; known: add, add_out"),
        (["check", "add", "--checks", "referenc"], "opforge: unknown check 'referenc'; choose from reference"),
        (["check", "add", "--seeds", "0"], "argument --seeds: expected an integer from 1 to 1000, got '0'"),
        (["check", "./no_such_dir"], "opforge: ./no_such_dir: no such directory"),
        (["bench", "add", "--case", "2^99", "--device", "cpu"], "opforge bench: no cases named 2^99; they are: "),
        (["cache", "clean", "--older-than", "-1"], "argument --older-than: expected a number of days from 0 to 36500, got '-1'"),
        (["build", "no_such_dir"], "opforge build: no_such_dir is not a folder"),
    ],
)
def test_usage_errors_exit_2_with_their_message(args, message, capsys, tmp_path, monkeypatch):
    from opforge.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_failed_check_exits_1(monkeypatch, capsys):
    from opforge import cli
    from opforge.check import run as check

    def failing(spec, *args, **kwargs):
        return [check.CheckResult(spec.name, "reference", "fail", count=1, failures=["planted failure"])]

    monkeypatch.setattr(check, "check_op", failing)
    monkeypatch.setenv("OPFORGE_CHECK_IN_PROCESS", "1")  # the planted failure is this process's
    assert cli.main(["check", "square", "--checks", "reference", "--device", "cpu", "--seed", "1"]) == 1
    assert "reference: planted failure" in capsys.readouterr().out


def test_a_bare_name_is_the_operator_even_beside_a_folder_of_that_name(tmp_path, monkeypatch, capsys):
    """`opforge check add` in a folder holding a package add/ checks opforge's add; ./add or add/ is the package."""
    import opforge.project
    from opforge import cli

    package = tmp_path / "add"
    (package / "csrc").mkdir(parents=True)
    (package / "add_pkg").mkdir()
    (package / "add_pkg" / "__init__.py").write_text("")
    (package / "pyproject.toml").write_text('[tool.opforge]\nsources = "csrc"\npackage = "add_pkg"\nnamespace = "add_pkg"\n')
    loaded = []

    def load_project(path):
        loaded.append(str(path))
        return [SimpleNamespace(qualname="add_pkg::add")]

    monkeypatch.setattr(opforge.project, "load_project", load_project)
    monkeypatch.chdir(tmp_path)
    assert cli.resolve_targets(["add"]) == (["add"], {}, True)
    assert loaded == []
    for as_path in ("./add", "add/", str(package)):
        assert cli.resolve_targets([as_path]) == (["add_pkg::add"], {as_path: False}, False)
    assert loaded == ["add", "add", str(package)]
    # End to end: opforge's own operator is checked, and the package is never imported.
    loaded.clear()
    assert cli.main(["check", "add", "--checks", "reference", "--device", "cpu", "--seed", "1"]) == 0
    assert "opforge::add " in capsys.readouterr().out and loaded == []
    # A name that is no operator but a folder here: the message says how to name the folder.
    (tmp_path / "my_op").mkdir()
    with pytest.raises(SystemExit) as stop:
        cli.main(["check", "my_op"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "no operator named 'my_op'" in err and "(my_op/ is a folder here: write ./my_op for the package in it)" in err


def test_check_cuda_without_a_gpu_says_why(opforge_here):
    import torch

    if torch.cuda.is_available():
        return
    code, _, err = opforge_here("check", "add", "--device", "cuda")
    assert code != 0 and "torch sees no GPU" in err


def test_bench_writes_json_csv_and_compares(tmp_path, opforge_here):
    path = tmp_path / "bench.json"
    args = ("bench", "square", "--device", "cpu", "--dtype", "float32", "--budget", "0.02", "--seed", "3", "--no-compile")
    code, out, err = opforge_here(*args, "--case", "2^16,2^20", "--json", str(path), "--csv", str(tmp_path / "bench.csv"))
    assert code == 0, out + err
    data = json.loads(path.read_text())
    assert data["torch_version"] and data["device"] == "cpu" and data["date"] and data["threads"] >= 1
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_tflops"]["float32"] > 0
    rows = data["rows"]
    assert [r["case"] for r in rows] == ["2^16", "2^20"]
    for r in rows:
        assert r["status"] == "ok" and r["bytes"] == 8 * r["numel"]
        assert r["timings"]["opforge"]["median_us"] > 0 and r["timings"]["eager"]["median_us"] > 0
        assert r["timings"]["compiled"] is None and r["notes"]["compiled"].startswith("not asked")
        d = r["derived"]["eager"]
        assert abs(d["speedup_of_opforge"] - r["timings"]["eager"]["median_us"] / r["timings"]["opforge"]["median_us"]) < 1e-9
    lines = (tmp_path / "bench.csv").read_text().splitlines()
    assert lines[0].startswith("# AMD") or lines[0].startswith("# ")
    assert lines[1].startswith("op,dtype,case,impl,status") and len(lines) == 2 + 2 * 3
    assert "opforge bench" in out and "vs eager" in out
    # Against the earlier run, case by case: the one case timed again is the one compared.
    code, out, err = opforge_here(*args, "--case", "2^16", "--compare", str(path))
    assert code in (0, 1), out + err  # 1 when the loaded machine made it a regression
    assert "1 compared" in out and "against" in out


def test_bench_case_picks_cases_and_names_the_known_ones(tmp_path, opforge_here):
    path = tmp_path / "bench.json"
    args = ("bench", "sigmoid", "--device", "cpu", "--dtype", "float32,bfloat16", "--budget", "0.02", "--seed", "3")
    code, out, err = opforge_here(*args, "--case", "2^16", "--json", str(path))
    assert code == 0, out + err
    rows = json.loads(path.read_text())["rows"]
    assert [(r["dtype"], r["case"]) for r in rows] == [("float32", "2^16"), ("bfloat16", "2^16")]
    # The compiled baseline is compiled for the case itself (static shapes), and ran.
    assert all(r["timings"]["compiled"]["median_us"] > 0 for r in rows)
    code, out, err = opforge_here(*args, "--case", "2^16,2^99")
    assert code != 0 and "opforge bench: no cases named 2^99; they are: 2^16, 2^20, 2^22" in err


def test_check_seeds_and_report(opforge_here):
    import torch

    from opforge.check.run import with_special_values
    from opforge.registry import get_specs

    (spec,) = get_specs(["square"])
    gen = torch.Generator().manual_seed(0)
    # Every sample, and the small ones again with special values.
    cpu = torch.device("cpu")
    samples = sum(1 + (with_special_values(spec, s, d, gen) is not None) for d in spec.dtypes for s in spec.samples(cpu, d, gen))
    code, out, err = opforge_here("check", "square", "--device", "cpu", "--seed", "1", "--checks", "reference", "--seeds", "2", "--report")
    assert code == 0, out + err
    assert f"pass ({2 * samples})" in out and "per case" in out and "float16 [offset 1, 1025]" in out
    assert out.strip().endswith("1 passed, 0 failed")
    code, out, err = opforge_here("check", "square", "--seeds", "0")
    assert code == 2 and "argument --seeds: expected an integer from 1 to 1000, got '0'" in err


def test_list_and_build(opforge_here):
    code, out, _ = opforge_here("list")
    assert code == 0 and "opforge::axpby(Tensor x, Tensor y, float alpha=3., float beta=-1.) -> Tensor" in out
    code, out, _ = opforge_here("build")
    assert code == 0 and "op library:" in out and "(cached;" in out


_TINY_OP = """#include "opforge/aten/common.h"
namespace {
at::Tensor cube(const at::Tensor& x) {
  opforge::check_floating("NS::cube", "x", x);
  return x.mul(x).mul(x);
}
}  // namespace
TORCH_LIBRARY(NS, m) { m.def("cube(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NS, CPU, m) { m.impl("cube", &cube); }
"""


# jit is the route every other build test takes too: the other two are slow (two builds each, setuptools' the slowest).
@pytest.mark.parametrize("route", ["jit", *(pytest.param(r, marks=pytest.mark.slow) for r in ("inline", "setuptools"))])
def test_build_a_user_folder_by_a_torch_library_route(tmp_path, route, monkeypatch, capfd):
    folder = tmp_path / "cube_op"
    folder.mkdir()
    ns = f"opforge_cli_cube_{route}"
    (folder / "cube.cpp").write_text(_TINY_OP.replace("NS", ns))
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_NO_AUTOLOAD": "1"}
    code = (
        "import sys, torch; from pathlib import Path; from opforge.cli import build_folder\n"
        f"assert build_folder(Path({str(folder)!r}), {route!r}) == 0\n"
        f"x = torch.randn(5); assert torch.equal(torch.ops.{ns}.cube(x), x * x * x)\n"
        "print('OK')"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    assert "cube_op: " in res.stdout and "loaded into torch.ops" in res.stdout and f"({route}" in res.stdout.replace("(built", "(jit")
    broken = tmp_path / "broken_op"
    broken.mkdir()
    (broken / "b.cpp").write_text("int f() { return nope; }\n")
    # The failed build in this process (the compiler's own output included, whichever stream carries it).
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    capfd.readouterr()
    try:
        code = main(["build", str(broken), "--route", route])
    except SystemExit as stop:
        code = stop.code
    err = capfd.readouterr().err
    assert code == 1 and "nope" in err, err
    assert ("b.cpp:1:" if route != "inline" else "broken_op.cpp:1:") in err


def test_build_of_a_folder_that_registers_no_operator_fails_with_a_hint(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "0")
    # A pybind11 module with its name written out, built for torch.ops: refused before any compiler runs.
    pybind = tmp_path / "mymod"
    pybind.mkdir()
    (pybind / "mymod.cpp").write_text(
        '#include <torch/extension.h>\nstatic int twice(int x) { return 2 * x; }\nPYBIND11_MODULE(mymod, m) { m.def("twice", &twice); }\n'
    )
    assert main(["build", str(pybind), "--route", "jit"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    refused = "opforge build: mymod would register no operator in torch.ops: mymod.cpp:3 declares PYBIND11_MODULE(mymod, m)"
    assert err.startswith(refused), err
    assert "TORCH_LIBRARY(<namespace>, m)" in err and "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) and build with --route pybind" in err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("mymod-*")), "nothing was compiled"
    # Sources that register nothing in any way the sources show: built (one line), loaded, then refused.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "plain.cpp").write_text("int plain_answer() { return 42; }\n")
    assert main(["build", str(plain)]) == 1
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "loaded into torch.ops" not in captured.out
    assert "opforge build: plain: built and loaded" in err and "but it registers no operator" in err, err
    assert "TORCH_LIBRARY(<namespace>, m)" in err and "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), builds with --route pybind" in err


@pytest.mark.slow
def test_build_a_user_folder_by_the_cmake_route(tmp_path):
    import shutil

    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    folder = tmp_path / "cube_cmake"
    folder.mkdir()
    (folder / "cube.cpp").write_text(
        _TINY_OP.replace("NS", "opforge_cmake_cube")
        .replace('#include "opforge/aten/common.h"', "")
        .replace('opforge::check_floating("opforge_cmake_cube::cube", "x", x);', "")
    )
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(cube CXX)\nfind_package(Torch REQUIRED)\n"
        "add_library(cube SHARED cube.cpp)\ntarget_link_libraries(cube ${TORCH_LIBRARIES})\n"
        "set_target_properties(cube PROPERTIES CXX_STANDARD 17)\n"
    )
    (folder / "cube.cpp").write_text("#include <ATen/core/Tensor.h>\n#include <torch/library.h>\n" + (folder / "cube.cpp").read_text())
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_NO_AUTOLOAD": "1"}
    code = (
        "import torch; from pathlib import Path; from opforge.cli import build_folder\n"
        f"assert build_folder(Path({str(folder)!r}), 'cmake') == 0\n"
        "x = torch.randn(5); assert torch.equal(torch.ops.opforge_cmake_cube.cube(x), x * x * x)\n"
        "print('OK')"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-3000:] + res.stderr[-3000:]
    assert "(cmake; loaded into torch.ops)" in res.stdout


@pytest.mark.slow
def test_cmake_route_passes_its_own_interpreter(tmp_path):
    """An activated virtualenv or a python3 first on PATH must not become the
    build's interpreter: opforge passes the one whose torch it builds against."""
    import shutil

    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    folder = tmp_path / "which_python"
    folder.mkdir()
    (folder / "empty.cpp").write_text("int opforge_empty() { return 0; }\n")
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(which_python CXX)\n"
        "find_package(Python REQUIRED COMPONENTS Interpreter)\n"
        f'file(WRITE "{tmp_path}/python.txt" "${{Python_EXECUTABLE}}")\n'
        "add_library(which_python SHARED empty.cpp)\n"
    )
    decoy = tmp_path / "decoy"
    (decoy / "bin").mkdir(parents=True)
    for name in ("python", "python3"):  # a working interpreter at another path: a second venv
        (decoy / "bin" / name).symlink_to(sys.executable)
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "OPFORGE_CACHE_DIR": str(tmp_path / "cache"),
        "OPFORGE_NO_AUTOLOAD": "1",
        "VIRTUAL_ENV": str(decoy),
        "PATH": f"{decoy / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    code = f"from pathlib import Path; from opforge.cli import build_folder; print(build_folder(Path({str(folder)!r}), 'cmake'))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "0", res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "python.txt").read_text() == sys.executable


def test_run_is_the_main_job(opforge_here):
    code, stdout, stderr = opforge_here("run", "square", "--device", "cpu", "--seed", "2", "--budget", "0.01")
    res = SimpleNamespace(stdout=stdout, stderr=stderr)
    assert code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # A line per phase step, also when the output is not a terminal (as here).
    assert "check square: reference pass" in res.stderr
    assert "bench square float32 2^22: opforge " in res.stderr  # the largest case, float32 on the CPU, only
    assert "float16" not in res.stderr.split("check square:")[1]
    # One table at the end: the check's verdict, the times, the baseline not run and why.
    assert "op library:" in res.stdout and "opforge run:" in res.stdout
    for col in ("operator", "check", "vs eager", "vs torch.compile", "% of limit"):
        assert col in res.stdout
    table = res.stdout[res.stdout.index("opforge run:") :]
    assert "opforge::square" in table and "pass" in table and "not run" in table and "2^22" in table and "2^16" not in table
    assert "not run on the CPU; --full runs it" in table
    assert "1 operator: 1 passed every check, 0 failed; 1 case timed, 0 refused" in res.stdout
    assert "opforge check (" not in res.stdout and "opforge bench:" not in res.stdout  # no per-phase tables


def test_run_fails_when_a_check_fails(monkeypatch, capsys):
    """The exit code says whether everything passed: a failed check is a
    nonzero exit, named in the table and listed after it."""
    from opforge import cli
    from opforge.check import run as check

    real = check.check_op

    def failing(spec, *args, **kwargs):
        results = real(spec, *args, **kwargs)
        results[1] = check.CheckResult(spec.name, results[1].check, "fail", count=1, failures=["planted failure"])
        return results

    monkeypatch.setattr(check, "check_op", failing)
    monkeypatch.setenv("OPFORGE_CHECK_IN_PROCESS", "1")  # the planted failure is this process's
    monkeypatch.setattr(cli.out, "width", 200)
    code = cli.main(["run", "square", "--device", "cpu", "--seed", "1", "--budget", "0.01", "--no-compile"])
    out = capsys.readouterr()
    assert code == 1
    assert "FAIL opcheck" in out.out and "opcheck: planted failure" in out.out
    assert "1 operator: 0 passed every check, 1 failed" in out.out
    assert "check square: reference pass" in out.err and "opcheck FAIL (1/1)" in out.err


def test_bench_prints_a_line_per_case(opforge_here):
    args = ("bench", "add", "--device", "cpu", "--dtype", "float32", "--budget", "0.01", "--seed", "3", "--no-compile", "--case", "2^16")
    code, out, err = opforge_here(*args)
    assert code == 0, out + err
    line = next(ln for ln in err.splitlines() if ln.startswith("bench add float32 2^16:"))
    assert " us, " in line and "vs eager" in line and "compiled: not asked (--no-compile)" in line


def test_version(capsys):
    from opforge.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"opforge {opforge.__version__}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "int32"], "argument --dtype: 'int32' is not a dtype the operators take; use float32, float16, bfloat16, float64"),
        (["--dtype", "float128"], "argument --dtype: 'float128' is not a dtype the operators take"),
        (["--dtype", ""], "argument --dtype: expected comma-separated dtypes (float32, float16, bfloat16, float64), got ''"),
        (["--dtype", "float32,"], "argument --dtype: expected comma-separated dtypes"),
        (["--budget", "-1"], "argument --budget: expected a number of seconds > 0 and at most 86400 (a day), got '-1'"),
        (["--budget", "nan"], "argument --budget: expected a number of seconds > 0 and at most 86400 (a day), got 'nan'"),
        (["--budget", "soon"], "argument --budget: expected a number of seconds > 0 and at most 86400 (a day), got 'soon'"),
        (["--compare", "missing.json"], "argument --compare: no such file: missing.json"),
    ],
)
@pytest.mark.parametrize("command", ["bench", "run"])
def test_bench_arguments_are_checked_before_anything_runs(command, args, message, capsys, tmp_path, monkeypatch):
    from opforge.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([command, "add", *args] if command == "bench" else [command, *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"opforge {command}: error: "), err
    assert len(err.strip().splitlines()) == 1, err


def test_dtype_aliases_are_spelled_out():
    from opforge.cli import dtype_list

    assert dtype_list("fp16,bf16,float32,torch.float64,fp32") == "float16,bfloat16,float32,float64"
