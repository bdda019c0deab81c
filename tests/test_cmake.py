"""The CMake route: CMakeLists.txt builds libopforge_ops.so from the same
csrc/ops folders as the JIT build, on the same stable ABI (the same
TORCH_TARGET_VERSION, libtorch_cpu its only torch library), its C++ test passes
under ctest, and the library gives torch.ops.opforge the same operators when
loaded by path.

One configure + build per module (~25 s on 2 cores, CPU only). The library is
loaded only in fresh interpreters: this process already holds the JIT-built
library (conftest imports opforge), and a second definition of the same
operator schemas would clash.
"""

from __future__ import annotations

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

from opforge.builder import LIBRARY_TARGET, library_config
from opforge.builder.prebuilt import explain_load_error
from opforge.builder.stable import parse_target, target_flag
from opforge.elf_symbols import read_dynamic_symbols

# One CMake build for the module: slow, and in one worker under pytest-xdist.
pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH: the CMake route cannot be built here"),
    pytest.mark.slow,
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


def test_library_is_on_the_stable_abi(library: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OPFORGE_NO_AUTOLOAD="1")
    proc = subprocess.run(
        [sys.executable, "-m", "opforge", "abi", str(library)], capture_output=True, text=True, check=False, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Its shim calls need no torch newer than the target it was compiled for.
    found = re.search(r"verdict: stable: loads in every torch >= (\d+)\.(\d+)", proc.stdout)
    assert found, proc.stdout
    assert (int(found[1]), int(found[2])) <= parse_target(LIBRARY_TARGET), proc.stdout


def test_ctest_passes(build_dir: Path) -> None:
    proc = _run(["ctest", "--test-dir", str(build_dir), "--output-on-failure"], timeout=300)
    assert "100% tests passed" in proc.stdout, proc.stdout
    assert "opforge_kernels" in proc.stdout


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
