"""Build speed, measured: what a user waits for.

Each case runs in a fresh subprocess with a fresh cache (OPFORGE_CACHE_DIR in a
temporary directory), so nothing is shared but the compiler's page cache:

* cold build of the whole op library (``import opforge`` on an empty cache);
* cold build of one small op (square) through opforge's JIT route, minimal headers;
* the same op's source through ``torch.utils.cpp_extension.load_inline`` with
  ``torch/extension.h`` and pybind11, the way seed 002 builds it;
* warm ``import opforge`` (library cached), opforge's part of the import only;
* rebuild after one op's source changed (the other ops' objects reused);
* with CUDA: one small op with its CUDA kernel;
* ``pip wheel --no-build-isolation`` of the project: the setuptools route.

Run: ``python benchmarks/build_speed.py [--json FILE]`` (CPU or GPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

SQUARE_INLINE = r"""
#include <torch/extension.h>
torch::Tensor square(const torch::Tensor& x) {
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "square", [&] {
    const scalar_t* v = xc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, xc.numel(), 32768, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) o[i] = v[i] * v[i]; });
  });
  return out;
}
"""


def _py(code: str, env: dict[str, str]) -> float:
    """Seconds the code takes in a fresh interpreter (the code prints them)."""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"build_speed: a case failed:\n{res.stderr[-3000:]}")
    return float(res.stdout.strip().splitlines()[-1])


def _cuda_build() -> bool:
    res = subprocess.run(
        [sys.executable, "-c", "from opforge.build import want_cuda; print(want_cuda())"],
        env={**os.environ, "PYTHONPATH": str(SRC), "OPFORGE_NO_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
    )
    return res.stdout.strip().endswith("True")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="opforge-build-speed-"))
    base = {**os.environ, "PYTHONPATH": str(SRC), "OPFORGE_CACHE_DIR": str(tmp / "cache")}
    rows: list[tuple[str, float, str]] = []
    timed_import = "import time, torch; t = time.perf_counter(); import opforge; print(time.perf_counter() - t)"

    rows.append(("cold build, whole op library (import opforge)", _py(timed_import, base), "opforge JIT"))
    rows.append(("warm import opforge (cached library)", _py(timed_import, base), "opforge JIT"))

    # One small op alone: the square folder with the shared headers.
    one = (
        "import time, torch\nfrom pathlib import Path\nfrom opforge.build import BuildConfig, csrc_dir, build_library\n"
        "t = time.perf_counter()\n"
        "src = (csrc_dir() / 'ops' / 'square' / 'square.cpp',)\n"
        "build_library(BuildConfig('speed_square', src, (csrc_dir(),), ('-O3', '-fopenmp')), quiet=True)\n"
        "print(time.perf_counter() - t)"
    )  # fmt: skip
    rows.append(("cold build, one small op (square), minimal headers", _py(one, {**base, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT"))
    if _cuda_build():
        one_cuda = (
            "import time, torch\nfrom opforge.build import BuildConfig, csrc_dir, build_library, cuda_archs\n"
            "from opforge.build import _gencode_flags\n"
            "t = time.perf_counter()\nd = csrc_dir()\n"
            "src = (d / 'ops' / 'square' / 'square.cpp', d / 'ops' / 'square' / 'square_kernel.cu', d / 'opforge' / 'cuda_stream.cpp')\n"
            "archs = cuda_archs()\n"
            "cfg = BuildConfig('speed_square_cuda', src, (d,), ('-O3', '-fopenmp', '-DOPFORGE_WITH_CUDA'),\n"
            "                  ('-O3', '-DOPFORGE_WITH_CUDA', *_gencode_flags(archs)), with_cuda=True, cuda_archs=archs)\n"
            "build_library(cfg, quiet=True)\n"
            "print(time.perf_counter() - t)"
        )  # fmt: skip
        rows.append(("cold build, one small op with its CUDA kernel", _py(one_cuda, {**base, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT"))

    inline = (
        "import time, torch\nfrom torch.utils.cpp_extension import load_inline\n"
        f"src = {SQUARE_INLINE!r}\n"
        "t = time.perf_counter()\n"
        f"load_inline('speed_inline_square', cpp_sources=src, functions=['square'],\n"
        f"            build_directory={str(tmp / 'inline')!r}, extra_cflags=['-O3'])\n"
        "print(time.perf_counter() - t)"
    )  # fmt: skip
    (tmp / "inline").mkdir()
    rows.append(("cold build, the same op, load_inline + torch/extension.h", _py(inline, base), "torch load_inline"))

    # Rebuild after one op changed: a copy of csrc with square.cpp edited.
    csrc = tmp / "csrc"
    shutil.copytree(REPO / "csrc", csrc)
    env_copy = {**base, "OPFORGE_CSRC": str(csrc)}
    rebuild = (
        "import time, torch\nfrom pathlib import Path\nfrom opforge.build import csrc_dir, library_config, build_library\n"
        "import dataclasses, os\n"
        "cfg = library_config()\n"
        "src = Path(os.environ['OPFORGE_CSRC'])\n"
        "moved = dataclasses.replace(cfg, sources=tuple(src / p.relative_to(csrc_dir()) for p in cfg.sources), include_dirs=(src,))\n"
        "build_library(moved, quiet=True)\n"
        "sq = src / 'ops' / 'square' / 'square.cpp'\n"
        "sq.write_text(sq.read_text() + '\\n// edited\\n')\n"
        "t = time.perf_counter()\n"
        "build_library(moved, quiet=True)\n"
        "print(time.perf_counter() - t)"
    )  # fmt: skip
    rows.append(("rebuild after one op's source changed", _py(rebuild, {**env_copy, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT"))

    # The ahead-of-time route: a wheel with the prebuilt library, from a copy of the project.
    project = tmp / "project"
    project.mkdir()
    outputs = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so", "_C.build.json")
    for part in ("pyproject.toml", "setup.py", "README.md", "src", "csrc"):
        if (REPO / part).is_dir():
            shutil.copytree(REPO / part, project / part, ignore=outputs)
        else:
            shutil.copy2(REPO / part, project / part)
    wheel = (
        "import subprocess, sys, time\nt = time.perf_counter()\n"
        f"subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-build-isolation', '--no-deps', '-w', {str(tmp / 'wheels')!r},"
        f" {str(project)!r}], check=True, stdout=subprocess.DEVNULL)\n"
        "print(time.perf_counter() - t)"
    )  # fmt: skip
    env_wheel = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    rows.append(("pip wheel --no-build-isolation (whole library, prebuilt)", _py(wheel, env_wheel), "setuptools"))

    import torch

    report = {
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_kernels_built": _cuda_build(),
        "jobs": os.environ.get("MAX_JOBS", "all cores"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": [{"case": c, "seconds": round(s, 3), "route": r} for c, s, r in rows],
    }
    width = max(len(c) for c, _, _ in rows)
    print(f"build speed: {os.cpu_count()} cores, torch {torch.__version__}, {report['date'][:10]}")
    for c, s, r in rows:
        print(f"  {c:<{width}}  {s:7.2f} s  ({r})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
