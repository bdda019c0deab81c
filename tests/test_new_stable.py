"""``opforge new --stable-abi``: a package whose C++ is on PyTorch's stable ABI builds, passes
``opforge check``, benchmarks, and ``opforge abi`` finds its library stable from the
``--torch-min`` version on; its wheel's ``_C`` imports as a Python module. The generated C++
compiles with a plain compiler against torch's stable headers alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from opforge.abi.audit import torch_include
from opforge.builder import csrc_dir
from opforge.elf_symbols import read_dynamic_symbols
from opforge.project import ProjectError, scaffold

from .conftest import SRC, cache_with_library

NAME = "opf_stsign"
CXX = shutil.which("c++") or shutil.which("g++")
STABLE_HEADERS = ("torch/csrc/stable/", "torch/headeronly/")

pytestmark = pytest.mark.xdist_group("new_stable")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # This run's op library already in it: what the tests build is the package, not opforge again.
    cache = cache_with_library(tmp_path_factory.mktemp("cache"))
    # The tables at the width of a log, not at the COLUMNS of the test runner's environment.
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**base, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(cache), "OPFORGE_NO_AUTOLOAD": "1"}


def run(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def opforge_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run(env, "-m", "opforge", *args)


def library_path(env: dict[str, str], root: Path) -> Path:
    """The built library of a package, as its import loads it."""
    code = f"from opforge.project import load_project as load, project_library as lib; load({str(root)!r}); print(lib({str(root)!r}).path)"
    res = run(env, "-c", code)
    assert res.returncode == 0, res.stdout + res.stderr
    return Path(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def package(tmp_path_factory, env) -> tuple[Path, subprocess.CompletedProcess]:
    """One stable-ABI scaffold (CPU kernel, with backward) and its build, shared by the module."""
    root = scaffold(NAME, tmp_path_factory.mktemp("work") / NAME, cuda=False, backward=True, stable_abi=True)
    return root, opforge_cli(env, "build", str(root))


@pytest.mark.slow
def test_build_builds_and_loads_it(package):
    _, build = package
    assert build.returncode == 0, build.stdout + build.stderr
    assert f"{NAME}::{NAME}" in build.stdout and "CUDA kernels: no" in build.stdout


@pytest.mark.slow
def test_check_passes_every_check(package, env):
    root, _ = package
    res = opforge_cli(env, "check", str(root), "--device", "cpu", "--seed", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith("7 passed, 0 failed")  # reference, opcheck, gradcheck, gradgradcheck, compile, export, bad inputs


@pytest.mark.slow
def test_bench_times_it(package, env):
    root, _ = package
    res = opforge_cli(env, "bench", str(root), "--device", "cpu", "--dtype", "float32", "--budget", "0.02", "--seed", "3", "--no-compile")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"{NAME} ") >= 3 and "refused" not in res.stdout


@pytest.mark.slow
def test_abi_finds_the_built_library_stable(package, env):
    root, _ = package
    res = run(env, "-m", "opforge.abi", str(library_path(env, root)))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 from torch outside it" in res.stdout
    assert "verdict: stable: loads in every torch >= 2.10" in res.stdout


@pytest.mark.slow
def test_wheel_is_stable_and_its_library_imports_as_a_module(package, env, tmp_path):
    root, _ = package
    copy = tmp_path / "src_copy"  # pip builds in the tree: keep the shared package clean
    shutil.copytree(root, copy)
    wheels = tmp_path / "wheels"
    res = run(env, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(wheels), str(copy))
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = wheels.glob(f"{NAME}-*.whl")
    res = run(env, "-m", "opforge.abi", str(wheel))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{wheel.name}!{NAME}/_C." in res.stdout and "verdict: stable" in res.stdout
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Imported as a Python module (its init), the library registers its operator too.
    op = f"torch.ops.{NAME}.{NAME}"
    code = f"import torch, {NAME}._C as m; x = torch.randn(9); print(m.__name__, bool(torch.equal({op}(x), x / (1 + x.abs()))))"
    res = run({**env, "PYTHONPATH": os.pathsep.join([str(site), SRC])}, "-c", code, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == [f"{NAME}._C", "True"]


# --- the generated C++, compiled by hand ---


def compile_stable(root: Path, name: str, out: Path, *defines: str) -> subprocess.CompletedProcess:
    folder = root / "csrc" / name
    includes = [f"-I{torch_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{csrc_dir()}", f"-I{folder}"]
    cmd = [
        CXX,
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        *includes,
        *defines,
        str(folder / f"{name}.cpp"),
        str(folder / f"{name}_module.cpp"),
    ]
    return subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++) on PATH")
@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda-host"])
def test_generated_cpp_is_stable_from_torch_min(tmp_path, env, cuda):
    root = scaffold("opf_stable_op", tmp_path / "pkg", namespace="opf_stable_ns", cuda=cuda, stable_abi=True, torch_min="2.11")
    cpp = (root / "csrc" / "opf_stable_op" / "opf_stable_op.cpp").read_text()
    assert "#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 11) << 48))" in cpp
    assert "STABLE_TORCH_LIBRARY(opf_stable_ns, m)" in cpp and "STABLE_TORCH_LIBRARY_IMPL(opf_stable_ns, CPU, m)" in cpp
    assert ("STABLE_TORCH_LIBRARY_IMPL(opf_stable_ns, CUDA, m)" in cpp) == cuda
    for f in (root / "csrc").rglob("*.*"):
        for line in f.read_text().splitlines():
            if line.startswith("#include <"):  # torch's stable and header-only headers, Python's, the C++ library's
                header = line.split("<")[1].rstrip(">")
                assert header.startswith(STABLE_HEADERS) or header in ("Python.h", "cmath", "cstdint", "type_traits", "dlfcn.h"), (f, line)
    assert 'dependencies = ["torch>=2.11"' in (root / "pyproject.toml").read_text()
    # The CUDA build's host side: the stable device guard and stream, no CUDA header needed.
    so = tmp_path / "lib.so"
    res = compile_stable(root, "opf_stable_op", so, *(["-DOPFORGE_WITH_CUDA"] if cuda else []))
    assert res.returncode == 0, res.stderr
    res = run(env, "-m", "opforge.abi", str(so))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verdict: stable: loads in every torch >= 2.11" in res.stdout
    if cuda:
        assert "aoti_torch_create_device_guard" in read_dynamic_symbols(so, reader="elf").undefined


def test_torch_min_is_checked_before_anything_is_written(tmp_path):
    for value, message in [
        ("2.9", "--torch-min 2.9: the stable ABI is versioned from torch 2.10 on"),
        ("two", "--torch-min 'two' is not a torch version such as 2.10"),
        ("99.0", "--torch-min 99.0 is newer than this torch"),
    ]:
        with pytest.raises(ProjectError, match="^" + message.replace(".", r"\.")):
            scaffold("opf_stable_op", tmp_path / "pkg", stable_abi=True, torch_min=value)
        assert not (tmp_path / "pkg").exists()


# --- the same with the CUDA kernel, on a GPU ---

CUDA_NAME = "opf_stsign_cu"


@pytest.fixture(scope="module")
def cuda_package(tmp_path_factory, env) -> tuple[Path, subprocess.CompletedProcess]:
    root = scaffold(CUDA_NAME, tmp_path_factory.mktemp("work_cuda") / CUDA_NAME, cuda=True, backward=True, stable_abi=True)
    return root, opforge_cli(env, "build", str(root))


@pytest.mark.slow
@pytest.mark.cuda
def test_cuda_package_builds_checks_benches_and_is_stable(cuda_package, env):
    root, build = cuda_package
    assert build.returncode == 0, build.stdout + build.stderr
    assert "CUDA kernels: yes" in build.stdout
    res = opforge_cli(env, "check", str(root), "--device", "cuda", "--seed", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith("7 passed, 0 failed")
    args = ("bench", str(root), "--device", "cuda", "--dtype", "float32", "--budget", "0.05", "--seed", "3", "--no-compile")
    res = opforge_cli(env, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"{CUDA_NAME} ") >= 4 and "refused" not in res.stdout
    lib = library_path(env, root)
    res = run(env, "-m", "opforge.abi", str(lib))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verdict: stable: loads in every torch >= 2.10" in res.stdout
    # The CUDA runtime linked in statically, torch's CPU library alone dynamically: it loads without a GPU.
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "libtorch_cpu.so" in needed and "libcudart" not in needed and "libtorch_cuda" not in needed and "libc10" not in needed
    # On another GPU than the first, the device guard sends the kernel to the tensor's device.
    code = (
        f"import torch, sys; sys.path.insert(0, {str(root / 'src')!r}); import {CUDA_NAME} as p; "
        "n = torch.cuda.device_count(); d = f'cuda:{n - 1}'; x = torch.randn(1000, device=d); "
        f"print(bool(torch.allclose(p.{CUDA_NAME}(x), x / (1 + x.abs()))), p.{CUDA_NAME}(x).device == x.device)"
    )
    res = run(env, "-c", code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["True", "True"]
