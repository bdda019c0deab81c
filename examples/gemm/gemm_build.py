"""The one build every route makes: opforge's GEMM operator (csrc/ops/gemm:
gemm.cpp, and its CUDA kernels in a CUDA build) plus this folder's pybind11
binding, with the flags opforge's own build of that folder uses.

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


def gemm_config(name: str, *, with_cuda: bool) -> BuildConfig:
    """folder_config of csrc/ops/gemm (its .cpp and .cu files, opforge's
    headers, -O3 -fopenmp, the GPU targets), plus the binding, as a module."""
    cfg = folder_config(gemm_folder(), with_cuda=with_cuda)
    return dataclasses.replace(cfg, name=name, sources=(*cfg.sources, BINDING), python_module=True)


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
        print(";".join(folder_config(gemm_folder(), with_cuda=True).cuda_cflags))
    else:
        sys.exit("usage: python gemm_build.py csrc|cuda-flags")
