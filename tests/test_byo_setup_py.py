"""`opforge build PATH` on setup.py projects as their authors lay them out.

Small folders written here, each in a layout public extension projects use:
the package under a folder of its own (``package_dir`` in setup(), in
setup.cfg or in pyproject.toml's ``[tool.setuptools.package-dir]``), a library
named without Python's ABI tag (``BuildExtension.with_options(no_python_abi_suffix=True)``),
a ``CUDAExtension`` whose C++ source includes the CUDA runtime's header, and
a setup.py that fails by itself before it declares anything. Reading needs no
compiler; the builds (marked slow) compile one small source each on the CPU,
and are compared with where ``python setup.py build_ext --inplace`` puts the
library; the CUDA test calls the CUDA runtime from a C++ source.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge.builder.sources import DiscoveryError
from opforge.folders.package_init import extension_suffix

from .test_byo_build import run_build, write

# A Python module in plain C++: it compiles in a second, and its import proves the file is where Python looks.
_MODULE = """#include <Python.h>

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C() {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr) PyModule_AddIntConstant(m, "answer", 42);
  return m;
}
"""

_SETUP = """from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup({args}ext_modules=[CppExtension("pkg._C", ["csrc/module.cpp"])], cmdclass={{"build_ext": {build_ext}}})
"""

# Each layout: its files (besides csrc/module.cpp and the package's __init__.py, under the folder
# named), and where build_ext --inplace puts pkg._C ("{EXT}": this Python's EXT_SUFFIX).
LAYOUTS = {
    "package_dir in setup()": (
        "src",
        {"setup.py": _SETUP.format(args='name="pkg", package_dir={"": "src"}, packages=["pkg"], ', build_ext="BuildExtension")},
        "src/pkg/_C{EXT}",
    ),
    "package-dir in pyproject.toml": (
        "lib",
        {
            "setup.py": _SETUP.format(args="", build_ext="BuildExtension"),
            "pyproject.toml": '[project]\nname = "pkg"\nversion = "0.1"\n\n[tool.setuptools]\npackages = ["pkg"]\n\n'
            '[tool.setuptools.package-dir]\n"" = "lib"\n',
        },
        "lib/pkg/_C{EXT}",
    ),
    "package_dir in setup.cfg": (
        "python",
        {
            "setup.py": _SETUP.format(args="", build_ext="BuildExtension"),
            "setup.cfg": "[metadata]\nname = pkg\n\n[options]\npackages = pkg\npackage_dir =\n    =python\n",
        },
        "python/pkg/_C{EXT}",
    ),
    "no_python_abi_suffix": (
        "src",
        {
            "setup.py": _SETUP.format(
                args='name="pkg", package_dir={"pkg": "src/pkg"}, packages=["pkg"], ',
                build_ext="BuildExtension.with_options(no_python_abi_suffix=True)",
            )
        },
        "src/pkg/_C.so",
    ),
}


def layout(root: Path, name: str) -> tuple[Path, str]:
    """The project of layout ``name`` at ``root``, and where its library goes, relative to it."""
    package_root, files, target = LAYOUTS[name]
    write(root, {**files, "csrc/module.cpp": _MODULE, f"{package_root}/pkg/__init__.py": ""})
    return root, target.format(EXT=extension_suffix())


# --------------------------------------------------------------- where the library goes, read (no compiler)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_library_goes_where_build_ext_inplace_puts_it(tmp_path, name):
    from opforge.folders.setup_py import import_root, inplace_target, read

    root, target = layout(tmp_path / "p", name)
    found = read(root / "setup.py")
    [ext] = found.extensions
    assert inplace_target(ext, root, found.package_dir) == root / target
    assert import_root(ext, root, found.package_dir) == root / LAYOUTS[name][0]
    assert sorted(p.name for p in root.iterdir()) == sorted({"csrc", LAYOUTS[name][0], *LAYOUTS[name][1]}), "reading wrote nothing"


_OWN_BUILD_EXT = """from setuptools import setup
from setuptools.command.build_ext import build_ext
from torch.utils.cpp_extension import CppExtension


class NeedsItsToolchain(build_ext):
    def finalize_options(self):
        raise RuntimeError("run me through make")


setup(name="pkg", package_dir={"": "src"}, ext_modules=[CppExtension("pkg._C", ["csrc/module.cpp"])],
      cmdclass={"build_ext": NeedsItsToolchain})
"""


def test_where_setuptools_cannot_say_the_package_dir_is_followed(tmp_path):
    from opforge.folders.setup_py import inplace_target, read

    root = write(tmp_path / "p", {"setup.py": _OWN_BUILD_EXT, "csrc/module.cpp": _MODULE, "src/pkg/__init__.py": ""})
    found = read(root / "setup.py")
    [ext] = found.extensions
    assert ext.inplace is None and found.inplace_error == "RuntimeError: run me through make"
    assert inplace_target(ext, root, found.package_dir) == root / "src" / "pkg" / f"_C{extension_suffix()}"


@pytest.mark.slow  # a compile of a second
def test_where_setuptools_cannot_say_the_build_says_so(tmp_path, opforge_here, monkeypatch):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    root = write(tmp_path / "p", {"setup.py": _OWN_BUILD_EXT, "csrc/module.cpp": _MODULE, "src/pkg/__init__.py": ""})
    target = f"src/pkg/_C{extension_suffix()}"
    code, out, err = opforge_here("build", str(root))
    assert code == 0, out + err
    assert f"    goes to: {target} (from package_dir: setuptools could not say, RuntimeError: run me through make)" in out


# --------------------------------------------------------------- a setup.py that fails by itself (no compiler)

_GIT_SETUP = """import subprocess
from setuptools import setup
from torch.utils.cpp_extension import CppExtension


def version():
    sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"]).decode().strip()
    return f"0.1+{sha}"


setup(name="pkg", version=version(), ext_modules=[CppExtension("pkg._C", ["op.cpp"])])
"""

_IMPORT_SETUP = """from setuptools import setup
from torch.utils.cpp_extension import CppExtension
import opforge_no_such_helper_module

setup(name="pkg", ext_modules=[CppExtension("pkg._C", ["op.cpp"])])
"""


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_setup_py_running_git_outside_a_checkout_is_its_own_failure_in_one_line(tmp_path, monkeypatch, opforge_here):
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-checkout"))  # outside any checkout, wherever the test runs
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    root = write(tmp_path / "p", {"setup.py": _GIT_SETUP, "op.cpp": ""})
    code, _, err = opforge_here("build", str(root))
    [line] = [ln for ln in err.splitlines() if ln.startswith("opforge build: ")]
    assert code == 1 and line.startswith(f"opforge build: {root / 'setup.py'}:7: the project's setup.py fails by itself at ")
    assert '`sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"]).decode().strip()`' in line
    # The exception's own last line, then whose failure it is.
    assert "subprocess.CalledProcessError: Command '['git', 'rev-parse', '--short', 'HEAD']' returned non-zero exit status" in line
    assert "(not a build error: opforge only runs it, with setuptools.setup replaced, to read its extensions" in line
    assert "it runs git, which fails outside a git checkout" in line and "Traceback" not in err


def test_a_setup_py_importing_a_module_that_is_not_here_is_its_own_failure(tmp_path):
    from opforge.folders.setup_py import read

    root = write(tmp_path / "p", {"setup.py": _IMPORT_SETUP, "op.cpp": ""})
    with pytest.raises(DiscoveryError) as caught:
        read(root / "setup.py")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"{root / 'setup.py'}:3: the project's setup.py fails by itself at `import opforge_no_such_helper_module`: "
        "ModuleNotFoundError: No module named 'opforge_no_such_helper_module' (not a build error"
    )
    assert message.endswith("it imports a module this Python does not have: install it here and build again")


def test_a_setup_py_that_exits_says_what_it_printed(tmp_path):
    from opforge.folders.setup_py import read

    setup = "import sys\nprint('needs CUDA 12 or later', file=sys.stderr)\nsys.exit(3)\n"
    with pytest.raises(DiscoveryError, match=r"setup\.py:3: .* fails by itself at `sys\.exit\(3\)`: it exits with status 3 after "
                       r"printing: needs CUDA 12 or later \(not a build error"):  # fmt: skip
        read(write(tmp_path / "p", {"setup.py": setup}) / "setup.py")


# --------------------------------------------------------------- a CUDAExtension's C++ sources and the CUDA headers

_CUDA_SETUP = """from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(name="cq", packages=["cq"], cmdclass={{"build_ext": BuildExtension}},
      ext_modules=[CUDAExtension("cq._C", ["cq/version.cpp"]{macros})])
"""

# The CUDA runtime's header in a C++ source, as a cuBLAS or cuSOLVER wrapper or a version query has it.
_CUDA_VERSION_CPP = """#include <cuda_runtime.h>
#include <torch/library.h>

// The runtime's version: the one linked (calling it), or the headers' where only they are here.
int64_t runtime_version() {
#ifdef CQ_CALL_RUNTIME
  int version = 0;
  return cudaRuntimeGetVersion(&version) == cudaSuccess ? version : -1;
#else
  return CUDART_VERSION;
#endif
}

TORCH_LIBRARY(cq, m) { m.def("runtime_version() -> int", &runtime_version); }
"""


# After the build, in its process: the library (TORCH_LIBRARY only, no module init) loaded, its operator called.
LOAD_AND_CALL = (
    "import glob\ntorch.ops.load_library(glob.glob('{project}/cq/_C.*so')[0])\nprint('VERSION', torch.ops.cq.runtime_version())\n"
)


def cuda_project(root: Path, *, call_runtime: bool) -> Path:
    macros = ', define_macros=[("CQ_CALL_RUNTIME", None)]' if call_runtime else ""
    return write(root, {"setup.py": _CUDA_SETUP.format(macros=macros), "cq/__init__.py": "", "cq/version.cpp": _CUDA_VERSION_CPP})


def toolkit_include() -> Path:
    """The CUDA toolkit's include folder as a CUDAExtension's sources get it; skips without one."""
    from opforge.folders.setup_py import cuda_include_flags

    flags = cuda_include_flags()
    if not flags:
        pytest.skip("no CUDA toolkit here (no nvcc, CUDA_HOME or /usr/local/cuda)")
    assert flags[0] == "-isystem" and (Path(flags[1]) / "cuda_runtime.h").is_file(), flags
    return Path(flags[1])


def test_the_cpp_sources_of_a_cuda_extension_find_the_cuda_headers(tmp_path):
    from opforge.folders.setup_py import extension_config, read

    include = toolkit_include()
    [ext] = read(cuda_project(tmp_path / "cq", call_runtime=False) / "setup.py").extensions
    assert ext.kind == "CUDAExtension" and not ext.cuda
    # As torch's CUDAExtension declares it: CUDA's headers for every source, where CUDA is built or not.
    for with_cuda in (False, True):
        cfg = extension_config(ext, with_cuda=with_cuda)
        assert cfg.cflags[-2:] == ("-isystem", str(include)), cfg.cflags
        # Built as CUDA (torch links cudart and its CUDA libraries then) with no .cu source at all.
        assert cfg.with_cuda is with_cuda and cfg.sources == ext.cpp
    # A CppExtension of the same source is not given them.
    cpp = extension_config(dataclasses.replace(ext, kind="CppExtension"), with_cuda=True)
    assert "-isystem" not in cpp.cflags and not cpp.with_cuda


# --------------------------------------------------------------- builds


@pytest.mark.slow  # per layout, a compile of a second by setuptools and one by opforge
@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_builds_where_setuptools_puts_it_and_imports(tmp_path, name):
    theirs, target = layout(tmp_path / "theirs", name)
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=theirs, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    built = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.so") if "build" not in p.relative_to(theirs).parts)
    assert built == [target], "setuptools itself puts it elsewhere"

    ours, _ = layout(tmp_path / "ours", name)
    check = "import importlib\nassert importlib.import_module('pkg._C').answer == 42\nprint('IMPORT OK')\n"
    res = run_build(ours, tmp_path / "cache", f"sys.path.insert(0, {str(ours / LAYOUTS[name][0])!r})\n{check}")
    assert res.returncode == 0 and "IMPORT OK" in res.stdout, res.stdout + res.stderr
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.so")) == [target]
    assert f"    goes to: {target}\n" in res.stdout and f"pkg._C: {target} (built in " in res.stdout
    assert f"`import pkg._C` works (from {ours / LAYOUTS[name][0]}, no install step)" in res.stdout


@pytest.mark.slow  # a compile of torch/library.h on the CPU
def test_a_cuda_extensions_cpp_source_including_the_cuda_runtime_builds_where_cuda_is_not_built(tmp_path):
    include = toolkit_include()
    version = next(int(ln.split()[-1]) for ln in (include / "cuda_runtime_api.h").read_text().splitlines() if "define CUDART_VERSION" in ln)
    project = cuda_project(tmp_path / "cq", call_runtime=False)
    res = run_build(project, tmp_path / "cache", LOAD_AND_CALL.format(project=project))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"VERSION {version}\n" in res.stdout and "operators cq::runtime_version" in res.stdout


@pytest.mark.slow
@pytest.mark.cuda
def test_a_cuda_extensions_cpp_source_calls_the_cuda_runtime(tmp_path):
    project = cuda_project(tmp_path / "cq", call_runtime=True)
    res = run_build(project, tmp_path / "cache", LOAD_AND_CALL.format(project=project), cuda=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(built in " in res.stdout and "CUDA kernels: yes" in res.stdout
    version = int(res.stdout.split("VERSION ")[1].split()[0])
    # The runtime linked is torch's CUDA's major version (13000 for 13.0).
    assert version // 1000 == int(torch.version.cuda.split(".")[0]), res.stdout
