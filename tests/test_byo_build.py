"""`opforge build PATH` on the layouts people bring, with no --route.

The fixtures under tests/fixtures are written in the styles of the tutorials
users follow: the GEMM tutorial's nested layout (gemm_nested: include/,
kernels/, pytorch_wrapper/), a package in the official extension example's
layout whose __init__ imports _C, with its setup.py (muladd_project), a src/
layout whose setup.py alone says the module's name, a macro and the header
folder (setup_py_project), a pybind11 module with a header (add2_pybind), and
two subfolders each holding a kernel.cpp and a kernel.cu (twin_kernels). The discovery tests need no compiler and run in
milliseconds; each build test compiles one fixture on the CPU from an empty
cache (marked slow); the CUDA tests build the same fixtures with their .cu
files and run them on the GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge.builder.source_text import read_binding
from opforge.builder.sources import DiscoveryError, walk
from opforge.folders.describe import describe
from opforge.folders.discover import discover
from opforge.folders.package_init import extension_suffix, imports_c

from .conftest import SRC, write

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# What describe says of the CUDA sources on a machine that cannot build them, fixed for the tests.
NO_CUDA = "torch 2.13.0+cpu has no CUDA"


def copy_fixture(tmp_path: Path, name: str) -> Path:
    """A copy to build: the package route writes into the package, and a
    fixture's own folder must stay as committed."""
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


# --------------------------------------------------------------- discovery, no compiler


def test_walk_finds_sources_and_headers_in_any_subfolder_and_skips_outputs_tests_and_venvs(tmp_path):
    root = write(
        tmp_path / "proj",
        {
            "a.cpp": "",
            "deep/er/b.cc": "",
            "deep/c.cxx": "",
            "deep/er/k.cu": "",
            "deep/er/k.cuh": "",
            "include/lib/api.h": "",
            "kernels/gemm.hpp": "",
            "notes.txt": "",
            # Everything below is left out: a test's, a build's or a virtualenv's copy is not the library's code.
            "build/temp/a.cpp": "",
            "dist/x.cpp": "",
            "pkg.egg-info/x.cpp": "",
            "_skbuild/x.cpp": "",
            ".git/x.cpp": "",
            ".venv/lib/x.h": "",
            "env/pyvenv.cfg": "home = /usr/bin\n",
            "env/lib/site/x.cpp": "",
            "tests/test_x.cpp": "",
            "test/x.cu": "",
            "__pycache__/x.cpp": "",
        },
    )
    tree = walk(root)
    assert [tree.rel(s) for s in tree.sources] == ["a.cpp", "deep/c.cxx", "deep/er/b.cc", "deep/er/k.cu"]
    assert [tree.rel(s) for s in tree.cpp] == ["a.cpp", "deep/c.cxx", "deep/er/b.cc"]
    assert [tree.rel(s) for s in tree.cuda] == ["deep/er/k.cu"]
    # The root, include/ (where "lib/api.h" resolves), then every folder holding a header.
    assert [tree.rel(d) for d in tree.include_dirs] == [".", "include", "deep/er", "include/lib", "kernels"]
    assert sorted(tree.rel(s) for s in tree.skipped) == sorted(
        [".git", ".venv", "__pycache__", "_skbuild", "build", "dist", "env", "pkg.egg-info", "test", "tests"]
    )
    # The folder given is never skipped, whatever its name.
    assert [s.name for s in walk(root / "tests").sources] == ["test_x.cpp"]


def test_vendored_libraries_are_skipped_but_their_include_folders_stay_on_the_path(tmp_path):
    root = write(
        tmp_path / "proj",
        {
            "csrc/op.cpp": "#include <cutlass/cutlass.h>\n",
            # A cutlass-style checkout: its headers are used, its examples, tools and tests are not built.
            "third_party/cutlass/include/cutlass/cutlass.h": "",
            "third_party/cutlass/examples/00_basic/gemm.cu": "",
            "third_party/cutlass/tools/util/include/cutlass/util/host_tensor.h": "",
            "third_party/cutlass/test/unit/gemm.cu": "",
            "3rdparty/fmt/src/format.cc": "",
            "external/lib/include/lib.h": "",
            "external/lib/lib.cpp": "",
            "vendor/json.hpp": "",
            "extern/x.cpp": "",
        },
    )
    tree = walk(root)
    assert [tree.rel(s) for s in tree.sources] == ["csrc/op.cpp"]
    assert sorted(tree.rel(s) for s in tree.skipped) == ["3rdparty", "extern", "external", "third_party", "vendor"]
    assert [tree.rel(d) for d in tree.vendored_include] == [
        "external/lib/include",
        "third_party/cutlass/include",
        "third_party/cutlass/tools/util/include",
    ]
    assert [tree.rel(d) for d in tree.include_dirs][-3:] == [tree.rel(d) for d in tree.vendored_include]
    lines = describe(discover(root), route="jit", cuda_reason=None)
    skipped = next(line for line in lines if line.startswith("  skipped: "))
    assert skipped == (
        "  skipped: 3rdparty/ (vendored: its sources are not built), extern/ (vendored: its sources are not built), "
        "external/ (vendored: its sources are not built; on the include path: external/lib/include), "
        "third_party/ (vendored: its sources are not built; on the include path: third_party/cutlass/include, "
        "third_party/cutlass/tools/util/include), vendor/ (vendored: its sources are not built)"
    )
    # A folder with nothing but a vendored library says so.
    with pytest.raises(DiscoveryError, match=r"nothing to build: .*\(skipped: third_party/ \(vendored: its sources are not built\)\)"):
        discover(write(tmp_path / "only", {"third_party/x/x.cpp": ""}))


def test_the_binding_is_read_from_the_code_not_its_comments(tmp_path):
    root = write(
        tmp_path / "b",
        {
            "ops.cpp": "// TORCH_LIBRARY(commented, m) {}\n"
            'const char* s = "TORCH_LIBRARY(in_a_string, m)";\n'
            'TORCH_LIBRARY(ns_a, m) { m.def("f(Tensor x) -> Tensor"); }\n'
            "TORCH_LIBRARY_IMPL(ns_a, CPU, m) {}\n",
            "cuda/ops.cu": "TORCH_LIBRARY_IMPL( ns_a , CUDA, m) {}\nSTABLE_TORCH_LIBRARY_FRAGMENT(ns_b, m) {}\n",
            "bind.cpp": "/* PYBIND11_MODULE(nope, m) */\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m, py::mod_gil_not_used()) {}\n",
            "init.cpp": 'extern "C" PyObject* PyInit__C(void);\n',
        },
    )
    tree = walk(root)
    binding = read_binding(tree.sources)
    assert binding.namespaces == ("ns_a", "ns_b")
    assert binding.impls == {"ns_a": ("CPU", "CUDA")}
    assert [(p.name, p.var, p.line, p.file.name) for p in binding.pybind] == [("TORCH_EXTENSION_NAME", "m", 2, "bind.cpp")]
    assert binding.pyinit_c and binding.torch_library
    assert binding.summary(tree) == (
        "TORCH_LIBRARY ns_a (kernels: CPU, CUDA); TORCH_LIBRARY ns_b; "
        "pybind11 module, PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) at bind.cpp:2; PyInit__C"
    )


@pytest.mark.parametrize(
    "statement",
    [
        "from . import _C",
        "from . import ops, _C  # the library, then its Python side",
        "from ._C import fast_path",
        "import pkg._C",
        "from pkg import _C",
        "from pkg._C import *",
        "torch.ops.load_library(next(Path(__file__).parent.glob('_C*.so')))",
        "importlib.import_module('._C', __name__)",
    ],
)
def test_a_package_importing_its_compiled_C_is_recognised_however_it_imports_it(tmp_path, statement):
    init = write(tmp_path, {"pkg/__init__.py": f"import importlib\nimport torch\n{statement}\n"}) / "pkg" / "__init__.py"
    found = imports_c(init, "pkg")
    assert found is not None and found[1] == 3 and found[0] in statement


def test_a_package_that_imports_no_compiled_module_is_not_one(tmp_path):
    text = "from . import ops\nimport torch._C\n# from . import _C\nX = '_C'\n"
    assert imports_c(write(tmp_path, {"pkg/__init__.py": text}) / "pkg" / "__init__.py", "pkg") is None


_TORCH_LIBRARY = "TORCH_LIBRARY(ns, m) {}\n"
_PYBIND = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"
_NAMED_PYBIND = "PYBIND11_MODULE(mymod, m) {}\n"


@pytest.mark.parametrize(
    ("files", "route"),
    [
        ({"csrc/op.cpp": _TORCH_LIBRARY}, "jit"),
        ({"csrc/op.cpp": _PYBIND, "include/op.h": ""}, "pybind"),
        ({"op.cpp": _NAMED_PYBIND}, "pybind"),  # refused by that route's check, with its hint
        ({"op.cpp": _NAMED_PYBIND, "CMakeLists.txt": "pybind11_add_module(mymod op.cpp)\n"}, "cmake"),
        # A setup.py that makes a torch extension says how its author builds the code.
        ({"op.cpp": _TORCH_LIBRARY, "CMakeLists.txt": "", "setup.py": "CppExtension"}, "setup.py"),
        ({"op.cpp": "int f() { return 1; }\n", "setup.py": "from torch.utils.cpp_extension import CUDAExtension\n"}, "setup.py"),
        ({"op.cpp": _TORCH_LIBRARY, "setup.py": "from setuptools import setup\nsetup(name='x')\n"}, "jit"),
        ({"CMakeLists.txt": "add_library(x SHARED ../src/x.cpp)\n"}, "cmake"),
        ({"op.cpp": "int f() { return 1; }\n"}, "jit"),  # nothing recognised: built, and its load says what it registered
        ({"pkg/__init__.py": "from . import _C\n", "pkg/csrc/op.cpp": _TORCH_LIBRARY, "setup.py": "CppExtension"}, "setup.py"),
        ({"pkg/__init__.py": "from . import _C\n", "pkg/csrc/op.cpp": _TORCH_LIBRARY}, "package"),
        ({"src/pkg/__init__.py": "from . import _C\n", "csrc/op.cpp": _PYBIND}, "package"),
    ],
)
def test_the_route_is_picked_from_what_the_folder_holds(tmp_path, files, route):
    layout = discover(write(tmp_path / "proj", files))
    assert layout.route == route, layout.why


def test_a_path_that_cannot_be_built_is_a_clear_error(tmp_path):
    with pytest.raises(DiscoveryError, match=r"nowhere is not a folder: nothing is there"):
        discover(tmp_path / "nowhere")
    with pytest.raises(DiscoveryError, match=r"op\.cpp is not a folder: give the folder that holds the sources"):
        discover(write(tmp_path, {"op.cpp": ""}) / "op.cpp")
    empty = write(tmp_path / "empty", {"README.md": "", "tests/test_op.cpp": "", "build/op.cpp": ""})
    with pytest.raises(DiscoveryError, match=r"empty: nothing to build: no C\+\+ .* \(skipped: build/, tests/\), and no setup.py or CMake"):
        discover(empty)
    two = write(tmp_path / "two", {"a/__init__.py": "from . import _C\n", "b/__init__.py": "import b._C\n", "x.cpp": ""})
    with pytest.raises(DiscoveryError, match=r"2 packages import a compiled _C: a \(a/__init__.py:1: from \. import _C\), b "):
        discover(two)


_EXPECTED = {
    "gemm_nested": [
        "  sources: 3 (2 C++, 1 CUDA): kernels/gemm_kernel.cpp, kernels/gemm_kernel.cu, pytorch_wrapper/gemm_op.cpp",
        "  include: ., include",
        "  binding: TORCH_LIBRARY gemmt (kernels: CPU, CUDA)",
        "  route: jit (TORCH_LIBRARY operators: built into the cache, then loaded for torch.ops)",
        f"  left out: kernels/gemm_kernel.cu ({NO_CUDA})",
    ],
    "twin_kernels": [
        "  sources: 5 (3 C++, 2 CUDA): scale/kernel.cpp, scale/kernel.cu, shift/kernel.cpp, shift/kernel.cu, twin_ops.cpp",
        "  include: ., scale, shift",
        "  binding: TORCH_LIBRARY twin_kernels (kernels: CPU, CUDA)",
        "  route: jit (TORCH_LIBRARY operators: built into the cache, then loaded for torch.ops)",
        f"  left out: scale/kernel.cu, shift/kernel.cu ({NO_CUDA})",
    ],
    "add2_pybind": [
        "  sources: 3 (2 C++, 1 CUDA): kernel/add2_kernel.cpp, kernel/add2_kernel.cu, pytorch/add2_bind.cpp",
        "  include: ., include",
        "  binding: pybind11 module, PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) at pytorch/add2_bind.cpp:36",
        "  route: pybind (a pybind11 module: built into the cache and imported)",
        f"  left out: kernel/add2_kernel.cu ({NO_CUDA})",
    ],
    "muladd_project": [
        "  sources: 2 (1 C++, 1 CUDA): muladd_pkg/csrc/cuda/muladd.cu, muladd_pkg/csrc/muladd.cpp",
        "  include: .",
        "  binding: TORCH_LIBRARY muladd_pkg (kernels: CPU, CUDA); PyInit__C",
        "  route: setup.py (setup.py makes a CppExtension/CUDAExtension: each extension is read by running it (setup() "
        "replaced) and built in place, as build_ext --inplace)",
        "  also here: a package importing _C, muladd_pkg (--route package)",
        f"  CUDA: no ({NO_CUDA})",
        f"  left out: muladd_pkg/csrc/cuda/muladd.cu ({NO_CUDA})",
        "  skipped: test/",
    ],
}


@pytest.mark.parametrize("name", sorted(_EXPECTED))
def test_each_fixture_is_described_before_anything_compiles(name):
    layout = discover(FIXTURES / name)
    lines = describe(layout, route=layout.route, cuda_reason=NO_CUDA)
    assert lines[0] == f"opforge build: {FIXTURES / name}"
    for line in _EXPECTED[name]:
        assert line in lines, "\n".join(lines)
    # Where CUDA builds, it says so with the archs, and leaves nothing out.
    lines = describe(layout, route=layout.route, cuda_reason=None, cuda_archs=("9.0a",))
    assert "  CUDA: yes (sm 9.0a)" in lines and not any(line.startswith("  left out") for line in lines)


def test_the_cli_prints_the_discovery_and_keeps_refusing_a_module_name_written_out(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    bind = '#include <torch/extension.h>\nPYBIND11_MODULE(mymod, m) { m.def("one", [] { return 1; }); }\n'
    folder = write(tmp_path / "mymod", {"include/mymod.h": "", "src/bind.cpp": bind})
    assert main(["build", str(folder)]) == 1
    out, err = capsys.readouterr()
    assert f"opforge build: {folder}\n  sources: 1 (1 C++): src/bind.cpp\n  include: ., include\n" in out
    assert "  binding: pybind11 module, PYBIND11_MODULE(mymod, m) at src/bind.cpp:2\n  route: pybind (a pybind11 module)\n" in out
    assert "PYBIND11_MODULE(mymod, m) in bind.cpp: the module name must be TORCH_EXTENSION_NAME" in " ".join(err.split())
    assert not any((tmp_path / "cache").glob("mymod-*")), "refused before any compiler ran"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "empty"], "opforge build: empty: nothing to build: no C++ (.cpp, .cc, .cxx) or CUDA (.cu) source"),
        (["build", "flat", "--route", "package"], "--route package, but no package here imports a compiled _C"),
        (["build", "flat/op.cpp"], "opforge build: flat/op.cpp is not a folder: give the folder that holds the sources"),
    ],
)
def test_bad_paths_are_usage_errors(tmp_path, monkeypatch, capsys, args, message):
    from opforge.cli import main

    write(tmp_path, {"empty/README.md": "", "flat/op.cpp": _TORCH_LIBRARY})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_package_whose_C_declares_a_module_of_another_name_is_refused_before_compiling(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    project = write(
        tmp_path / "proj",
        {"pkg/__init__.py": "import torch\nfrom . import _C\n", "pkg/csrc/bind.cpp": "#include <torch/extension.h>\n" + _NAMED_PYBIND},
    )
    assert main(["build", str(project)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "pkg imports _C, but pkg/csrc/bind.cpp:2 declares PYBIND11_MODULE(mymod, m): Python would look for PyInit__C" in err
    assert "Write PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in err and not (project / "pkg" / f"_C{extension_suffix()}").exists()


# --------------------------------------------------------------- setup.py, read (run with setup() replaced, nothing compiled)


def test_a_setup_py_is_read_for_its_extensions_without_building_anything(tmp_path):
    from opforge.folders.setup_py import _python_optimisation, extension_config, import_root, inplace_target, read

    project = copy_fixture(tmp_path, "setup_py_project")
    found = read(project / "setup.py")
    [ext] = found.extensions
    assert (ext.name, ext.kind, found.package_dir) == ("tinyop._ext", "CppExtension", {"": "src"})
    assert ext.sources == (project / "csrc" / "tinyop.cpp", project / "csrc" / "kernel" / "axpy.cpp")
    assert ext.include_dirs == (project / "headers",) and ext.define_macros == (("TINYOP_FACTOR", "3"),) and ext.cxx_flags == ("-O2",)
    # What the author declared, not what torch's CppExtension adds (the engine adds torch's paths and libraries itself).
    assert ext.libraries == () and ext.library_dirs == ()
    assert sorted(p.name for p in project.iterdir()) == ["csrc", "headers", "pyproject.toml", "setup.py", "src", "test"]
    cfg = extension_config(ext, with_cuda=False)
    # Python's own optimisation flags first, as build_ext takes them, then the extension's.
    assert cfg.cflags[-2:] == ("-DTINYOP_FACTOR=3", "-O2")
    assert cfg.cflags[:-2] == tuple(_python_optimisation()) and any(f.startswith("-O") for f in cfg.cflags[:-2])
    assert (cfg.name, cfg.extension_name) == ("tinyop__ext", "_ext")
    assert inplace_target(ext, project, found.package_dir) == project / "src" / "tinyop" / f"_ext{extension_suffix()}"
    assert import_root(ext, project, found.package_dir) == project / "src"
    assert discover(project).route == "setup.py"


def test_package_dir_is_followed_as_setuptools_follows_it(tmp_path):
    from opforge.folders.setup_py import package_folder

    assert package_folder("a.b", tmp_path, {}) == tmp_path / "a" / "b"
    assert package_folder("a.b", tmp_path, {"": "src"}) == tmp_path / "src" / "a" / "b"
    assert package_folder("a.b", tmp_path, {"": "src", "a": "lib/alpha"}) == tmp_path / "lib" / "alpha" / "b"
    assert package_folder("", tmp_path, {"": "src"}) == tmp_path / "src"


_CUDA_SETUP = """
from setuptools import setup
from torch.utils.cpp_extension import CUDAExtension
setup(name="k", ext_modules=[CUDAExtension("k._C", ["k.cpp", "k.cu"], define_macros=[("WITH_CUDA", None)],
                                           extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]})])
"""


def test_a_cuda_extension_is_read_on_a_machine_without_cuda(tmp_path):
    from opforge.folders.setup_py import read

    root = write(tmp_path / "k", {"setup.py": _CUDA_SETUP, "k.cpp": "", "k.cu": ""})
    [ext] = read(root / "setup.py").extensions
    assert ext.kind == "CUDAExtension" and [s.name for s in ext.cuda] == ["k.cu"] and [s.name for s in ext.cpp] == ["k.cpp"]
    assert ext.define_macros == (("WITH_CUDA", None),) and ext.nvcc_flags == ("-O3", "--use_fast_math")
    assert ext.summary(root)[1:] == ["    macros: WITH_CUDA", "    cxx flags: -O3", "    nvcc flags: -O3 --use_fast_math"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (
            "raise RuntimeError('needs the network')\n",
            r"setup\.py:1: the project's setup\.py fails by itself at `raise RuntimeError\('needs the network'\)`: "
            r"RuntimeError: needs the network \(not a build error: opforge only runs it",
        ),
        ("import time\ntime.sleep(600)\n", r"setup\.py did not finish within 2 s \(opforge runs it with setuptools\.setup replaced"),
        ("print('no setup here')\n", r"setup\.py ran to its end without calling setuptools\.setup\(\): there is nothing to read"),
        ("from setuptools import setup\nsetup(name='x')\n", r"setup\.py calls setup\(\) with no ext_modules: it declares no extension"),
        (
            "from setuptools import setup, Extension\nsetup(name='x', ext_modules=[Extension('x._C', ['gone.cpp'])])\n",
            r"setup\.py: extension x\._C lists the source .*gone\.cpp, which is not there",
        ),
        (
            "from setuptools import setup, Extension\nsetup(name='x', ext_modules=[Extension('x._C', ['x.c'])])\n",
            r"extension x\._C lists x\.c: opforge builds C\+\+ \(\.cpp, \.cc, \.cxx\) and CUDA \(\.cu\) sources",
        ),
    ],
)
def test_a_setup_py_that_cannot_be_read_is_a_clear_error_naming_it(tmp_path, setup, message):
    from opforge.folders.setup_py import read

    root = write(tmp_path / "bad", {"setup.py": setup, "x.c": ""})
    with pytest.raises(DiscoveryError, match=message) as caught:
        read(root / "setup.py", timeout=2)
    assert str(caught.value).startswith(str(root / "setup.py"))


def test_a_setup_py_that_fails_is_reported_by_the_cli_with_the_other_ways_to_build(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    root = write(
        tmp_path / "p", {"setup.py": "# CppExtension\nimport sys\nsys.exit('setup.py: needs CUDA_HOME')\n", "op.cpp": _TORCH_LIBRARY}
    )
    assert main(["build", str(root)]) == 1
    out, err = capsys.readouterr()
    assert "  route: setup.py (setup.py makes a CppExtension/CUDAExtension" in out
    err = " ".join(err.split())
    assert f"opforge build: {root / 'setup.py'}:3: the project's setup.py fails by itself at `sys.exit(" in err
    assert "it exits with: setup.py: needs CUDA_HOME (not a build error" in err
    with pytest.raises(SystemExit) as stop:
        main(["build", str(write(tmp_path / "q", {"op.cpp": _TORCH_LIBRARY})), "--route", "setup.py"])
    assert stop.value.code == 2 and "--route setup.py, but there is no setup.py in" in capsys.readouterr().err


# --------------------------------------------------------------- builds (a compiler, an empty cache)


def run_build(folder: Path, cache: Path, after: str = "", *, cuda: bool = False) -> subprocess.CompletedProcess:
    """`opforge build FOLDER` (the command's main, in a new process with an empty
    cache), then ``after`` in that process with ``rc`` the command's status."""
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(cache), "OPFORGE_NO_AUTOLOAD": "1"}
    env.pop("OPFORGE_BUILD_CUDA", None)
    if cuda or torch.version.cuda is not None:  # a CPU build on a CUDA machine: its .cu files left out, on purpose
        env["OPFORGE_BUILD_CUDA"] = "1" if cuda else "0"
    code = f"import sys, torch\nfrom opforge.cli import main\nrc = main(['build', {str(folder)!r}])\n{after}\nsys.exit(rc)\n"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    print(res.stdout, res.stderr)
    return res


def built_seconds(res: subprocess.CompletedProcess) -> float:
    """The compile's own time, as the engine's progress reports it."""
    return float(re.search(r"opforge: built \S+ in (\d+\.\d) s", res.stderr)[1])


def assert_cuda_said(res: subprocess.CompletedProcess, left_out: str, *, cuda: bool) -> None:
    """CUDA sources built, or named as left out with the reason, never dropped silently."""
    if cuda:
        assert "  CUDA: yes (sm " in res.stdout and "left out" not in res.stdout, res.stdout
    else:
        reason = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "OPFORGE_BUILD_CUDA=0"
        assert f"  left out: {left_out} ({reason})\n" in res.stdout, res.stdout


@pytest.mark.slow  # a compile of a second, and four processes that import torch
def test_a_package_whose_C_defines_no_module_init_gets_one_and_imports(tmp_path):
    """A _C of plain C++ with no PyInit__C (a TORCH_LIBRARY-only one is the
    same): the empty init opforge adds is what lets `from . import _C` load it.
    A package whose import fails after the build fails the build, with its error."""
    project = write(
        tmp_path / "proj",
        {"pkg/__init__.py": "import torch\nfrom . import _C\n", "pkg/csrc/answer.cpp": "int pkg_answer() { return 42; }\n"},
    )
    res = run_build(project, tmp_path / "cache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(no source defines PyInit__C: an empty one is added, so the import loads it)" in res.stdout
    assert "pkg: `import pkg` works (from " in res.stdout and "no operator registered in torch.ops" in res.stdout
    (project / "pkg" / "__init__.py").write_text("import torch\nfrom . import _C\nraise ImportError('pkg: a planted failure')\n")
    res = run_build(project, tmp_path / "cache")
    assert res.returncode == 1 and "(cached, already in place;" in res.stdout, res.stdout + res.stderr
    err = " ".join(res.stderr.split())
    assert f"but `import pkg` fails (in {project}): Traceback" in err and "ImportError: pkg: a planted failure" in err, err


GEMM_CHECK = """
for m, k, n in ((1, 1, 1), (59, 97, 33), (64, 16, 128)):
    for device in DEVICES:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        torch.testing.assert_close(torch.ops.gemmt.gemm(a, b), a @ b, rtol=1e-4, atol=1e-4)
try:
    torch.ops.gemmt.gemm(torch.randn(3, 4), torch.randn(5, 2))
    raise SystemExit('no error for mismatched shapes')
except RuntimeError as exc:
    assert "gemm: a is [3, 4] and b is [5, 2]" in str(exc), exc
print('OPS OK')
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_gemm_tutorials_nested_layout_builds_and_its_operator_works(tmp_path, device):
    folder = copy_fixture(tmp_path, "gemm_nested")
    cuda = device == "cuda"
    res = run_build(folder, tmp_path / "cache", f"DEVICES = {['cpu', device]!r}\n" + GEMM_CHECK, cuda=cuda)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "  include: ., include\n  binding: TORCH_LIBRARY gemmt (kernels: CPU, CUDA)\n  route: jit" in res.stdout
    assert "gemm_nested: operators gemmt::gemm" in res.stdout
    assert_cuda_said(res, "kernels/gemm_kernel.cu", cuda=cuda)
    print(f"gemm_nested ({device}): built in {built_seconds(res):.1f} s")


TWIN_CHECK = """
for device in DEVICES:
    x = torch.randn(1025, device=device)
    torch.testing.assert_close(torch.ops.twin_kernels.scale(x), 2 * x)
    torch.testing.assert_close(torch.ops.twin_kernels.shift(x), x + 1)
print('OPS OK')
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_two_kernels_of_one_file_name_in_two_folders_build_into_one_library(tmp_path, device):
    folder = copy_fixture(tmp_path, "twin_kernels")
    cuda = device == "cuda"
    res = run_build(folder, tmp_path / "cache", f"DEVICES = {['cpu', device]!r}\n" + TWIN_CHECK, cuda=cuda)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "twin_kernels: operators twin_kernels::scale, twin_kernels::shift" in res.stdout
    assert_cuda_said(res, "scale/kernel.cu, shift/kernel.cu", cuda=cuda)
    # One object per source, named by its folder: neither kernel.cpp overwrote the other's.
    objects = {p.name for p in (tmp_path / "cache").glob("twin_kernels-*.objects/*.o")}
    assert {"scale__kernel.o", "shift__kernel.o", "twin_ops.o"} <= objects
    if cuda:
        assert {"scale__kernel.cuda.o", "shift__kernel.cuda.o"} <= objects
    print(f"twin_kernels ({device}): built in {built_seconds(res):.1f} s")


ADD2_CHECK = """
from opforge.builder.inline import build_pybind_folder
module = build_pybind_folder(FOLDER)  # the module the build imported: found in the cache, not rebuilt
for device in DEVICES:
    a, b = torch.randn(4097, device=device), torch.randn(4097, device=device)
    torch.testing.assert_close(module.add2(a, b), a + b)
    torch.testing.assert_close(module.add2(a[::2], b[::2]), a[::2] + b[::2])
print('OPS OK')
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_pybind11_module_with_a_header_in_include_builds_and_imports(tmp_path, device, request):
    folder = copy_fixture(tmp_path, "add2_pybind")
    cuda = device == "cuda"
    check = f"FOLDER = {str(folder)!r}\nDEVICES = {['cpu', device]!r}\n" + ADD2_CHECK
    # On the CPU, the run's precompiled torch/extension.h (a CUDA build's flags need one of their own).
    cache = tmp_path / "cache" if cuda else request.getfixturevalue("pch_cache")
    res = run_build(folder, cache, check, cuda=cuda)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "  route: pybind (a pybind11 module: built into the cache and imported)" in res.stdout
    assert re.search(r"add2_pybind: module add2_pybind_\w+ from \S+\.so: add2\n", res.stdout), res.stdout
    assert_cuda_said(res, "kernel/add2_kernel.cu", cuda=cuda)
    assert res.stderr.count("opforge: building add2_pybind") == 1, "built once, then found in the cache"
    print(f"add2_pybind ({device}): built in {built_seconds(res):.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_package_importing_C_with_a_setup_py_is_built_in_place_and_its_own_tests_pass(tmp_path, device):
    project = copy_fixture(tmp_path, "muladd_project")
    cuda = device == "cuda"
    res = run_build(project, tmp_path / "cache", cuda=cuda)
    assert res.returncode == 0, res.stdout + res.stderr
    target = project / "muladd_pkg" / f"_C{extension_suffix()}"
    assert target.is_file()
    # Its setup.py says how: run with setup() replaced, and what it declares built by opforge's engine.
    assert (
        "  setup.py: 1 extension, read in " in res.stdout
        and f"  muladd_pkg._C ({'CUDAExtension' if cuda else 'CppExtension'}" in res.stdout
    )
    assert f"muladd_pkg._C: muladd_pkg/_C{extension_suffix()} (built in " in res.stdout
    assert f"CUDA kernels: {'yes' if cuda else 'no'})" in res.stdout
    assert "`import muladd_pkg._C` works (from " in res.stdout and "no install step): operators muladd_pkg::muladd" in res.stdout
    assert_cuda_said(res, "muladd_pkg/csrc/cuda/muladd.cu", cuda=cuda)
    seconds = built_seconds(res)
    # Its own tests, as its author runs them, with no pip step in between (CUDA ones skip without a GPU).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test", *(["-k", "cuda"] if cuda else [])]
    tests = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert re.search(r"\b(\d+) passed", tests.stdout) and " failed" not in tests.stdout, tests.stdout
    if cuda:
        assert "skipped" not in tests.stdout, tests.stdout
    # Again: found in the cache, the file in place already, nothing compiled.
    again = run_build(project, tmp_path / "cache", cuda=cuda)
    assert again.returncode == 0 and "(cached, already in place;" in again.stdout, again.stdout + again.stderr
    assert "opforge: building" not in again.stderr
    print(f"muladd_project ({device}): built in {seconds:.1f} s")


SETUP_PY = FIXTURES / "setup_py_project"


@pytest.mark.slow
def test_a_setup_py_project_builds_with_what_its_setup_py_declares_and_its_own_tests_pass(tmp_path):
    project = copy_fixture(tmp_path, "setup_py_project")
    res = run_build(project, tmp_path / "cache")
    assert res.returncode == 0, res.stdout + res.stderr
    target = f"src/tinyop/_ext{extension_suffix()}"
    # What was read is said before anything compiles.
    said = res.stdout[: res.stdout.index("tinyop._ext: ")]
    assert "  route: setup.py (setup.py makes a CppExtension/CUDAExtension" in said
    assert "  setup.py: 1 extension, read in " in said
    assert "  tinyop._ext (CppExtension): 2 sources: csrc/tinyop.cpp, csrc/kernel/axpy.cpp\n" in said
    assert "    include: headers\n    macros: TINYOP_FACTOR=3\n    cxx flags: -O2\n" in said
    assert f"    goes to: {target}\n" in said
    # The suite turns users' precompiled headers off (tests/conftest.py); the plan is what it would be otherwise.
    planned = "<Python.h> <ATen/core/Tensor.h> <ATen/ops/empty_like.h> <torch/library.h> for 1 of 2"
    pch = "off (OPFORGE_PCH=0)" if os.environ.get("OPFORGE_PCH") == "0" else planned
    assert f"    precompiled header: {pch}" in said
    assert f"tinyop._ext: {target} (built in " in res.stdout and (project / target).is_file()
    assert f"`import tinyop._ext` works (from {project / 'src'}, no install step): operators tinyop::axpy3" in res.stdout
    assert not (project / "build").exists() and not list(project.glob("*.egg-info")), "setup.py's setup() did not run"
    # Its own tests, as its author runs them (pytest's pythonpath = src), with no pip step in between.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test"]
    tests = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0 and "6 passed" in tests.stdout, tests.stdout + tests.stderr
    again = run_build(project, tmp_path / "cache")
    assert again.returncode == 0 and "(cached, already in place;" in again.stdout, again.stdout + again.stderr
    assert "opforge: building" not in again.stderr
    print(f"setup_py_project: built in {built_seconds(res):.1f} s")
