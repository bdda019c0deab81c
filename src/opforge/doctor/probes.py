"""``opforge doctor``'s probes of the environment a build runs in: the
interpreter, torch, nvcc, the C++ compiler, ninja and the GPUs. Each returns
its section of the report and appends what it finds wrong to ``problems``.

The toolchain's own facts (nvcc's version against torch's, how a compiler
links libstdc++, where ninja is) come from ``opforge.builder.toolchain``, which
the build reads too: the doctor says what the build will do.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opforge.builder import toolchain
from opforge.builder.archs import cuda_archs, cuda_home
from opforge.builder.config import build_cuda_flag, want_cuda
from opforge.builder.errors import BuildError
from opforge.builder.toolchain import STATIC_FIX, Problem, compare_cuda_versions, nvcc_version, version_tuple
from opforge.builder.toolchain import first_line as _first_line
from opforge.builder.toolchain import run as _run
from opforge.nvml import GpuInfo
from opforge.nvml import query as _nvml_gpus


@dataclass
class PythonInfo:
    version: str = ""
    implementation: str = ""
    executable: str = ""
    platform: str = ""
    virtualenv: bool = False


@dataclass
class TorchInfo:
    version: str = ""
    build: str = ""  # "CPU" or "CUDA"
    cuda: str | None = None
    cxx11_abi: bool | None = None
    path: str = ""


@dataclass
class NvccInfo:
    cuda_home: str | None = None
    path: str | None = None  # cuda_home()/bin/nvcc: the one builds use
    on_path: str | None = None  # shutil.which("nvcc"): the one a user runs by hand
    version: str | None = None
    matches_torch: bool | None = None  # None: nothing to compare (no nvcc or a CPU torch)


@dataclass
class CompilerInfo:
    cxx: str = ""  # $CXX or "c++", as torch resolves it
    path: str | None = None
    version: str | None = None
    libstdcxx: str = "unknown"  # "shared", "static", "libc++", "none", "skipped", "unknown" (opforge.builder.toolchain.Verdict)
    builds_with: str | None = None  # the compiler builds fall back to when this one links libstdc++ statically
    note: str = ""
    env: dict[str, str | None] = field(default_factory=dict)


@dataclass
class NinjaInfo:
    path: str | None = None
    version: str | None = None
    source: str | None = None  # "PATH" or "pip package"


@dataclass
class GpuSection:
    gpus: list[GpuInfo] = field(default_factory=list)
    source: str = "none"  # "NVML", "torch.cuda" or "none"
    driver_version: str | None = None
    driver_cuda: str | None = None  # newest CUDA the driver supports
    cuda_visible_devices: str | None = None
    archs: list[str] = field(default_factory=list)
    archs_source: str = ""
    build_cuda: bool | None = None
    build_cuda_env: str | None = None
    build_cuda_reason: str = ""


def probe_python(problems: list[Problem]) -> PythonInfo:
    """The interpreter: version, executable, platform, virtualenv or not."""
    return PythonInfo(
        version=platform.python_version(),
        implementation=platform.python_implementation(),
        executable=sys.executable,
        platform=platform.platform(),
        virtualenv=sys.prefix != sys.base_prefix,
    )


def probe_torch(problems: list[Problem]) -> TorchInfo:
    """torch's version, CPU or CUDA build, C++11 ABI and location."""
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return TorchInfo(
        version=torch.__version__,
        build="CUDA" if torch.version.cuda else "CPU",
        cuda=torch.version.cuda,
        cxx11_abi=bool(abi) if abi is not None else None,
        path=str(Path(torch.__file__).parent),
    )


def probe_nvcc(problems: list[Problem], building_cuda: bool | None) -> NvccInfo:
    """The nvcc builds use (and the one on PATH), its CUDA against torch's."""
    home = cuda_home()
    info = NvccInfo(cuda_home=str(home) if home else None, on_path=shutil.which("nvcc"))
    nvcc = home / "bin" / "nvcc" if home else None
    if nvcc is not None and nvcc.exists():
        info.path = str(nvcc)
        info.version = nvcc_version(nvcc)
        if info.version is None:
            problems.append(
                Problem("warning", f"could not read the version of {nvcc} (`nvcc --version`)", "check the CUDA toolkit install")
            )
    if torch.version.cuda is None:
        return info
    if info.path is None:
        where = f"CUDA_HOME={os.environ['CUDA_HOME']}" if os.environ.get("CUDA_HOME") else "not on PATH, no CUDA_HOME"
        if building_cuda:
            problems.append(
                Problem(
                    "error",
                    f"CUDA kernels are asked for (OPFORGE_BUILD_CUDA=1) but nvcc was not found ({where})",
                    f"install the CUDA {torch.version.cuda} toolkit and set CUDA_HOME to it, or unset OPFORGE_BUILD_CUDA",
                )
            )
        else:
            problems.append(
                Problem(
                    "warning",
                    f"torch has CUDA {torch.version.cuda} but nvcc was not found ({where}): the op library is built without CUDA kernels",
                    f"install the CUDA {torch.version.cuda} toolkit and set CUDA_HOME to it",
                )
            )
        return info
    if info.version is not None:
        problem = compare_cuda_versions(info.version, torch.version.cuda, building_cuda=bool(building_cuda))
        info.matches_torch = problem is None
        if problem is not None:
            problems.append(problem)
    if info.on_path and Path(info.on_path).resolve() != Path(info.path).resolve():
        other = nvcc_version(info.on_path)
        if other and other != info.version:
            problems.append(
                Problem(
                    "warning",
                    f"the nvcc on PATH ({info.on_path}, {other}) is not the one builds use ({info.path}, {info.version})",
                    "make CUDA_HOME and PATH agree, so what you test by hand is what builds",
                )
            )
    return info


def probe_compiler(problems: list[Problem]) -> CompilerInfo:
    """The C++ compiler, and how it links libstdc++ into a shared library."""
    cxx = os.environ.get("CXX", "c++")
    info = CompilerInfo(cxx=cxx, env={v: os.environ.get(v) for v in ("CXX", "CC", "CUDAHOSTCXX")})
    info.path = shutil.which(cxx)
    if info.path is None:
        problems.append(
            Problem(
                "error",
                f"no C++ compiler: '{cxx}' is not found" + (" (from CXX)" if "CXX" in os.environ else " (CXX is not set)"),
                "install g++ (e.g. `apt-get install g++`) or set CXX to a C++ compiler: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
        info.libstdcxx, info.note = "skipped", "no compiler to probe"
        return info
    # Probed now, never from the cache: the doctor writes nothing, and a bug report wants what is true today.
    v = toolchain.verdict(cxx, cache=False)
    info.version, info.libstdcxx, info.note = v.version, v.libstdcxx, v.note
    if info.libstdcxx == "skipped":
        return info
    if info.libstdcxx == "unknown":
        problems.append(
            Problem(
                "error",
                f"the C++ compiler '{cxx}' could not build a tiny shared library (`{cxx} -shared -fPIC`): {info.note}",
                "fix or reinstall the compiler, or use another: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    elif info.libstdcxx == "static":
        who = f"'{cxx}'" + (f" ({info.path})" if info.path != cxx else "")
        try:
            info.builds_with = toolchain.choose(cxx, cache=False).use
        except BuildError:
            info.builds_with = None
        if info.builds_with is not None:
            problems.append(
                Problem(
                    "warning",
                    f"the C++ compiler {who} links libstdc++ statically into shared libraries, which breaks torch's "
                    f"exceptions; builds use {info.builds_with} instead, which links it dynamically",
                    STATIC_FIX,
                )
            )
        else:
            problems.append(
                Problem(
                    "error",
                    f"the C++ compiler {who} links libstdc++ statically into shared libraries; torch loads the shared "
                    "libstdc++, and two copies in one process crash on the op library's first error message "
                    f"(the build refuses it, and found no compiler to use instead among {', '.join(toolchain.fallbacks()) or 'none'})",
                    STATIC_FIX,
                )
            )
    elif info.libstdcxx == "none":
        problems.append(
            Problem(
                "warning",
                f"'{cxx}' does not link libstdc++ into a C++ shared library: is it a C compiler (gcc rather than g++)?",
                "export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    elif info.libstdcxx == "libc++":
        problems.append(
            Problem(
                "warning",
                f"the C++ compiler '{cxx}' links libc++ while torch uses libstdc++: the op library may fail to load or link",
                "use GCC or clang with libstdc++: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    return info


def probe_ninja(problems: list[Problem]) -> NinjaInfo:
    """The ninja torch builds extensions with, and its version."""
    info = NinjaInfo()
    found = toolchain.find_ninja()
    if found is not None:
        info.path, info.source = found
    if info.path is None:
        problems.append(Problem("error", "ninja is not installed (torch builds extensions with it)", "pip install ninja"))
        return info
    res = _run([info.path, "--version"])
    info.version = _first_line(res.stdout) if res and res.returncode == 0 else None
    return info


def probe_gpus(problems: list[Problem]) -> GpuSection:
    """The GPUs and driver, the target archs, and whether CUDA kernels are built."""
    sec = GpuSection(cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), build_cuda_env=os.environ.get("OPFORGE_BUILD_CUDA"))
    nvml = _nvml_gpus()
    if nvml is not None:
        sec.gpus, sec.driver_version, sec.driver_cuda = nvml
        sec.source = "NVML"
    elif torch.version.cuda is not None and torch.cuda.device_count() > 0:
        # Last resort: this initialises CUDA in the doctor's process, harmless for a one-shot command.
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            sec.gpus.append(GpuInfo(i, props.name, f"{props.major}.{props.minor}", round(props.total_memory / 2**30, 1)))
        sec.source = "torch.cuda"

    try:
        flag = build_cuda_flag()
    except BuildError:
        problems.append(
            Problem(
                "error",
                f"OPFORGE_BUILD_CUDA={sec.build_cuda_env!r} is neither on nor off",
                "set it to 1 or 0 (or true/false, yes/no, on/off), or unset it",
            )
        )
        flag = None
    else:
        try:
            # The op library is on the stable ABI: its CUDA kernels need nvcc, whatever torch's CUDA.
            sec.build_cuda = want_cuda(stable=True)
        except BuildError as exc:
            problems.append(
                Problem("error", str(exc).removeprefix("opforge: "), "unset OPFORGE_BUILD_CUDA, or install the CUDA toolkit (nvcc)")
            )
    if flag is not None:
        sec.build_cuda_reason = f"OPFORGE_BUILD_CUDA={(sec.build_cuda_env or '').strip()}"
    elif torch.version.cuda is None:
        sec.build_cuda_reason = "torch is a CPU build"
    else:
        sec.build_cuda_reason = "torch has CUDA and nvcc was found" if sec.build_cuda else "torch has CUDA but nvcc was not found"

    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split():
        sec.archs_source = "TORCH_CUDA_ARCH_LIST"
    elif sec.gpus:
        sec.archs_source = f"the GPUs found ({sec.source})"
    else:
        sec.archs_source = "default: no GPU found"
    sec.archs = list(cuda_archs())

    if sec.gpus and torch.version.cuda is None:
        problems.append(
            Problem(
                "warning",
                f"{len(sec.gpus)} GPU(s) found but torch {torch.__version__} is a CPU build: everything runs on the CPU",
                "install a CUDA build of torch (see https://pytorch.org/get-started/locally/)",
            )
        )
    if sec.build_cuda:
        for g in sec.gpus:
            # "9.0a" (arch-specific features) is built for, and runs on, a 9.0 GPU.
            if g.capability not in {a.removesuffix("a") for a in sec.archs}:
                problems.append(
                    Problem(
                        "warning",
                        f"GPU {g.index} ({g.name}, compute capability {g.capability}) is not among the target archs {sec.archs}",
                        f"add {g.capability} to TORCH_CUDA_ARCH_LIST, or unset it to target the GPUs found",
                    )
                )
    if torch.version.cuda and sec.driver_cuda:
        drv, tv = version_tuple(sec.driver_cuda), version_tuple(torch.version.cuda)
        if drv and tv and drv < tv:
            problems.append(
                Problem(
                    "warning",
                    f"the NVIDIA driver {sec.driver_version} supports CUDA up to {sec.driver_cuda}, "
                    f"but torch was built with {torch.version.cuda}",
                    f"update the NVIDIA driver, or install a torch built for CUDA {sec.driver_cuda} or older",
                )
            )
    return sec
