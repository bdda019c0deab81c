"""The CUDA arch policy (opforge.builder.archs): one copy, read by the JIT
build, the prebuilt-library check and CMakeLists.txt alike."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import opforge.builder as ob
from opforge.builder import archs
from opforge.builder import prebuilt as pb

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "src" / "opforge" / "builder" / "archs.py"
LISTS = ["", "9.0", "8.0;9.0+PTX", "9.0a 8.6", "9.0;9.0a", "10.0;8.0;9.0", "8.6+PTX"]


def test_the_build_package_exports_the_policy() -> None:
    # One policy, whichever name a caller reaches it by.
    assert ob.cuda_archs is archs.cuda_archs
    assert ob.gencode_flags is archs.gencode_flags
    assert ob.cuda_home is archs.cuda_home
    assert pb._covered is archs.arch_covered
    for name in ob.__all__:
        assert hasattr(ob, name), name


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        ("  ", ()),
        ("9.0", ("9.0a",)),
        ("8.0;9.0+PTX", ("8.0", "9.0a")),
        ("9.0a 8.6", ("8.6", "9.0a")),
        ("10.0;8.0;9.0", ("8.0", "9.0a", "10.0")),
    ],
)
def test_parse_arch_list(value: str, expected: tuple[str, ...]) -> None:
    assert archs.parse_arch_list(value) == expected


@pytest.mark.parametrize("bad", ["sm_80", "Auto", "9", "8.0+ptx"])
def test_a_malformed_arch_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad)) + " is not a CUDA arch"):
        archs.parse_arch_list(f"8.0;{bad}")


def test_cuda_archs_from_the_gpus_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(archs, "_nvml_capabilities", lambda: {(9, 0), (8, 6)})
    assert archs.cuda_archs() == ("8.6", "9.0a")
    monkeypatch.setattr(archs, "_nvml_capabilities", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert archs.cuda_archs() == archs.DEFAULT_ARCHS
    # The environment wins over the GPUs.
    monkeypatch.setattr(archs, "_nvml_capabilities", lambda: {(8, 6)})
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert archs.cuda_archs() == ("9.0a",)


def test_a_build_covers_what_its_flags_hold() -> None:
    # The newest arch's PTX is portable: every newer GPU runs it, no older one.
    built = ("8.0", "9.0a")
    assert archs.gencode_flags(built)[-1] == "-gencode=arch=compute_90,code=compute_90"
    assert [c for c in ("7.5", "8.0", "8.6", "9.0", "10.0", "12.0") if archs.arch_covered(c, built)] == ["8.0", "9.0", "10.0", "12.0"]
    assert not archs.arch_covered("9.0", ())


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(SCRIPT), *args], capture_output=True, text=True, check=False, timeout=60)


@pytest.mark.parametrize("value", LISTS)
def test_the_script_prints_the_python_policy(value: str) -> None:
    res = _script(value)
    assert res.returncode == 0, res.stderr
    expected = archs.parse_arch_list(value) or archs.DEFAULT_ARCHS
    assert res.stdout.splitlines() == [";".join(expected), " ".join(archs.gencode_flags(expected))]


def test_the_script_refuses_a_malformed_list() -> None:
    res = _script("8.0;Ampere")
    assert res.returncode == 1
    assert "'Ampere' is not a CUDA arch" in res.stderr and res.stdout == ""


def test_the_script_imports_neither_torch_nor_opforge() -> None:
    # CMake runs it before torch is found; importing opforge would load its op library.
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['archs.py', '9.0']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'opforge')))\n"
    )
    res = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "[]"


@pytest.fixture(scope="module")
def cmake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cmake_archs")


def _configure(build: Path, *defines: str, env_list: str | None = None) -> list[str]:
    """The archs CMake's configure step reports (it builds nothing)."""
    env = dict(os.environ)
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    if env_list is not None:
        env["TORCH_CUDA_ARCH_LIST"] = env_list
    cmd = ["cmake", "-S", str(REPO), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}", "-DOPFORGE_BUILD_TESTS=OFF", *defines]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=300)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return re.findall(r"^-- opforge: CUDA archs (.*)$", res.stdout, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")
@pytest.mark.parametrize("value", LISTS)
def test_cmake_reads_the_python_arch_list(cmake_dir: Path, value: str) -> None:
    expected = ";".join(archs.parse_arch_list(value) or archs.DEFAULT_ARCHS)
    assert _configure(cmake_dir, f"-DTORCH_CUDA_ARCH_LIST={value}") == [expected]
    # From the environment when the cache variable is unset.
    assert _configure(cmake_dir, "-UTORCH_CUDA_ARCH_LIST", env_list=value) == [expected]
