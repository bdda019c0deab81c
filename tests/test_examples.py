"""The runnable examples under examples/: each entry point runs in a
subprocess on the CPU (and, marked ``cuda``, on the GPU), exits 0 and prints
what it shows.

Each example builds C++ (about 20 s apiece on two cores): each device's runs
start together, and the run's shared build cache serves them all, with one
precompiled torch/extension.h for them and tests/test_inline.py's builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import SELECTED

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


# Each example builds its own C++: slow. Its runs start together (one fixture
# for the module): under pytest-xdist they stay in one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("examples")]


@pytest.fixture(scope="module")
def cache_dir(shared_cache: Path) -> Path:
    # The run's shared cache, with the op library of this run in it: the
    # examples build their own code, not opforge's library again, and add2's
    # precompiled torch/extension.h serves tests/test_inline.py's add2 too.
    return shared_cache


def start_example(name: str, cache_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["OPFORGE_CACHE_DIR"] = str(cache_dir)
    env["OPFORGE_PCH"] = "1"  # one torch/extension.h header for add2, load_inline and the inline tests (see pch_cache)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name / "run.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def finish(proc: subprocess.Popen[str], what: str, timeout: float) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} ran over {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    return stdout


def test_every_example_has_a_readme_naming_its_tutorial() -> None:
    tutorials = {"add2": "add2", "load_inline": "load_inline", "my_op_autograd": "autograd", "gemm": "GEMM", "qqq_gemm": "QQQ GEMM"}
    for name, tutorial in tutorials.items():
        first = (EXAMPLES / name / "README.md").read_text().splitlines()[0]
        assert f"Reproduces the {tutorial} tutorial" in first, first
        assert (EXAMPLES / name / "run.py").is_file()


def check_add2(out: str, device: str) -> None:
    assert f"device: {device}" in out
    for n in (0, 1, 1000, 1000003):
        assert f"torch_launch_add2(c, a, b, n) == a + b for n = {n}: ok" in out
    assert "a float64 input is refused: torch_launch_add2: a must be float32" in out
    assert "time.time(), no synchronize" in out
    assert "time.time() + synchronize (the add2 tutorial's show_time)" in out
    assert "opforge.bench.Timer (median ± IQR)" in out
    assert ("asynchronous" if device == "cuda" else "calls are synchronous") in out
    assert out.rstrip().endswith("add2: all checks passed")


def check_load_inline(out: str, device: str) -> None:
    assert f"device: {device}" in out
    assert "hello() -> 'Hello World!'" in out
    assert "[16., 25., 36.]" in out
    assert ("from the CUDA string" if device == "cuda" else "the C++ string carries a CPU implementation") in out
    for desc in ("37 x 53", "53 x 37, transposed view", "0 x 5"):
        assert f"square_matrix == m * m for {desc}: ok" in out
    assert "a 1-D tensor is refused" in out
    assert out.rstrip().endswith("load_inline: all checks passed")


def check_my_op(out: str, device: str) -> None:
    assert f"device: {device}" in out
    assert "check: MyOp()(x, y) == 3 * x - y: ok" in out
    assert "check: x.grad == 3 * grad: ok" in out
    assert "check: opcheck(my_op) with requires_grad" in out
    assert "check: torch.compile(fullgraph=True) backward == eager" in out
    assert "check: Sigmoid backward == torch.sigmoid's" in out
    assert "check: gradcheck(Sigmoid) passes in float64 with eps = 1e-6: ok" in out
    assert "check: gradcheck(Sigmoid) fails in float32 with eps = 1e-6 (the trap): ok" in out
    assert "FAILED" not in out
    assert out.rstrip().endswith("my_op_autograd: all checks passed")


def check_qqq_gemm(out: str, device: str) -> None:
    assert f"device: {device}" in out
    assert ("as a CUDAExtension" if device == "cuda" else "as a CppExtension") in out
    assert "ImportError: libc10.so" in out
    assert "importing the extension before torch fails with the tutorial's libc10.so error: ok" in out
    assert "with torch imported first, the extension imports: ok" in out
    assert out.count("== torch.ops.opforge.qqq_gemm, bit for bit") == 3
    assert "relative error of the W4A8 model" in out
    assert "FAILED" not in out
    assert out.rstrip().endswith("qqq_gemm: all checks passed")


def check_gemm(out: str, device: str) -> None:
    assert out.count(f"device: {device}") == 3  # one process per route
    routes = ("jit", "setuptools", "cmake") if shutil.which("cmake") else ("jit", "setuptools")
    if "cmake" not in routes:
        assert "  cmake       skipped (cmake is not on PATH)" in out
    for route in routes:
        assert f"route {route}: all checks passed" in out
        assert f"  {route:<11} ok" in out
    # Every case of every route, through both doors.
    for what in ("640x640 @ 640x640 float32, contiguous", "59x1025 @ 1025x97 float32, transposed a", "5x0 @ 0x6 float32, contiguous"):
        assert out.count(f"check: module.gemm(a, b) == torch.matmul(a, b) for {what}: ok") == len(routes)
        assert out.count(f"check: torch.ops.opforge.gemm(a, b) gives the same bits for {what}: ok") == len(routes)
    if device == "cuda":
        what = "2048x2048 @ 2048x2048 float32, contiguous"
        assert out.count(f"check: module.gemm(a, b) == torch.matmul(a, b) for {what}: ok") == len(routes)
    assert out.count("a pybind11 function is invisible to autograd: ok") == len(routes)
    assert out.count("check: torch.ops.opforge.gemm backward == torch.matmul's") == len(routes)
    assert out.count("check: torch.compile(fullgraph=True) of torch.ops.opforge.gemm == eager: ok") == len(routes)
    assert "FAILED" not in out
    assert out.rstrip().endswith("gemm: all checks passed")


CHECKS = {
    "add2": check_add2,
    "load_inline": check_load_inline,
    "my_op_autograd": check_my_op,
    "gemm": check_gemm,
    "qqq_gemm": check_qqq_gemm,
}
# A short timing budget: the test checks that the example runs, not the numbers.
ARGS = {"add2": ("--budget", "0.2")}
# The CPU runs start together and share two cores: with gemm's three builds
# (JIT, setuptools, CMake, 15-25 s each alone) among them, the whole set took
# 330 s here, add2's run 230 s of it. gemm gets more, for its builds, and
# qqq_gemm, which builds with setuptools and torch/extension.h (the tutorial's
# route, no cache): about 70 s of CPU on two cores, minutes on a loaded machine.
CPU_TIMEOUT = 600
TIMEOUTS = {"gemm": 900, "qqq_gemm": 900}


def example_args(name: str, device: str) -> tuple[str, ...]:
    return ("--device", device, *ARGS.get(name, ()))


def start_selected(request, cache_dir: Path, test: str, device: str) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Start the runs of ``test``'s selected examples together: most of each run
    is one compiler process, so on a machine of several cores they overlap
    (the GPU machine's CUDA runs, one after another, took over 110 s for the
    first three alone)."""
    selected = {
        item.callspec.params["name"]
        for item in request.config.stash[SELECTED]
        if getattr(item, "originalname", None) == test and Path(item.path) == Path(__file__)
    }
    runs = {name: start_example(name, cache_dir, *example_args(name, device)) for name in CHECKS if name in selected}
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def cpu_runs(request, cache_dir: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    yield from start_selected(request, cache_dir, "test_example_cpu", "cpu")


@pytest.fixture(scope="module")
def cuda_runs(request, cache_dir: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    yield from start_selected(request, cache_dir, "test_example_cuda", "cuda")


@pytest.mark.parametrize("name", list(CHECKS))
def test_example_cpu(name: str, cpu_runs) -> None:
    out = finish(cpu_runs[name], f"{name} {' '.join(example_args(name, 'cpu'))}", timeout=TIMEOUTS.get(name, CPU_TIMEOUT))
    CHECKS[name](out, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CHECKS))
def test_example_cuda(name: str, cuda_runs) -> None:
    out = finish(cuda_runs[name], f"{name} {' '.join(example_args(name, 'cuda'))}", timeout=TIMEOUTS.get(name, CPU_TIMEOUT))
    CHECKS[name](out, "cuda")
