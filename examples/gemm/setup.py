"""The setuptools route (the GEMM tutorial's setup.py with CUDAExtension): the GEMM's
sources and the pybind11 binding as the extension module ``gemm_setuptools``,
through opforge's setuptools pieces (opforge.builder.setuptools_ext: the same
BuildConfig as the JIT route, torch's BuildExtension with ninja). run.py runs

    python examples/gemm/setup.py build_ext --build-lib OUT --build-temp OUT/temp

from the folder that holds csrc/ and examples/, so that every source path is
relative to it; OPFORGE_BUILD_CUDA=1 builds the CUDA kernels too.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_build import gemm_config, setup_dir
from setuptools import setup

from opforge.builder import build_cuda_flag
from opforge.builder.setuptools_ext import BuildExtension, extension

cfg = gemm_config("gemm_setuptools", with_cuda=bool(build_cuda_flag()))
setup(
    name="gemm-setuptools",
    version="0.1",
    ext_modules=[extension(cfg, "gemm_setuptools", setup_dir())],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
