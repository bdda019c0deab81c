"""The CMake route: CMakeLists.txt builds libopforge_ops.so from the same
csrc/ops folders as the JIT build, on the same stable ABI (the same
TORCH_TARGET_VERSION, libtorch_cpu its only torch library), its C++ test passes
under ctest, and the library gives torch.ops.opforge the same operators when
loaded by path.

One configure + build per module (~25 s on 2 cores, CPU only). The library is
loaded only in fresh interpreters: this process already holds the JIT-built
library (conftest imports opforge), and a second definition of the same
operator schemas would clash.

Then users' CMake projects through ``opforge build PATH``: a root CMakeLists.txt
that finds Torch goes by cmake whatever its sources register, its programs
(each with a main) are no library source on the other routes, ``-D NAME=VALUE``
reaches cmake (and is a build of its own), and the build runs MAX_JOBS jobs.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from opforge.builder import LIBRARY_TARGET, library_config, many
from opforge.builder.errors import BuildError
from opforge.builder.prebuilt import explain_load_error
from opforge.builder.sources import DiscoveryError, walk
from opforge.builder.stable import parse_target, target_flag
from opforge.elf_symbols import read_dynamic_symbols
from opforge.folders import cmake as cmake_route
from opforge.folders.cmake import definitions
from opforge.folders.describe import describe
from opforge.folders.discover import discover

from .conftest import opforge_process
from .test_byo_build import write

# One CMake build of the repository for the module (each of its tests slow), in one worker under pytest-xdist.
pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH: the CMake route cannot be built here"),
    pytest.mark.xdist_group("cmake"),
]

REPO = Path(__file__).resolve().parents[1]
OPS = ("add", "add_out", "square", "axpby", "axpby_backward", "sigmoid", "sigmoid_backward")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("cmake_build")
    # Torch found the way plain `cmake -S . -B build` finds it: by asking a
    # Python (this one, so the library matches the torch under test).
    t0 = time.perf_counter()
    _run(
        [
            "cmake",
            "-S",
            str(REPO),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        ]
    )
    t1 = time.perf_counter()
    _run(["cmake", "--build", str(build), f"-j{os.cpu_count() or 2}"])
    t2 = time.perf_counter()
    print(f"cmake configure {t1 - t0:.1f} s, build {t2 - t1:.1f} s")
    return build


@pytest.fixture(scope="module")
def library(build_dir: Path) -> Path:
    return build_dir / "libopforge_ops.so"


def _fresh_python(code: str, *, torch_libs_on_path: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs code in a new interpreter that sees opforge's sources but does not
    load the JIT library (OPFORGE_NO_AUTOLOAD=1)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OPFORGE_NO_AUTOLOAD="1")
    if not torch_libs_on_path:
        # Nothing may lead the loader to torch/lib but torch itself.
        for var in ("LD_LIBRARY_PATH", "LD_PRELOAD"):
            env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False, env=env, cwd=REPO, timeout=300
    )


@pytest.mark.slow
def test_build_produces_the_library(library: Path) -> None:
    assert library.is_file(), f"no {library.name} in {library.parent}: {sorted(p.name for p in library.parent.iterdir())}"
    assert library.read_bytes()[:4] == b"\x7fELF"
    # The JIT build's link: libtorch_cpu (the stable C shim) and no other torch
    # library (libc10, libtorch, libtorch_python would tie it to one torch or
    # one Python), no OpenMP runtime (the kernels use torch's thread pool), no
    # shared CUDA runtime.
    needed = read_dynamic_symbols(library).needed
    assert [n for n in needed if n.startswith(("libtorch", "libc10"))] == ["libtorch_cpu.so"], needed
    assert not [n for n in needed if n.startswith(("libgomp", "libomp", "libiomp", "libcudart"))], needed


@pytest.mark.slow
def test_compiled_like_the_jit_build(build_dir: Path) -> None:
    # The same C++ sources as the JIT build's library, each compiled for the
    # same stable-ABI target, without OpenMP.
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    cpp = {Path(c["file"]).resolve(): c["command"] for c in commands if c["file"].endswith(".cpp")}
    cpp = {source: command for source, command in cpp.items() if source.is_relative_to(REPO / "csrc")}
    jit = {s.resolve() for s in library_config(with_cuda=False).sources}
    assert set(cpp) == jit, f"CMake compiles {sorted(map(str, cpp))}, the JIT build {sorted(map(str, jit))}"
    flag = target_flag(LIBRARY_TARGET)
    for source, command in cpp.items():
        assert flag in command.split(), f"{source.name}: no {flag} in {command}"
        assert "-fopenmp" not in command, f"{source.name}: {command}"


@pytest.mark.slow
def test_library_is_on_the_stable_abi(library: Path, opforge_here) -> None:
    # The audit reads the file's symbols, it loads nothing: in this process.
    code, out, err = opforge_here("abi", str(library))
    assert code == 0, out + err
    # Its shim calls need no torch newer than the target it was compiled for.
    found = re.search(r"verdict: stable: loads in every torch >= (\d+)\.(\d+)", out)
    assert found, out
    assert (int(found[1]), int(found[2])) <= parse_target(LIBRARY_TARGET), out


@pytest.mark.slow
def test_ctest_passes(build_dir: Path) -> None:
    proc = _run(["ctest", "--test-dir", str(build_dir), "--output-on-failure"], timeout=300)
    assert "100% tests passed" in proc.stdout, proc.stdout
    assert "opforge_kernels" in proc.stdout


@pytest.mark.slow
def test_load_library_gives_the_same_ops(library: Path) -> None:
    proc = _fresh_python(f"""
        import json, torch, opforge
        ops = {list(OPS)!r}
        # The JIT library is not loaded: every op below comes from the CMake build.
        before = [op for op in ops if hasattr(torch.ops.opforge, op)]
        opforge.load_library({str(library)!r})
        schemas = {{op: str(getattr(torch.ops.opforge, op).default._schema) for op in ops}}
        torch.manual_seed(0)
        errors = {{}}
        for shape in [(1025,), (97, 3), (0,), (3, 5, 7)]:
            for dtype in (torch.float32, torch.float64):
                a, b = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
                for name, got, want in [
                    ("add", torch.ops.opforge.add(a, b), a + b),
                    ("sigmoid", torch.ops.opforge.sigmoid(a), torch.sigmoid(a)),
                    ("axpby", torch.ops.opforge.axpby(a, b), 3.0 * a - b),
                    ("axpby 2.5 -0.5", torch.ops.opforge.axpby(a, b, 2.5, -0.5), 2.5 * a - 0.5 * b),
                ]:
                    if got.shape != want.shape or got.dtype != want.dtype or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                        errors[f"{{name}} {{shape}} {{dtype}}"] = (got - want).abs().max().item() if got.numel() else "shape/dtype"
        try:
            torch.ops.opforge.add(torch.randn(3), torch.randn(4))
            mismatch = None
        except RuntimeError as exc:
            mismatch = str(exc)
        print(json.dumps({{"before": before, "schemas": schemas, "errors": errors, "mismatch": mismatch}}))
    """)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] == [], f"ops present before loading the CMake library: {result['before']}"
    assert result["errors"] == {}, result["errors"]
    assert result["mismatch"] is not None and result["mismatch"].startswith(
        "opforge::add: a and b must have the same shape, got [3] and [4]"
    ), result["mismatch"]
    # The same operators, schema for schema, as the JIT build this process loaded.
    jit = {op: str(getattr(torch.ops.opforge, op).default._schema) for op in OPS}
    assert result["schemas"] == jit


@pytest.mark.slow
def test_loading_without_torch_is_explained(library: Path) -> None:
    # ctypes, no `import torch`: the library has no rpath to torch/lib, so the
    # loader cannot find libtorch_cpu; opforge names the cause and fix.
    proc = _fresh_python(
        f"""
        import ctypes, sys
        try:
            ctypes.CDLL({str(library)!r})
        except OSError as exc:
            print(exc)
            sys.exit(0)
        print("loaded")
        sys.exit(1)
        """,
        torch_libs_on_path=False,
    )
    assert proc.returncode == 0, f"loaded without torch imported: {proc.stdout}{proc.stderr}"
    message = proc.stdout.strip()
    assert re.search(r"lib(c10|torch\w*)\.so: cannot open shared object file", message), message
    assert "libtorch_cpu.so" in message, message
    why = explain_load_error(library, message)
    assert "import torch" in why, why
    assert library.name in why, why


# --------------------------------------------------------------- users' CMake projects: opforge build PATH

# The library: a TORCH_LIBRARY operator, built by the project's CMakeLists.txt against torch.
_OP = """#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.add(x); }
TORCH_LIBRARY(cmtorch, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(cmtorch, CPU, m) { m.impl("twice", &twice); }
"""
_TORCH_PROJECT = {
    "CMakeLists.txt": """cmake_minimum_required(VERSION 3.18)
project(cmtorch LANGUAGES CXX)
find_package(Torch REQUIRED)
add_library(cmtorch SHARED src/op.cpp)
target_link_libraries(cmtorch PRIVATE torch)
enable_testing()
add_subdirectory(tests)
add_subdirectory(examples)
""",
    "src/op.cpp": _OP,
    # Programs, each with its own main: CMake makes one executable of each.
    "tests/CMakeLists.txt": "add_executable(test_twice test_twice.cpp)\nadd_test(NAME twice COMMAND test_twice)\n",
    "tests/test_twice.cpp": "int main() { return 0; }\n",
    "examples/CMakeLists.txt": "add_executable(demo_a demo_a.cpp)\nadd_executable(demo_b demo_b.cpp)\n",
    "examples/demo_a.cpp": '#include <cstdio>\nint main(int argc, char** argv) { std::puts("a"); return 0; }\n',
    "examples/demo_b.cpp": '#include <cstdio>\nint main() { std::puts("b"); return 0; }\n',
}
# A project whose CUDA part is on by default: on a torch without CUDA its link needs c10_cuda, which is not there.
_CUDA_OPTION_PROJECT = {
    "CMakeLists.txt": """cmake_minimum_required(VERSION 3.18)
project(cudaopt LANGUAGES CXX)
option(ENABLE_CUDA "build the CUDA kernels" ON)
find_package(Torch REQUIRED)
add_library(cudaopt SHARED op.cpp)
if(ENABLE_CUDA)
  target_compile_definitions(cudaopt PRIVATE WITH_CUDA)
  target_link_libraries(cudaopt PRIVATE c10_cuda)
endif()
""",
    "op.cpp": """#ifdef WITH_CUDA
extern "C" int cudaopt_with_cuda() { return 1; }
#else
extern "C" int cudaopt_with_cuda() { return 0; }
#endif
""",
}


@pytest.mark.parametrize(
    ("cmakelists", "route"),
    [
        ("find_package(Torch REQUIRED)\nadd_library(x SHARED op.cpp)\n", "cmake"),
        ("FIND_PACKAGE( Torch 2.0 CONFIG)\n", "cmake"),  # CMake's commands are case-insensitive
        ("# find_package(Torch REQUIRED)\nadd_library(x SHARED op.cpp)\n", "jit"),  # a comment finds nothing
        ("#[[\nfind_package(Torch)\n]]\n", "jit"),
        ("find_package(TorchVision)\n", "jit"),
        ("", "jit"),
    ],
)
def test_a_root_CMakeLists_that_finds_torch_decides_the_route(tmp_path, cmakelists, route):
    folder = write(tmp_path / "proj", {"CMakeLists.txt": cmakelists, "op.cpp": "TORCH_LIBRARY(ns, m) {}\n"})
    layout = discover(folder)
    assert layout.route == route, layout.why
    if route == "cmake":
        assert layout.why.startswith("CMakeLists.txt finds Torch"), layout.why
        assert "  route: cmake (CMakeLists.txt finds Torch (find_package(Torch))" in "\n".join(
            describe(layout, route=layout.route, cuda_reason=None)
        )


def test_a_setup_py_or_a_package_still_goes_before_a_CMakeLists_that_finds_torch(tmp_path):
    cmake = "find_package(Torch REQUIRED)\n"
    setup = write(tmp_path / "s", {"CMakeLists.txt": cmake, "op.cpp": "", "setup.py": "CppExtension"})
    assert discover(setup).route == "setup.py"
    package = write(tmp_path / "p", {"CMakeLists.txt": cmake, "pkg/__init__.py": "from . import _C\n", "pkg/op.cpp": ""})
    assert discover(package).route == "package"


def test_programs_that_define_main_are_no_library_source(tmp_path):
    folder = write(
        tmp_path / "progs",
        {
            "op.cpp": _OP,
            "examples/demo_a.cpp": _TORCH_PROJECT["examples/demo_a.cpp"],
            "examples/demo_b.cpp": "// int main() is below\nstatic int main ( ) { return 0; }\n",
            "bench/run.cu": "auto main() -> int { return 0; }\n",
            # Library code that also holds a main (under a macro): it registers operators, so it stays.
            "both.cpp": "TORCH_LIBRARY_FRAGMENT(cmtorch, m) {}\n#ifdef STANDALONE\nint main() { return 0; }\n#endif\n",
            # main named in a comment or a string only: library code.
            "notes.cpp": '// int main() lives elsewhere\nconst char* s = "int main(";\n',
        },
    )
    tree = walk(folder)
    assert [tree.rel(p) for p in tree.programs] == ["bench/run.cu", "examples/demo_a.cpp", "examples/demo_b.cpp"]
    assert [tree.rel(p) for p in tree.sources] == ["both.cpp", "notes.cpp", "op.cpp"]
    lines = describe(discover(folder), route="jit", cuda_reason=None)
    assert (
        "  left out, programs (each defines main(), not library code): bench/run.cu, examples/demo_a.cpp, examples/demo_b.cpp"
    ) in lines, lines
    # Only programs: nothing to build, and why.
    only = write(tmp_path / "only", {"main.cpp": "int main() { return 0; }\n"})
    with pytest.raises(DiscoveryError, match=r"nothing to build: .*\(left out, programs that define main\(\): main\.cpp\)"):
        discover(only)


def test_a_program_is_not_left_out_of_the_cmake_route_description(tmp_path):
    layout = discover(write(tmp_path / "proj", _TORCH_PROJECT))
    assert layout.route == "cmake"
    lines = describe(layout, route="cmake", cuda_reason=None)
    assert not any("programs" in line for line in lines), lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-D", "ENABLE_CUDA"], "-D: expected NAME=VALUE (a CMake cache definition, as cmake -D takes it), got 'ENABLE_CUDA': no '='"),
        (["-D", "=OFF"], "argument -D: expected NAME=VALUE or NAME:TYPE=VALUE"),
        (["-D", "A B=1"], "'A B' is not a CMake variable name"),
        (["-DFOO:LIST=1"], "'FOO:LIST' is not a CMake variable name"),
    ],
)
def test_a_malformed_definition_is_a_usage_error(tmp_path, opforge_here, args, message):
    folder = write(tmp_path / "proj", {"CMakeLists.txt": "find_package(Torch)\n"})
    code, _, err = opforge_here("build", str(folder), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_definition_on_a_route_that_runs_no_cmake_is_a_usage_error(tmp_path, opforge_here):
    folder = write(tmp_path / "jitproj", {"op.cpp": _OP, "CMakeLists.txt": "add_library(x SHARED op.cpp)\n"})
    code, out, err = opforge_here("build", str(folder), "-DENABLE_CUDA=OFF")
    assert code == 2, out + err
    assert (
        f"opforge build: {folder}: -D ENABLE_CUDA=OFF is a CMake cache definition, but this build takes the jit route "
        "(TORCH_LIBRARY operators: built into the cache, then loaded for torch.ops), which runs no cmake; --route cmake builds "
        "its CMakeLists.txt; a macro of the C++ sources is OPFORGE_CXXFLAGS=-DENABLE_CUDA=OFF"
    ) in err, err
    code, _, err = opforge_here("build", "-D", "ENABLE_CUDA=OFF")
    assert code == 2 and "-D ENABLE_CUDA=OFF is a CMake definition: give the folder (opforge build PATH -D NAME=VALUE)" in err, err


def test_definitions_are_part_of_the_build_folder(tmp_path):
    folder = tmp_path / "proj"
    plain = cmake_route.build_dir(folder)
    off = cmake_route.build_dir(folder, ["ENABLE_CUDA=OFF"])
    assert (
        len({plain, off, cmake_route.build_dir(folder, ["ENABLE_CUDA=ON"]), cmake_route.build_dir(folder, ["ENABLE_CUDA:BOOL=OFF"])}) == 4
    )
    assert off.name.startswith("cmake-proj-")
    # The same definitions in another order, or a name given twice (cmake keeps the last), are the same build.
    assert (
        cmake_route.build_dir(folder, ["A=1", "B=2"])
        == cmake_route.build_dir(folder, ["B=2", "A=1"])
        == cmake_route.build_dir(folder, ["A=0", "B=2", "A=1"])
    )
    assert definitions(["A=0", "B=2", "A=1"]) == ["A=1", "B=2"]


def _fake_cmake(monkeypatch: pytest.MonkeyPatch, *, returncode: int = 0, stderr: str = "") -> list[list[str]]:
    """cmake's commands recorded (in the list returned) and answered with ``returncode``, not run; the rest runs."""
    ran: list[list[str]] = []
    real = cmake_route.run_bounded

    def run(cmd, **kwargs):
        if cmd[0] != "cmake":
            return real(cmd, **kwargs)
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(cmake_route, "run_bounded", run)
    return ran


def test_definitions_and_MAX_JOBS_reach_cmake(tmp_path, monkeypatch):
    folder = write(tmp_path / "proj", {"CMakeLists.txt": 'project(p)\noption(ENABLE_CUDA "build the CUDA kernels" ON)\n'})
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    ran = _fake_cmake(monkeypatch)
    for max_jobs, jobs in (("3", "3"), ("", str(many.jobs()))):
        monkeypatch.setenv("MAX_JOBS", max_jobs)
        ran.clear()
        with pytest.raises(BuildError, match="cmake built no shared library"):  # nothing ran: no library
            cmake_route.build_cmake(folder, defines=["ENABLE_CUDA=ON", "CMAKE_BUILD_TYPE=Debug", "ENABLE_CUDA=OFF"], say=lambda _: None)
        configure, make = ran
        build = str(cmake_route.build_dir(folder, ["ENABLE_CUDA=OFF", "CMAKE_BUILD_TYPE=Debug"]))
        assert configure[:5] == ["cmake", "-S", str(folder), "-B", build]
        # The user's own last: cmake keeps the last -D of a name (opforge's Release build type gives way).
        assert configure[-2:] == ["-DENABLE_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Debug"], configure
        assert make == ["cmake", "--build", build, "--parallel", jobs]


def test_a_failed_cmake_build_names_the_options_that_D_sets(tmp_path, monkeypatch):
    folder = write(tmp_path / "cudaopt", _CUDA_OPTION_PROJECT)
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    _fake_cmake(monkeypatch, returncode=1, stderr="cannot find -lc10_cuda\n")
    with pytest.raises(BuildError) as failed:
        cmake_route.build_cmake(folder, say=lambda _: None)
    assert str(failed.value).endswith(
        f"cannot find -lc10_cuda\nopforge build: configuring {folder / 'CMakeLists.txt'} failed (cmake's output above); its options: "
        f"ENABLE_CUDA (default ON: build the CUDA kernels); set one with `opforge build {folder} -D NAME=VALUE`"
    ), str(failed.value)


def test_the_dry_run_plan_shows_the_definitions(tmp_path, opforge_here):
    folder = write(tmp_path / "proj", _CUDA_OPTION_PROJECT)
    code, out, err = opforge_here("build", str(folder), "-D", "ENABLE_CUDA=OFF", "--dry-run")
    assert code == 0, out + err
    assert f"    cmake -S {folder} -B <cache>/cmake-proj-<hash> -DENABLE_CUDA=OFF, then cmake --build;" in out, out


@pytest.mark.slow
def test_a_cmake_project_that_finds_torch_builds_by_cmake_and_its_operator_loads(tmp_path, monkeypatch):
    folder = write(tmp_path / "cmtorch", _TORCH_PROJECT)
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    res = opforge_process("build", str(folder), autoload=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "  route: cmake (CMakeLists.txt finds Torch (find_package(Torch))" in res.stdout, res.stdout
    so = re.search(r"cmtorch: (\S+libcmtorch\.so) \(cmake; loaded into torch\.ops\)", res.stdout)
    assert so, res.stdout
    # The programs were built as CMake builds them: executables of their own, beside the library.
    build = Path(so[1]).parent
    assert (build / "examples" / "demo_a").is_file() and (build / "tests" / "test_twice").is_file()
    code = f"import torch; torch.ops.load_library({so[1]!r}); print(torch.ops.cmtorch.twice(torch.arange(3.0)).tolist())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[0.0, 2.0, 4.0]", proc.stdout + proc.stderr


@pytest.mark.slow
def test_D_turns_off_a_default_this_machine_cannot_build(tmp_path, monkeypatch):
    folder = write(tmp_path / "cudaopt", _CUDA_OPTION_PROJECT)
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    if torch.version.cuda is None:  # its default links c10_cuda, which a torch without CUDA lacks
        res = opforge_process("build", str(folder), autoload=False)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "c10_cuda" in res.stderr and "its options: ENABLE_CUDA (default ON: build the CUDA kernels)" in res.stderr, res.stderr
    res = opforge_process("build", str(folder), "-D", "ENABLE_CUDA=OFF", autoload=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "opforge build: cmake -S ... -D ENABLE_CUDA=OFF" in res.stderr, res.stderr
    so = re.search(r"cudaopt: (\S+libcudaopt\.so) \(cmake; loaded into torch\.ops\)", res.stdout)
    assert so and ctypes.CDLL(so[1]).cudaopt_with_cuda() == 0, res.stdout
    # Another set of definitions is another build folder: the failed default's stays apart.
    assert Path(so[1]).parent == cmake_route.build_dir(folder.resolve(), ["ENABLE_CUDA=OFF"])
