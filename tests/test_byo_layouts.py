"""`opforge build PATH` on the layouts of public extension projects.

Fixtures under tests/fixtures, each in the style of a kind of project users
bring: a package of two extensions whose __init__ imports both, one registered
with TORCH_LIBRARY and one with torch::RegisterOperators (two_ext_package); a
library registered with torch::RegisterOperators alone (register_operators); a
top-level pybind11 module that links torch's libc10 and so imports only after
torch (pybind_needs_torch); a tutorial folder that binds one CUDA kernel for
PyTorch and keeps its TensorFlow and JAX versions beside it (foreign_framework).
The discovery tests need no compiler; the build tests compile one fixture on
the CPU each (marked slow); the CUDA tests build with their .cu files.
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
from opforge.folders.package_init import extension_suffix

from .test_byo_build import FIXTURES, SRC, built_seconds, copy_fixture, run_build, write

NO_CUDA = "torch 2.13.0+cpu has no CUDA"


# --------------------------------------------------------------- discovery, no compiler


def test_operators_registered_with_torch_RegisterOperators_are_recognised(tmp_path):
    root = write(
        tmp_path / "old",
        {
            "a.cpp": 'static auto r = torch::RegisterOperators("one::f(Tensor x) -> Tensor", &f)\n'
            '    .op("one::g", &g)  // "two::commented(Tensor x) -> Tensor"\n'
            '    .op("one::f.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)", &f_out);\n'
            'const char* msg = "three::not_registered";\n',
            "b.cc": "static auto registry = c10::RegisterOperators().op(c10::RegisterOperators::options()\n"
            '    .schema("two::h(Tensor a, Tensor b) -> Tensor").kernel<H>(c10::DispatchKey::CPU));\n',
        },
    )
    binding = read_binding(walk(root).sources)
    assert binding.registered == {"one": ("f", "g"), "two": ("h",)}
    assert binding.torch_library and binding.operator_namespaces() == ["one", "two"]
    assert binding.summary(walk(root)) == "torch::RegisterOperators one (2 operators); torch::RegisterOperators two (1 operator)"
    layout = discover(root)
    assert layout.route == "jit" and layout.why.startswith("torch::RegisterOperators operators:")
    # The fixtures: a library of three, and a package whose second extension registers its operator so.
    assert "  binding: torch::RegisterOperators legacy (3 operators)" in describe(
        discover(FIXTURES / "register_operators"), route="jit", cuda_reason=None
    )
    package = read_binding(walk(FIXTURES / "two_ext_package").sources)
    assert package.operator_namespaces() == ["twoext"] and package.registered == {"twoext": ("shift",)}


def test_another_frameworks_code_is_left_out_and_said(tmp_path):
    layout = discover(FIXTURES / "foreign_framework")
    tree = layout.tree
    assert [tree.rel(s) for s in tree.sources] == ["kernel/add2_kernel.cu", "pytorch/add2_ops.cpp"]
    assert [tree.rel(d) for d in tree.include_dirs] == [".", "include"], "their folders' headers are not on the include path"
    lines = describe(layout, route=layout.route, cuda_reason=NO_CUDA)
    assert (
        "  left out, not PyTorch code: jax/ (JAX: a folder named for JAX; jax/add2_ffi.cpp includes <xla/ffi/api/ffi.h>), "
        "tensorflow/ (TensorFlow: a folder named for TensorFlow; tensorflow/add2_ops.cc includes <tensorflow/core/framework/op.h>)"
    ) in lines, "\n".join(lines)
    # Where CUDA builds, the TensorFlow folder's copy of the launcher stays out too (it would be defined twice).
    from opforge.builder import folder_config

    cfg = folder_config(FIXTURES / "foreign_framework", with_cuda=True)
    assert sorted(s.name for s in cfg.sources if s.is_relative_to(FIXTURES)) == ["add2_kernel.cu", "add2_ops.cpp"]

    # In a folder with PyTorch code, only the sources that show another framework: by an include of
    # theirs, through a header of the tree, or TensorFlow's name for a CUDA source.
    mixed = write(
        tmp_path / "mixed",
        {
            "ops/op.cpp": "#include <torch/library.h>\n",
            "ops/op_tf.cc": '#include "op_tf.h"\n',
            "ops/op_tf.h": "#include <tensorflow/core/framework/op.h>\n",
            "ops/op_kernel.cu.cc": "",
            "ops/kernel.cu": "",
            "tf/kernel.cu": "",  # a folder named tf, with nothing of TensorFlow's: kept (too short a name to tell)
            "tf_ops/zero.cc": "#include <tensorflow/core/framework/op_kernel.h>\n",
            "tf_ops/zero_kernel.cu": "",
            "paddle/custom.cc": '#include "paddle/extension.h"\n',
        },
    )
    tree = walk(mixed)
    assert [tree.rel(s) for s in tree.sources] == ["ops/kernel.cu", "ops/op.cpp", "tf/kernel.cu"]
    assert [(tree.rel(f.path), f.framework, f.evidence) for f in tree.foreign] == [
        ("ops/op_kernel.cu.cc", "TensorFlow", "TensorFlow's name for a CUDA source (.cu.cc)"),
        ("ops/op_tf.cc", "TensorFlow", "includes op_tf.h, which includes <tensorflow/core/framework/op.h>"),
        ("paddle", "PaddlePaddle", "a folder named for PaddlePaddle; paddle/custom.cc includes <paddle/extension.h>"),
        ("tf_ops", "TensorFlow", "a folder named for TensorFlow; tf_ops/zero.cc includes <tensorflow/core/framework/op_kernel.h>"),
    ]
    # A folder of nothing but another framework's code says so rather than "no source".
    with pytest.raises(DiscoveryError, match=r"nothing to build: .*\(left out, not PyTorch code: zero\.cc \(TensorFlow: includes <tensor"):
        discover(write(tmp_path / "only_tf", {"zero.cc": "#include <tensorflow/core/framework/op.h>\n"}))


def test_TORCH_EXTENSION_NAME_is_the_folders_own_name(monkeypatch):
    from opforge.builder import folder_config
    from opforge.builder.jit import module_name

    cfg = folder_config(FIXTURES / "foreign_framework")
    # torch's load(name=) and setuptools define it as the plain name: the namespace does not change with the build.
    assert cfg.extension_name == module_name(cfg) == "foreign_framework"
    monkeypatch.setenv("OPFORGE_CXXFLAGS", "-DOTHER=1")
    assert module_name(folder_config(FIXTURES / "foreign_framework")) == "foreign_framework"
    layout = discover(FIXTURES / "foreign_framework")
    lines = describe(layout, route="jit", cuda_reason=NO_CUDA)
    assert "  binding: TORCH_LIBRARY foreign_framework (TORCH_EXTENSION_NAME, the library's name; kernels: CPU, CUDA)" in lines


def test_OPFORGE_CXXFLAGS_reaches_every_build_of_a_users_folder(tmp_path, monkeypatch):
    from opforge.builder import folder_config
    from opforge.builder.inline import inline_config, pybind_folder_config
    from opforge.folders.package import package_config
    from opforge.folders.setup_py import extension_config, read

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OPFORGE_CXXFLAGS", "-DPROJECT_FLAG=3 -I /opt/project/include -fno-math-errno")
    wanted = ("-DPROJECT_FLAG=3", "-I", "/opt/project/include", "-fno-math-errno")
    # The project's own flags first, the variable's last: a -D of its own wins.
    assert folder_config(FIXTURES / "gemm_nested").cflags[-4:] == wanted
    # Its preprocessor flags reach nvcc as well, the others stay with the host compiler.
    assert folder_config(FIXTURES / "gemm_nested", with_cuda=True).cuda_cflags[-3:] == wanted[:3]
    [ext] = read(copy_fixture(tmp_path, "setup_py_project") / "setup.py").extensions
    assert extension_config(ext, with_cuda=False).cflags[-5:] == ("-O2", *wanted)
    assert pybind_folder_config(FIXTURES / "add2_pybind", with_cuda=False).cflags[-4:] == wanted
    assert inline_config("ops", cpp="int f() { return 1; }\n", implicit_headers=False).cflags[-4:] == wanted
    package = write(tmp_path / "proj", {"pkg/__init__.py": "from . import _C\n", "pkg/csrc/op.cpp": ""})
    assert package_config(discover(package), with_cuda=False).cflags[-4:] == wanted


def test_an_extension_on_the_limited_API_is_named_abi3_as_setuptools_names_it():
    from opforge.folders.setup_py import inplace_target, read

    found = read(FIXTURES / "two_ext_package" / "setup.py")
    scale, shift = found.extensions
    assert scale.py_limited_api and not shift.py_limited_api
    root = FIXTURES / "two_ext_package"
    assert inplace_target(scale, root, found.package_dir) == root / "twoext" / "_scale.abi3.so"
    assert inplace_target(shift, root, found.package_dir) == root / "twoext" / f"_shift{extension_suffix()}"
    assert "    py_limited_api: yes (Python's limited API: the file is named .abi3.so)" in scale.summary(root)


def test_the_route_taken_is_not_offered_again(tmp_path):
    layout = discover(write(tmp_path / "p", {"op.cpp": "TORCH_LIBRARY(ns, m) {}\n", "CMakeLists.txt": ""}))
    assert layout.route == "jit"
    assert "  also here: CMakeLists.txt (--route cmake)" in describe(layout, route="jit", cuda_reason=None)
    lines = describe(layout, route="cmake", cuda_reason=None)
    assert not any(line.startswith("  also here") for line in lines), lines


def test_the_progress_counter_counts_the_sources_compiled(tmp_path):
    from opforge.builder.progress import Progress

    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n0\t9\t0\told.o\tabc\n")  # an earlier build's step: not this build's
    progress = Progress(tmp_path, "ops", 2, 2, quiet=False)
    progress.start()
    try:
        assert "[0/2]" in progress.status(1.0)
        with log.open("a") as f:
            f.write("10\t20\t0\ta.o\tdef\n")
        assert progress.status(12.0) == "opforge: compiling ops [1/2]   12 s"
        with log.open("a") as f:
            f.write("10\t30\t0\tb.cuda.o\tdef\n40\t50\t0\tops.so\tghi\n")  # the link is not a source
        assert "[2/2]" in progress.status(20.0)
    finally:
        progress.stop(ok=True, seconds=1.0)


NINE = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ("75", "80", "86", "87", "89", "90a", "100", "103", "120")]


@pytest.mark.parametrize(
    ("here", "all_archs", "built", "said"),
    [
        # One GPU here, among the nine: its arch alone, and how to get them all.
        (("9.0a",), False, ("9.0a",), "building for this machine's GPU only, sm 9.0a (--all-archs or OPFORGE_ALL_ARCHS=1 builds all 9"),
        (("8.0", "9.0a"), False, ("8.0", "9.0a"), "building for this machine's GPUs only, sm 8.0, 9.0a"),
        (("9.0a",), True, None, "building all of them (--all-archs or OPFORGE_ALL_ARCHS=1)"),
        # A GPU here that none of them is: narrowing would build nothing it runs.
        (("12.1",), False, None, "building all of them (this machine's sm 12.1 is not among them)"),
        ((), False, None, ""),  # no GPU here (a build machine): as asked, nothing to say
    ],
)
def test_a_setup_py_asking_for_many_archs_builds_the_gpus_here_unless_told(monkeypatch, here, all_archs, built, said):
    from opforge.folders import setup_py
    from opforge.folders.setup_py import SetupExtension, cuda_targets

    monkeypatch.setattr(setup_py, "present_archs", lambda: here)  # where cuda_targets reads it
    # Nine archs, one of them as two tokens with its PTX, the others one token each.
    sm90 = ("-gencode", "arch=compute_90a,code=[sm_90a,compute_90a]")
    nvcc = ("-O3", *NINE[:5], *sm90, *NINE[6:], "--use_fast_math")
    ext = SetupExtension("k._C", "CUDAExtension", (Path("k.cu"),), nvcc_flags=nvcc)
    flags, got, note = cuda_targets(ext, all_archs=all_archs)
    assert got == (built or ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0a", "10.0", "10.3", "12.0"))
    assert said in note and (note == "") == (said == "")
    if built == ("9.0a",):
        assert flags == ("-O3", *sm90, "--use_fast_math")
    elif built:
        assert flags == ("-O3", NINE[1], *sm90, "--use_fast_math")
    else:
        assert flags == nvcc
    # The same through TORCH_CUDA_ARCH_LIST, set by the setup.py or before opforge runs.
    by_list = SetupExtension("k._C", "CUDAExtension", (Path("k.cu"),), arch_list="7.5;8.0;8.6;9.0;10.0+PTX")
    flags, got, note = cuda_targets(by_list, all_archs=all_archs)
    if here == ("9.0a",) and not all_archs:
        assert got == ("9.0a",) and flags == ("-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90")
        assert "by TORCH_CUDA_ARCH_LIST=7.5;8.0;8.6;9.0;10.0+PTX): building for this machine's GPU only" in note


def test_the_archs_a_setup_py_sets_for_itself_are_read(tmp_path):
    from opforge.folders.setup_py import read

    setup = (
        "import os\nos.environ['TORCH_CUDA_ARCH_LIST'] = '8.0;9.0'\n"
        "from setuptools import setup\nfrom torch.utils.cpp_extension import CUDAExtension\n"
        "setup(name='k', ext_modules=[CUDAExtension('k._C', ['k.cu'])])\n"
    )
    [ext] = read(write(tmp_path / "k", {"setup.py": setup, "k.cu": ""}) / "setup.py").extensions
    assert ext.arch_list == "8.0;9.0"


# --------------------------------------------------------------- builds (a compiler, an empty cache)


@pytest.mark.slow  # two extensions built at once, then the package's own tests
def test_a_package_of_two_extensions_builds_both_at_once_then_imports_once(tmp_path):
    project = copy_fixture(tmp_path, "two_ext_package")
    res = run_build(project, tmp_path / "cache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "  twoext._scale (CppExtension): 1 source: csrc/scale.cpp\n" in res.stdout
    assert "    goes to: twoext/_scale.abi3.so\n" in res.stdout and f"    goes to: twoext/_shift{extension_suffix()}\n" in res.stdout
    # Built at once, each said by name; both placed before anything imports.
    assert re.search(r"opforge: building 2 libraries, 2 at once \(\d+ compile jobs? each, MAX_JOBS=\d+ in all\)", res.stderr), res.stderr
    assert "opforge: building twoext__scale (1 source," in res.stderr and "opforge: building twoext__shift (1 source," in res.stderr
    placed = [res.stdout.index(f"twoext.{m}: twoext/{m}") for m in ("_scale", "_shift")]
    imported = res.stdout.index("`import twoext._scale, twoext._shift` works")
    assert max(placed) < imported, res.stdout
    assert "partially initialized" not in res.stdout + res.stderr
    # One import, and the operator registered with torch::RegisterOperators is found with the other.
    assert res.stdout.count("` works (from ") == 1
    assert "no install step): operators twoext::scale, twoext::shift\n" in res.stdout
    assert (project / "twoext" / "_scale.abi3.so").is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test"], cwd=project, env=env, capture_output=True, text=True
    )
    assert tests.returncode == 0 and "4 passed" in tests.stdout, tests.stdout + tests.stderr
    seconds = [float(s) for s in re.findall(r"opforge: built twoext__\w+ in (\d+\.\d) s", res.stderr)]
    print(f"two_ext_package: built in {max(seconds):.1f} s (each: {seconds})")


@pytest.mark.slow
def test_a_library_registered_with_torch_RegisterOperators_builds_and_lists_its_operators(tmp_path):
    folder = copy_fixture(tmp_path, "register_operators")
    check = (
        "x = torch.randn(1025)\n"
        "torch.testing.assert_close(torch.ops.legacy.twice(x), 2 * x)\n"
        "torch.testing.assert_close(torch.ops.legacy.plus_one(x), x + 1)\n"
        "assert torch.ops.legacy.version() == 3\n"
        "print('OPS OK')\n"
    )
    res = run_build(folder, tmp_path / "cache", check)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "  binding: torch::RegisterOperators legacy (3 operators)\n" in res.stdout
    assert "register_operators: operators legacy::plus_one, legacy::twice, legacy::version\n" in res.stdout
    print(f"register_operators: built in {built_seconds(res):.1f} s")


@pytest.mark.slow
def test_a_pybind11_module_that_needs_torch_first_imports_as_its_users_import_it(tmp_path):
    project = copy_fixture(tmp_path, "pybind_needs_torch")
    res = run_build(project, tmp_path / "cache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"devname: devname{extension_suffix()} (built in " in res.stdout
    assert f"devname: `import devname` works (from {project}, no install step): devname: canonical\n" in res.stdout
    use = "import torch, devname\nassert devname.canonical('cuda:1') == 'cuda:1' and devname.canonical('cpu') == 'cpu'\nprint('OK')\n"
    env = {**os.environ, "PYTHONPATH": str(project)}
    ran = subprocess.run([sys.executable, "-c", use], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and "OK" in ran.stdout, ran.stdout + ran.stderr
    print(f"pybind_needs_torch: built in {built_seconds(res):.1f} s")


FOREIGN_CHECK = """
for device in DEVICES:
    a, b = torch.randn(4097, device=device), torch.randn(4097, device=device)
    torch.testing.assert_close(torch.ops.foreign_framework.add2(a, b), a + b)
    torch.testing.assert_close(torch.ops.foreign_framework.add2(a[::2], b[::2]), a[::2] + b[::2])
print('OPS OK')
"""

GUARD = "TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m)"


@pytest.mark.slow
def test_a_tutorial_with_tensorflow_beside_pytorch_builds_without_it_and_a_missing_kernel_is_named(tmp_path):
    folder = copy_fixture(tmp_path, "foreign_framework")
    # The tutorial's binding calls the CUDA launcher whatever is built: on the CPU its .cu is left out.
    res = run_build(folder, tmp_path / "cache")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "  left out, not PyTorch code: jax/ (JAX: " in res.stdout and "tensorflow/ (TensorFlow: " in res.stdout
    err = " ".join(res.stderr.split())
    reason = "this torch is a CPU build (torch.version.cuda is None)" if torch.version.cuda is None else "OPFORGE_BUILD_CUDA=0"
    assert (
        "opforge: foreign_framework: the built library needs `launch_add2(float*, float const*, float const*, int)` "
        "(called in pytorch/add2_ops.cpp), but "
        f"kernel/add2_kernel.cu defines it, and it was left out because {reason}. Build it where CUDA is available, or compile "
        "the C++ that calls it only under #ifdef OPFORGE_WITH_CUDA"
    ) in err, err
    assert "Traceback" not in res.stderr and "tensorflow" not in res.stderr.lower()
    # The fix the message gives: the CUDA registration only where the .cu is built. The operator
    # is then in the namespace of the folder's name, which TORCH_EXTENSION_NAME is.
    source = folder / "pytorch" / "add2_ops.cpp"
    text = source.read_text()
    source.write_text(text.replace(GUARD, f"#ifdef OPFORGE_WITH_CUDA\n{GUARD}").rstrip("\n") + "\n#endif\n")
    res = run_build(folder, tmp_path / "cache", "DEVICES = ['cpu']\n" + FOREIGN_CHECK)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "foreign_framework: operators foreign_framework::add2\n" in res.stdout


@pytest.mark.slow
@pytest.mark.cuda
def test_the_tutorial_with_tensorflow_beside_pytorch_builds_its_cuda_kernel_once(tmp_path):
    folder = copy_fixture(tmp_path, "foreign_framework")
    res = run_build(folder, tmp_path / "cache", "DEVICES = ['cpu', 'cuda']\n" + FOREIGN_CHECK, cuda=True)
    assert res.returncode == 0 and "OPS OK" in res.stdout, res.stdout + res.stderr
    assert "  CUDA: yes (sm " in res.stdout and "tensorflow/ (TensorFlow: " in res.stdout
    objects = {p.name for p in (tmp_path / "cache").glob("foreign_framework-*.objects/*.o")}
    assert objects == {"add2_ops.o", "add2_kernel.cuda.o", "cuda_stream.o"}, objects


MANY_ARCHS_SETUP = """
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
archs = ["75", "80", "86", "89", "90"]
setup(name="many", ext_modules=[CUDAExtension("many._C", ["csrc/bind.cpp", "csrc/kernel.cu"],
      extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O2", *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)]})],
      cmdclass={"build_ext": BuildExtension})
"""
MANY_ARCHS_KERNEL = "__global__ void noop() {}\nvoid launch_noop() { noop<<<1, 1>>>(); }\n"
MANY_ARCHS_BIND = (
    "#include <Python.h>\n"
    'extern "C" PyObject* PyInit__C(void) { static PyModuleDef m = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr}; '
    "return PyModule_Create(&m); }\n"
)


@pytest.mark.slow
@pytest.mark.cuda
def test_a_setup_py_asking_for_five_archs_builds_the_gpu_here_and_all_when_asked(tmp_path, monkeypatch):
    from opforge.builder.archs import present_archs

    project = write(
        tmp_path / "many",
        {"setup.py": MANY_ARCHS_SETUP, "csrc/kernel.cu": MANY_ARCHS_KERNEL, "csrc/bind.cpp": MANY_ARCHS_BIND, "many/__init__.py": ""},
    )
    here = present_archs()
    res = run_build(project, tmp_path / "cache", cuda=True)
    assert res.returncode == 0, res.stdout + res.stderr
    library = project / "many" / f"_C{extension_suffix()}"
    cubins = subprocess.run(["cuobjdump", "--list-elf", str(library)], capture_output=True, text=True).stdout
    if {a.rstrip("a") for a in here} <= {"7.5", "8.0", "8.6", "8.9", "9.0"}:
        assert "building for this machine's GPU" in res.stdout and "--all-archs or OPFORGE_ALL_ARCHS=1 builds all 5" in res.stdout
        assert sorted(set(re.findall(r"sm_(\d+)", cubins))) == sorted({a.rstrip("a").replace(".", "") for a in here}), cubins
    monkeypatch.setenv("OPFORGE_ALL_ARCHS", "1")
    res = run_build(project, tmp_path / "cache", cuda=True)
    assert res.returncode == 0, res.stdout + res.stderr
    cubins = subprocess.run(["cuobjdump", "--list-elf", str(library)], capture_output=True, text=True).stdout
    assert sorted(set(re.findall(r"sm_(\d+)", cubins))) == ["75", "80", "86", "89", "90"], cubins


CMAKE_OP = """
#ifndef NEEDED_FLAG
#error "the project needs -DNEEDED_FLAG"
#endif
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor ident(const at::Tensor& x) { return x.clone(); }
TORCH_LIBRARY(cmake_flag, m) { m.def("ident(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(cmake_flag, CPU, m) { m.impl("ident", &ident); }
"""
CMAKE_LISTS = """cmake_minimum_required(VERSION 3.18)
project(cmake_flag LANGUAGES CXX)
find_package(Torch REQUIRED)
add_library(cmake_flag SHARED op.cpp)
target_link_libraries(cmake_flag PRIVATE torch)
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_OPFORGE_CXXFLAGS_reaches_the_cmake_route_and_leaves_it_when_unset(tmp_path):
    folder = write(tmp_path / "cmake_flag", {"CMakeLists.txt": CMAKE_LISTS, "op.cpp": CMAKE_OP})
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_NO_AUTOLOAD": "1"}

    def build(**extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "opforge", "build", str(folder), "--route", "cmake"]
        return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=900)

    res = build(OPFORGE_CXXFLAGS="-DNEEDED_FLAG=1")
    assert res.returncode == 0, res.stdout + res.stderr
    # Its CMakeLists.txt finds Torch: the route it would take anyway, --route or not.
    assert "  route: cmake (CMakeLists.txt finds Torch (find_package(Torch))" in res.stdout and "also here" not in res.stdout
    assert "cmake_flag: " in res.stdout and "(cmake; loaded into torch.ops)" in res.stdout
    # Unset, the flag is gone from the build folder too (CMake would keep what it first configured with).
    res = build()
    assert res.returncode == 1 and "the project needs -DNEEDED_FLAG" in res.stderr, res.stdout + res.stderr
