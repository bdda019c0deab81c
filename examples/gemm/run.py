"""The GEMM tutorial, runnable: one GEMM, opforge's (csrc/ops/gemm), built three ways
through opforge's routes (JIT, setuptools, CMake). Each build is one library
that is both a pybind11 module (``module.gemm(a, b)``, the tutorial's binding) and
an operator library (``torch.ops.opforge.gemm`` after
``torch.ops.load_library``), and each is checked against ``torch.matmul``.

    python examples/gemm/run.py                 # the GPU if torch sees one, else the CPU
    python examples/gemm/run.py --device cpu
    python examples/gemm/run.py --route cmake   # one route

Each route runs in a process of its own: every one of the three libraries
registers opforge::gemm, and a process holds one definition of an operator.
Builds are cached (OPFORGE_CACHE_DIR): a second run only loads them.
Exits 1 when a check fails.
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

# This example builds its own libraries; opforge's op library is not needed,
# so importing opforge does not build or load it.
os.environ.setdefault("OPFORGE_NO_AUTOLOAD", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gemm_build import gemm_config, setup_dir  # noqa: E402

from opforge.bench import Timer, input_sets, time_fn  # noqa: E402
from opforge.builder import cache_root, load_module  # noqa: E402
from opforge.check import measure_error  # noqa: E402
from opforge.ops.gemm import make_operands, tolerance  # noqa: E402
from opforge.opspec import Sample  # noqa: E402

ROUTES = ("jit", "setuptools", "cmake")
HOW = {
    "jit": "opforge.builder.load_module: torch's cpp_extension + ninja, opforge's content-hash cache (seed: torch.utils.cpp_extension.load)",
    "setuptools": "setup.py build_ext with opforge.builder.setuptools_ext.extension + BuildExtension (seed: CUDAExtension)",
    "cmake": "opforge build examples/gemm --route cmake: CMakeLists.txt, find_package(Torch), Python_add_library (seed: CMake + pybind11)",
}
SKIPPED = 3  # a child's exit status: the route cannot run here (no cmake)

failures: list[str] = []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--route", choices=[*ROUTES, "all"], default="all")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one route, in this process
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
    return args


def check(ok: bool, what: str) -> None:
    print(f"check: {what}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        failures.append(what)


def import_from(path: Path, name: str) -> types.ModuleType:
    """Imports the extension module in ``path``; ``name`` is its PYBIND11_MODULE name."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the three builds: each returns (module, library path, what happened) ---


def build_jit(with_cuda: bool) -> tuple[types.ModuleType, Path, str]:
    module, lib = load_module(gemm_config("gemm_jit", with_cuda=with_cuda))
    return module, lib.path, f"built in {lib.build_seconds:.1f} s" if lib.built_now else "from the cache"


def build_setuptools(with_cuda: bool) -> tuple[types.ModuleType, Path, str]:
    """setup.py build_ext into the cache, under the key of the build's
    sources and flags (as opforge's own setuptools builds are cached)."""
    cfg = gemm_config("gemm_setuptools", with_cuda=with_cuda)
    out = cache_root() / f"gemm_setuptools-{cfg.key()[:16]}"
    how = "from the cache"
    if not (out / "COMPLETE.json").is_file():
        # Built beside the entry, then renamed into place: a failed or killed
        # build never leaves an entry that looks complete.
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, str(HERE / "setup.py"), "-q", "build_ext", "--build-lib", str(tmp), "--build-temp", str(tmp / "temp")]
        env = dict(os.environ, OPFORGE_BUILD_CUDA="1" if with_cuda else "0")
        start = time.perf_counter()
        res = subprocess.run(cmd, cwd=setup_dir(), env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"setup.py build_ext failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        shutil.rmtree(tmp / "temp", ignore_errors=True)
        (tmp / "COMPLETE.json").write_text(json.dumps({"seconds": round(seconds, 2), "route": "setuptools"}) + "\n")
        try:
            tmp.rename(out)
        except OSError:  # another run finished first: use its entry
            shutil.rmtree(tmp, ignore_errors=True)
        how = f"built in {seconds:.1f} s"
    so = next(out.glob("gemm_setuptools.*.so"))
    return import_from(so, "gemm_setuptools"), so, how


def build_cmake(with_cuda: bool) -> tuple[types.ModuleType, Path, str] | None:
    """`opforge build examples/gemm --route cmake`: configures and builds
    CMakeLists.txt into the cache and loads what it made into torch.ops."""
    if shutil.which("cmake") is None:
        return None
    from opforge.cli import build_folder

    os.environ["OPFORGE_BUILD_CUDA"] = "1" if with_cuda else "0"  # CMakeLists.txt reads it
    before = set(torch.ops.loaded_libraries)
    start = time.perf_counter()
    if build_folder(HERE, "cmake") != 0:
        raise RuntimeError("opforge build examples/gemm --route cmake failed (its output is above)")
    so = next(Path(p) for p in set(torch.ops.loaded_libraries) - before if Path(p).name.startswith("gemm_cmake"))
    return import_from(so, "gemm_cmake"), so, f"configured and built (incrementally) in {time.perf_counter() - start:.1f} s"


# --- the checks ---

# (M, N, K, dtype, layout): the tutorial's 640^3, an odd 59 x 97 x 1025,
# half types through transposed views, a column, and K = 0.
CASES = [
    (640, 640, 640, torch.float32, "contiguous"),
    (59, 97, 1025, torch.float32, "transposed a"),
    (33, 65, 17, torch.bfloat16, "transposed a and b"),
    (7, 1, 13, torch.float16, "contiguous"),
    (20, 30, 40, torch.float64, "strided a and b"),
    (5, 6, 0, torch.float32, "contiguous"),
]
# On a GPU, a size whose tiles take more than 48 KB of shared memory: each library
# (opforge's own and the three built here) must opt its own kernels in.
CUDA_CASES = [(2048, 2048, 2048, torch.float32, "contiguous")]


def close_to_matmul(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within twice opforge's tolerance of torch.matmul's result: each of the
    two is within it of the exact product (checked too, in float64)."""
    atol, rtol = tolerance(got.dtype, a.shape[1])
    want = torch.matmul(a, b)
    exact = a.double() @ b.double()
    return measure_error(got, want, 2 * atol, 2 * rtol).n_bad == 0 and measure_error(got, exact, atol, rtol).n_bad == 0


def run_checks(module: types.ModuleType, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    op = torch.ops.opforge.gemm
    for M, N, K, dtype, layout in CASES + (CUDA_CASES if device.type == "cuda" else []):
        a, b = make_operands(M, N, K, dtype, device, gen, layout)
        py, registered = module.gemm(a, b), op(a, b)
        what = f"{M}x{K} @ {K}x{N} {str(dtype).removeprefix('torch.')}, {layout}"
        check(close_to_matmul(py, a, b), f"module.gemm(a, b) == torch.matmul(a, b) for {what}")
        check(torch.equal(py, registered), f"torch.ops.opforge.gemm(a, b) gives the same bits for {what}")

    # Bad input: an error naming the op, through either door.
    a, b = make_operands(4, 3, 5, torch.float32, device, gen)
    for name, fn in (("module.gemm", module.gemm), ("torch.ops.opforge.gemm", op)):
        try:
            fn(a, b.t())
            message = "no error"
        except RuntimeError as exc:
            message = str(exc).splitlines()[0]
        check(message.startswith("opforge::gemm: a [M, K] and b [K, N] must agree in K"), f"{name} refuses mismatched shapes ({message})")
    # A dtype error is a ValueError, the stable ABI's nearest to torch's TypeError.
    for name, fn in (("module.gemm", module.gemm), ("torch.ops.opforge.gemm", op)):
        try:
            fn(a.int(), b.int())
            message = "no error"
        except (ValueError, RuntimeError) as exc:
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        check(message.startswith("ValueError: opforge::gemm: a must be float32"), f"{name} refuses int32 ({message})")

    # Autograd: the pybind11 function is outside it (the tutorial's limit) ...
    a, b = (t.detach().requires_grad_() for t in make_operands(37, 29, 45, torch.float32, device, gen))
    check(module.gemm(a, b).grad_fn is None, "module.gemm's result has no grad_fn: a pybind11 function is invisible to autograd")
    # ... the operator gets it from opforge's spec (fake kernel, backward
    # through the same op), registered for whichever library defined it.
    from opforge.ops.gemm import SPECS
    from opforge.registry import register

    register(SPECS[0])
    out = op(a, b)
    grad = torch.randn(out.shape, device=device, generator=gen)
    out.backward(grad)
    a2, b2 = (t.detach().requires_grad_() for t in (a, b))
    torch.matmul(a2, b2).backward(grad)
    ok = torch.allclose(a.grad, a2.grad, rtol=1e-5, atol=1e-5) and torch.allclose(b.grad, b2.grad, rtol=1e-5, atol=1e-5)
    check(ok, "torch.ops.opforge.gemm backward == torch.matmul's (dA = dC B^T, dB = A^T dC)")
    compiled = torch.compile(lambda x, y: op(x, y).relu(), fullgraph=True)
    x, y = make_operands(48, 24, 40, torch.float32, device, gen)
    check(torch.equal(compiled(x, y), op(x, y).relu()), "torch.compile(fullgraph=True) of torch.ops.opforge.gemm == eager")

    # The tutorial's size timed against torch.matmul (opforge's timer: inputs from memory, median).
    a, b = make_operands(640, 640, 640, torch.float32, device, gen)
    timer = Timer(device)
    sets = input_sets(Sample((a, b), {}, "640^3"), timer.l2_bytes, gen)
    times = {}
    for name, fn in (("module.gemm", module.gemm), ("torch.matmul", torch.matmul)):
        times[name] = time_fn(fn, sets, timer, budget_s=0.3, graph=False).median_us
    rates = ", ".join(f"{n} {t:,.0f} us ({2 * 640**3 / t / 1e3:,.0f} GFLOP/s)" for n, t in times.items())
    print(f"time: 640^3 float32: {rates}")


def run_route(route: str, device: torch.device) -> int:
    with_cuda = device.type == "cuda"
    print(f"route {route}: {HOW[route]}", flush=True)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if with_cuda else 'CPU'}), torch {torch.__version__}", flush=True)
    built = {"jit": build_jit, "setuptools": build_setuptools, "cmake": build_cmake}[route](with_cuda)
    if built is None:
        print(f"route {route}: skipped, cmake is not on PATH")
        return SKIPPED
    module, so, how = built
    print(f"built {so.name} ({how})")
    # The tutorial's last step: the same file as an operator library. Already
    # mapped (the import loaded it), so its registrations ran once.
    import opforge

    opforge.load_library(so)
    print(f"module {module.__name__}: {', '.join(n for n in dir(module) if not n.startswith('_'))}; torch.ops.opforge: gemm")
    run_checks(module, device)
    if failures:
        print(f"route {route}: FAILED: {'; '.join(failures)}")
        return 1
    print(f"route {route}: all checks passed", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_route(args.route, torch.device(args.device))
    routes = ROUTES if args.route == "all" else (args.route,)
    # The routes build side by side, each in a fresh process (one nvcc compile
    # of the GEMM each, which a many-core machine runs at once); their output
    # is printed whole, route after route, as each one finishes in turn.
    if len(routes) > 1:
        print(f"building by {', '.join(routes)} side by side; each route's output follows in that order", flush=True)
    children = {
        route: subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", "--route", route, "--device", args.device],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for route in routes
    }
    status = {}
    for route, child in children.items():
        output, _ = child.communicate()
        print(f"\n== {route}\n{output}", end="", flush=True)
        status[route] = child.returncode
    print("\nsummary (each route a fresh process, each library both a pybind11 module and torch.ops.opforge.gemm):")
    for route, rc in status.items():
        verdict = {0: "ok", SKIPPED: "skipped (cmake is not on PATH)"}.get(rc, f"FAILED (exit {rc})")
        print(f"  {route:<11} {verdict}")
    if any(rc not in (0, SKIPPED) for rc in status.values()):
        print("\ngemm: FAILED")
        return 1
    print("\ngemm: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
