"""The one build every route makes: opforge's GEMM operator (csrc/ops/gemm:
gemm.cpp, and its CUDA kernels in a CUDA build) plus this folder's pybind11
binding, with the flags opforge's own build of that folder uses.

gemm.cpp is on PyTorch's stable ABI and the binding on ATen, so the module is
built as a library for this torch (torch's extension build, libtorch_python
linked), not as a stable one. Every source gets the same flags, so two stay
out: -fopenmp, which gemm.cpp does not need (its CPU kernel runs on torch's
thread pool through the shim), and -DTORCH_TARGET_VERSION, with which torch's
ATen and Python headers, the binding's, compile to nothing. gemm.cpp gets its
target from opforge/stable/common.h, which defines the library's.

``python gemm_build.py csrc|cuda-flags`` prints what CMakeLists.txt needs:
where the sources are, and the nvcc flags (targets included) for this machine.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("OPFORGE_NO_AUTOLOAD", "1")

from opforge.builder import BuildConfig, csrc_dir, folder_config

HERE = Path(__file__).resolve().parent
BINDING = HERE / "gemm_pybind.cpp"


def gemm_folder() -> Path:
    return csrc_dir() / "ops" / "gemm"


def shared_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` less those that do not fit both gemm.cpp and the binding (see above)."""
    return tuple(f for f in flags if f != "-fopenmp" and not f.startswith("-DTORCH_TARGET_VERSION"))


def gemm_config(name: str, *, with_cuda: bool) -> BuildConfig:
    """folder_config of csrc/ops/gemm (its .cpp and .cu files, opforge's
    headers, -O3, the GPU targets), plus the binding, as a module for this torch."""
    cfg = folder_config(gemm_folder(), with_cuda=with_cuda, stable="")
    # ATen's current-stream helper serves the ATen helpers' launchers; the
    # stable ones ask the shim for the stream.
    sources = tuple(s for s in cfg.sources if s.name != "cuda_stream.cpp")
    return dataclasses.replace(
        cfg,
        name=name,
        sources=(*sources, BINDING),
        cflags=shared_flags(cfg.cflags),
        ldflags=shared_flags(cfg.ldflags),
        python_module=True,
    )


def setup_dir() -> Path:
    """The folder that holds both csrc/ and this example: setuptools takes
    source paths relative to it (a ../ in one would put its object outside
    the build directory)."""
    return Path(os.path.commonpath([csrc_dir(), HERE]))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "csrc":
        print(csrc_dir())
    elif what == "cuda-flags":
        print(";".join(gemm_config("gemm_cmake", with_cuda=True).cuda_cflags))
    else:
        sys.exit("usage: python gemm_build.py csrc|cuda-flags")
