"""The QQQ GEMM tutorial's build: a pybind11 module from pybind.cpp and the CUDA kernel,
by setuptools with torch's CUDAExtension and BuildExtension.

    python setup.py develop        # the tutorial's command (or: pip install --no-build-isolation -e .)
    python -c "import torch, qqq_gemm_ext"

The CUDA source is opforge's own kernel (csrc/ops/qqq_gemm/qqq_gemm_kernel.cu,
pure CUDA, no torch headers). With a CPU-only torch (or OPFORGE_EXAMPLE_CPU=1)
the same module is built as a CppExtension without it: the CPU loop alone.
"""

import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"  # opforge's csrc: opforge/dtype.h and the kernel
KERNEL = CSRC / "ops" / "qqq_gemm"
# Relative to this file: setuptools refuses absolute source paths in some versions.
SOURCES = ["csrc/pybind.cpp", "csrc/qqq_gemm.cpp"]
# The tutorial's -O3, and -g0: setuptools starts from the flags Python was built with, usually -g,
# which makes pybind.cpp (torch/extension.h) 1.4x slower to compile and its object 50x larger.
CXX_FLAGS = ["-O3", "-g0"]
with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and os.environ.get("OPFORGE_EXAMPLE_CPU") != "1"

if with_cuda:
    # The tutorial's CUDAExtension; sm_80 and up (mma.sync s8), or TORCH_CUDA_ARCH_LIST.
    ext = cpp_extension.CUDAExtension(
        name="qqq_gemm_ext",
        sources=[*SOURCES, os.path.relpath(KERNEL / "qqq_gemm_kernel.cu", HERE)],
        include_dirs=[str(CSRC), str(KERNEL)],
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++17"]},
    )
else:
    ext = cpp_extension.CppExtension(name="qqq_gemm_ext", sources=SOURCES, include_dirs=[str(CSRC)], extra_compile_args=CXX_FLAGS)

setup(
    name="qqq_gemm_ext",
    version="0.1.0",
    ext_modules=[ext],
    # The tutorial's cmdclass: torch's build_ext (compiler flags, nvcc for .cu files).
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)},
)
