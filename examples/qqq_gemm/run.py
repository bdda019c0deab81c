"""The QQQ GEMM tutorial, runnable: qqq_gemm (int8 activations x int4 weights) as a pybind11
module built by ``setup.py`` with torch's ``CUDAExtension`` / ``BuildExtension``,
the ``libc10.so`` import error the tutorial reports (and why it happens), then the
same kernel as an opforge operator through ``opforge.nn.QQQLinear`` in a small
model.

    python examples/qqq_gemm/run.py                  # the GPU if torch sees one, else the CPU
    python examples/qqq_gemm/run.py --device cpu     # small sizes, the module's CPU loop

Exits 1 when a check fails.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import opforge
from opforge.bench import Timer, repeat_until_stable
from opforge.quant import quantize_act_int8, quantize_weight_w4

HERE = Path(__file__).resolve().parent
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"check: {what}: {'ok' if ok else 'FAILED'}")
    if not ok:
        failures.append(what)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--build-dir", type=Path, default=None, help="where setup.py builds (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
    return args


def build(build_dir: Path, device: str) -> Path:
    """``python setup.py build_ext``: the compile step of the tutorial's ``python
    setup.py develop`` (and of ``pip install -e .``), into ``build_dir`` so that
    neither the source tree nor the environment changes."""
    lib = build_dir / "lib"
    cmd = [sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp", str(build_dir / "tmp")]
    # The compilers opforge's own builds would use: a CXX that links libstdc++
    # statically (some GPU images' devtoolset g++) gives a module that crashes.
    from opforge.builder import toolchain

    tc = toolchain.resolve(with_cuda=device != "cpu")
    for note in tc.notes():
        print(note)
    env = {**os.environ, **(toolchain.overrides(tc) if tc.notes() else {})}
    if device == "cpu":
        env["OPFORGE_EXAMPLE_CPU"] = "1"  # the CPU loop alone: no nvcc needed
    print(f"$ (cd {HERE.relative_to(HERE.parents[1])} && {' '.join(cmd[1:4])} ...)   # the tutorial's: python setup.py develop")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"setup.py build_ext failed (exit {proc.returncode})")
    built = sorted(lib.glob("qqq_gemm_ext*.so"))
    kind = "CUDAExtension (kernel + CPU loop)" if device == "cuda" else "CppExtension (CPU loop)"
    print(f"built {built[0].name} as a {kind} in {time.perf_counter() - t0:.1f} s")
    return lib


def import_order_demo(lib: Path) -> None:
    """The tutorial's error: importing the extension before torch."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = str(lib)
    first = subprocess.run([sys.executable, "-c", "import qqq_gemm_ext"], env=env, capture_output=True, text=True)
    err = (first.stderr.strip().splitlines() or [""])[-1]
    print(f"$ python -c 'import qqq_gemm_ext'\n  {err}")
    check(first.returncode != 0 and "libc10.so" in err, "importing the extension before torch fails with the tutorial's libc10.so error")
    print(
        "  why: the module is linked against torch's shared libraries (libc10.so, libtorch.so, ...), which live in\n"
        "  torch/lib, a directory the dynamic loader does not search and the module's RPATH does not name. `import torch`\n"
        "  loads them into the process first; the loader then finds them already loaded by their SONAME."
    )
    second = subprocess.run(
        [sys.executable, "-c", "import torch, qqq_gemm_ext; print(qqq_gemm_ext.qqq_gemm.__doc__.splitlines()[0])"],
        env=env,
        capture_output=True,
        text=True,
    )
    print(f"$ python -c 'import torch, qqq_gemm_ext'\n  {second.stdout.strip() or second.stderr.strip()[-300:]}")
    check(second.returncode == 0, "with torch imported first, the extension imports")


def module_demo(lib: Path, device: torch.device) -> None:
    sys.path.insert(0, str(lib))
    import qqq_gemm_ext  # after torch, as the demo above explains

    gen = torch.Generator(device="cpu").manual_seed(0)
    for M, K, N, gs in ((1, 256, 64, -1), (7, 512, 96, 128), (33, 128, 160, 32)):
        x = torch.randn(M, K, generator=gen)
        w = torch.randn(K, N, generator=gen) / K**0.5
        a, s_tok = quantize_act_int8(x)
        qw = quantize_weight_w4(w, gs)
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (a, qw.w_packed, s_tok, qw.s_ch, qw.s_group, gs)]
        ours = qqq_gemm_ext.qqq_gemm(*args)
        op = torch.ops.opforge.qqq_gemm(*args, torch.float16)
        scheme = "per channel" if gs == -1 else f"group {gs}"
        check(torch.equal(ours, op), f"qqq_gemm_ext.qqq_gemm == torch.ops.opforge.qqq_gemm, bit for bit, M={M} K={K} N={N} {scheme}")
    try:
        qqq_gemm_ext.qqq_gemm(torch.zeros(2, 48, dtype=torch.int8, device=device), *args[1:])
        check(False, "K = 48 refused")
    except RuntimeError as exc:
        check("multiples of 32" in str(exc), f"K = 48 refused: {str(exc).splitlines()[0]}")


def model_demo(device: torch.device) -> None:
    """An MLP block (up-projection, GELU, down-projection), quantised layer by layer."""
    d, h, tokens = (4096, 11008, 16) if device.type == "cuda" else (256, 512, 8)
    torch.manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    mlp = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d)).to(device, dtype)
    for gs in (-1, 128):
        q = torch.nn.Sequential(opforge.nn.QQQLinear.from_linear(mlp[0], gs), torch.nn.GELU(), opforge.nn.QQQLinear.from_linear(mlp[2], gs))
        x = torch.randn(tokens, d, device=device, dtype=dtype)
        with torch.no_grad():
            y, yq = mlp(x).float(), q(x).float()
        rel = ((yq - y).norm() / y.norm()).item()
        scheme = "per channel" if gs == -1 else "group 128"
        print(f"MLP {d} -> {h} -> {d}, {tokens} tokens, {scheme}: relative error of the W4A8 model {rel:.3f}")
        check(rel < 0.2, f"QQQLinear MLP ({scheme}) within 20 % of the {dtype} model")
        if device.type == "cuda":
            t_fp16, t_q = _time(mlp, x, device), _time(q, x, device)
            print(f"  time per MLP call (L2 flushed, median): float16 {t_fp16:.1f} us, W4A8 {t_q:.1f} us ({t_fp16 / t_q:.2f}x)")


def _time(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """Median microseconds of model(x): CUDA events, L2 flushed before each call."""
    timer = Timer(device)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        timer.sync()
        return repeat_until_stable(timer.batch(lambda _i: model(x)), budget_s=0.5).median_us


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    tmp = None
    build_dir = args.build_dir
    if build_dir is None:
        tmp = tempfile.mkdtemp(prefix="qqq_gemm_ext-")
        build_dir = Path(tmp)
    try:
        lib = build(build_dir, args.device)
        import_order_demo(lib)
        module_demo(lib, device)
        model_demo(device)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"\nFAILED: {'; '.join(failures)}")
        return 1
    print("\nqqq_gemm: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
