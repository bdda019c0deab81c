"""Hugging Face kernel-builder projects, built by opforge's engine, without Nix.

A kernel-builder project says what it is in ``build.toml``: its name and
backends (``[general]``), the torch extension (``[torch]``: ``src``,
``include``, ``pyext``, ``minver``/``maxver``, ``stable-abi``) and its kernels
(``[kernel.<name>]``: ``backend``, ``src``, ``include``, ``depends``,
``cuda-capabilities``, ``cuda-flags``, ``cxx-flags``). Its Python package is
``torch-ext/<name>/``; ``torch-ext/torch_binding.cpp`` registers the operators
with ``TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops)`` and makes the library
importable with ``REGISTER_EXTENSION(TORCH_EXTENSION_NAME)``, macros of a
``registration.h`` that kernel-builder generates.

``build_project`` builds it as kernel-builder does, one library a backend:
the ``[torch]`` sources and that backend's kernels, with ``CPU_KERNEL`` or
``CUDA_KERNEL`` defined, under a namespace of the build's own,
``_<name>_<backend>_<hash of the sources>`` (TORCH_EXTENSION_NAME), so that
two versions of a kernel load side by side. Each library goes through the JIT
engine (cache, lock, progress, compiler errors), or its stable-ABI route where
``build.toml`` says ``stable-abi``. What kernel-builder generates is written
too: ``registration.h`` (into the cache, on the include path, so that a
project's own ``torch-ext/registration.h`` is left alone and wins) and
``_ops.py`` (``ops`` and ``add_op_namespace_prefix`` for the namespace). The
build for this machine's backend is placed in ``torch-ext/<name>/`` beside its
``_ops.py``, so that the package imports from ``torch-ext``; every backend's
build goes to its variant folder ``build/<variant>/<name>/`` with a
``metadata.json``, the layout ``kernels.get_local_kernel`` resolves and loads.
Backends this machine cannot build (CUDA without nvcc or a CUDA torch; Metal,
ROCm, XPU and the rest, which opforge does not build) are skipped, and said.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from opforge.builder.archs import arch_number, cuda_archs, cuda_home, gencode_flags
from opforge.builder.config import build_cuda_flag, want_cuda
from opforge.builder.errors import BuildError
from opforge.builder.jit import build_library, cache_root
from opforge.builder.recipe import BuildConfig, SourceGroup
from opforge.builder.sources import CPP_SUFFIXES, CUDA_SUFFIXES, HEADER_SUFFIXES
from opforge.builder.stable import target_flag
from opforge.builder.store import exclusive
from opforge.builder.toolchain import nvcc_version
from opforge.elf_symbols import read_dynamic_symbols
from opforge.folders.describe import cuda_unavailable
from opforge.folders.kernel_builder.layout import (
    REGISTRATION_H,
    Variant,
    place_in_torch_ext,
    release,
    torch_release,
    variant_name,
    write_variant,
)
from opforge.folders.kernel_builder.toml import BUILD_TOML, BUILT_BACKENDS, Kernel, KernelBuilderError, Project, read_project
from opforge.folders.package import write_generated

#: The macro each backend's build defines (kernel-builder's), which torch_binding.cpp tests.
_DEFINES = {"cpu": ("-DCPU_KERNEL",), "cuda": ("-DCUDA_KERNEL", "-DUSE_CUDA=1")}
# kernel-builder's nvcc flags beyond its defines and -O3 -DNDEBUG (a Release build). Its CMake
# (build2cmake's templates: utils.cmake, get_torch_gpu_compiler_flags, on every .cu) takes torch's
# COMMON_NVCC_FLAGS and, for CUDA 11.8 and later, drops the four -D__CUDA_NO_HALF*/BFLOAT16* macros
# and adds -DENABLE_FP8; find_package(Torch) on a CUDA torch (torch's share/cmake/Caffe2/public/
# cuda.cmake) puts --expt-relaxed-constexpr and --expt-extended-lambda into CMAKE_CUDA_FLAGS. No
# --use_fast_math. torch's load defines those four macros: -U takes them back, as nvcc reads -D and
# -U in order. Left out, as they change no code a kernel compiles: the -Xcudafe --diag_suppress list
# and -DONNX_NAMESPACE of cuda.cmake.
_CUDA_DEFAULTS = (
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-DENABLE_FP8",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
)
# The Python the placed library asks for: the limited API of the oldest Python opforge
# runs on, so that one file (.abi3.so) serves every Python from it on, as kernel-builder's do.
_LIMITED_API = "-DPy_LIMITED_API=0x030A0000"
# Sources that need the full Python API (pybind11): their library is for this Python alone.
_FULL_PYTHON = ("torch/extension.h", "pybind11", "torch/python.h")


# --------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    project: Project
    variants: tuple[Variant, ...]
    lines: tuple[str, ...]  # what was found and will be built, before anything compiles


def _arch_base(arch: str) -> str:
    """ "9.0a" and "10.0f" and "9.0+PTX" -> the capability they build for: "9.0"."""
    return arch.removesuffix("+PTX").rstrip("af")


def _kernel_archs(kernel: Kernel, targets: Sequence[str], where: Path) -> tuple[str, ...]:
    """The archs of ``targets`` that the kernel's cuda-capabilities allow (all where it lists none)."""
    if not kernel.cuda_capabilities:
        return tuple(targets)
    try:
        allowed = {_arch_base(c) for c in kernel.cuda_capabilities if arch_number(_arch_base(c))}
    except ValueError:
        raise KernelBuilderError(
            f'{where}: [kernel.{kernel.name}] cuda-capabilities must be capabilities such as "8.0" or "9.0a", '
            f"got {list(kernel.cuda_capabilities)}"
        ) from None
    return tuple(a for a in targets if _arch_base(a) in allowed)


def _listed(paths: Sequence[Path], project: Project, most: int = 6) -> str:
    names = [project.rel(p) for p in paths]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _cuda_reason(stable: bool) -> str | None:
    """Why CUDA kernels are not built here (as opforge.builder.want_cuda decides), or None when they are."""
    if want_cuda(stable=stable):
        return None
    reason = cuda_unavailable() or "OPFORGE_BUILD_CUDA"
    home = cuda_home()
    if stable and torch.version.cuda is None and build_cuda_flag() is None and home and (home / "bin" / "nvcc").exists():
        reason += "; on the stable ABI, OPFORGE_BUILD_CUDA=1 builds them with nvcc alone"
    return reason


def _cuda_version(stable: bool) -> str | None:
    """The CUDA a build's kernels are for: torch's (its libraries are linked), or,
    on the stable ABI (the CUDA runtime linked statically), nvcc's."""
    if not stable:
        return torch.version.cuda
    home = cuda_home()
    return nvcc_version(home / "bin" / "nvcc") if home is not None else None


def _needs_full_python(paths: Sequence[Path]) -> Path | None:
    for p in paths:
        try:
            body = p.read_text(errors="replace")
        except OSError:
            continue
        if any(f in body for f in _FULL_PYTHON):
            return p
    return None


def plan(root: Path) -> Plan:
    """What ``build_project`` will build, decided before anything compiles:
    the build.toml read (``read_project``), one ``Variant`` a backend this
    machine can build, and the lines that say it all, skipped backends and
    left-out kernels included. Raises KernelBuilderError for a build.toml that
    cannot be built as written, BuildError for an OPFORGE_BUILD_CUDA it cannot honour."""
    project = read_project(root)
    toml = project.root / BUILD_TOML
    lines = [f"opforge build: {project.root}"]
    version = f" (version {project.version})" if project.version is not None else ""
    lines.append(f"  build.toml: {project.name}{version}, backends {', '.join(project.backends)}")
    headers = [p for p in project.torch_src if p.suffix in HEADER_SUFFIXES]
    compiled_torch = [p for p in project.torch_src if p.suffix in (*CPP_SUFFIXES, *CUDA_SUFFIXES)]
    lines.append(
        f"  torch: {_listed(compiled_torch, project) or 'no source'}"
        + (f" (+{len(headers)} header{'s' if len(headers) != 1 else ''})" if headers else "")
        + (f"; include: {_listed(project.torch_include, project)}" if project.torch_include else "")
        + f"; package: {project.rel(project.package)}/"
    )
    for k in project.kernels:
        srcs = [p for p in k.src if p.suffix not in HEADER_SUFFIXES]
        inc = f"; include: {_listed(k.include, project)}" if k.include else ""
        caps = f"; cuda-capabilities: {', '.join(k.cuda_capabilities)}" if k.cuda_capabilities else ""
        lines.append(f"  kernel {k.name} ({k.backend}): {_listed(srcs, project)}{inc}{caps}")
    lines.append(
        "  route: kernel-builder (build.toml: one library a backend, as kernel-builder builds it, "
        "placed in torch-ext/ and in build/<variant>/)"
    )
    own_registration = project.torch_ext / "registration.h"
    registration = write_generated(cache_root(), "kernel-builder", "registration.h", REGISTRATION_H)
    lines.append(
        f"  registration.h: {project.rel(own_registration)} (the project's own)"
        if own_registration.is_file()
        else f"  registration.h: generated ({registration})"
    )
    here = torch_release()
    for bound, word, ok in ((project.minver, "minver", lambda v: here >= v), (project.maxver, "maxver", lambda v: here <= v)):
        if bound and not ok(release(bound)[:2]):
            raise KernelBuilderError(f"{toml}: [torch] {word} = {bound!r}, but this torch is {torch.__version__}")
    extra_cxx = tuple(os.environ.get("OPFORGE_CXXFLAGS", "").split())

    variants = []
    for backend in project.backends:
        if backend not in BUILT_BACKENDS:
            lines.append(f"  {backend}: skipped (opforge builds the cpu and cuda backends)")
            continue
        stable = project.stable_abi.get(backend, "")
        kernels = [k for k in project.kernels if k.backend == backend]
        archs: tuple[str, ...] = ()
        cuda = None
        if backend == "cuda":
            reason = _cuda_reason(bool(stable))
            if reason is None:
                cuda = _cuda_version(bool(stable))
                if cuda is None:
                    reason = "the CUDA version of this toolkit could not be read (nvcc --version)"
            if reason is None and project.cuda_minver and release(cuda) < release(project.cuda_minver):
                reason = f"[general.cuda] minver = {project.cuda_minver}, but this CUDA is {cuda}"
            if reason is None and project.cuda_maxver and release(cuda)[:2] > release(project.cuda_maxver)[:2]:
                reason = f"[general.cuda] maxver = {project.cuda_maxver}, but this CUDA is {cuda}"
            if reason is not None:
                listed = [p for k in kernels for p in k.src if p.suffix not in HEADER_SUFFIXES]
                lines.append(f"  cuda: skipped ({reason})" + (f"; left out: {_listed(listed, project)}" if listed else ""))
                continue
            for k in [k for k in kernels if k.cuda_minver and release(cuda) < release(k.cuda_minver)]:
                lines.append(f"  kernel {k.name}: left out (cuda-minver = {k.cuda_minver}, this CUDA is {cuda})")
                kernels.remove(k)
            targets = cuda_archs()
            archs = tuple(targets)
            for k in kernels:
                allowed = _kernel_archs(k, archs, toml)
                if not allowed:
                    raise KernelBuilderError(
                        f"{toml}: [kernel.{k.name}] cuda-capabilities ({', '.join(k.cuda_capabilities)}) include none of the "
                        f"archs this build targets (sm {', '.join(targets)}): set TORCH_CUDA_ARCH_LIST to one it lists"
                    )
                if dropped := [a for a in archs if a not in allowed]:
                    lines.append(f"  cuda: sm {', '.join(dropped)} left out: [kernel.{k.name}] cuda-capabilities exclude it")
                archs = allowed
        sources = [p for p in project.torch_src if p.suffix in CPP_SUFFIXES or (backend == "cuda" and p.suffix in CUDA_SUFFIXES)]
        for k in kernels:
            sources += [p for p in k.src if p.suffix in CPP_SUFFIXES or (backend == "cuda" and p.suffix in CUDA_SUFFIXES)]
        sources = list(dict.fromkeys(sources))
        if not sources:
            lines.append(f"  {backend}: skipped (no C++ or CUDA source for it in [torch] src or its kernels)")
            continue
        others = ", ".join(sorted({d for k in kernels for d in k.depends if d != "torch"}))
        if others:
            lines.append(f"  {backend}: depends on {others}: opforge adds no include path for it (put its headers on CPATH)")
        # The folders of every file listed (their headers are in the cache key: a header edited beside its
        # source rebuilds), then the generated registration.h. The declared include folders are the group's
        # that declares them ([torch] include for its sources, a kernel's for its own), as kernel-builder's
        # per-source INCLUDE_DIRECTORIES, and so are a kernel's cxx-flags and cuda-flags (COMPILE_OPTIONS):
        # an -mavx512f of one kernel must not reach the binding, whose code runs at load on any CPU.
        listed_dirs = [p.parent for p in (*project.torch_src, *(p for k in kernels for p in k.src))]
        include_dirs = tuple(dict.fromkeys([*listed_dirs, registration.parent]))
        groups = tuple(
            SourceGroup(tuple(s for s in srcs if s in sources), cflags=cxx, cuda_cflags=cu, include_dirs=inc)
            for srcs, cxx, cu, inc in (
                (project.torch_src, (), (), project.torch_include),
                *((k.src, k.cxx_flags, k.cuda_flags, k.include) for k in kernels),
            )
            if any(s in sources for s in srcs) and (cxx or cu or inc)
        )
        full = _needs_full_python([*sources, *(p for p in project.torch_src if p.suffix in HEADER_SUFFIXES)])
        defines = _DEFINES[backend]
        cflags = ["-O3", "-DNDEBUG", *defines, *(() if full else (_LIMITED_API,))]
        ldflags: tuple[str, ...] = ()
        if stable:
            cflags.append(target_flag(stable))
        else:
            # Without torch's TORCH_API_INCLUDE_EXTENSION_H, torch/torch.h is torch/all.h, as in kernel-builder's
            # builds: no pybind11, which the limited API would refuse; OpenMP for the CPU loops, as opforge's folders.
            cflags += ["-UTORCH_API_INCLUDE_EXTENSION_H", "-fopenmp"]
            ldflags = ("-fopenmp",)
        cflags += extra_cxx
        cuda_cflags: tuple[str, ...] = ()
        if backend == "cuda":
            cuda_cflags = ("-O3", "-DNDEBUG", *defines, *_CUDA_DEFAULTS)
            if stable:
                # The stable route compiles .cu files as pure CUDA; kernel-builder's include torch's stable headers.
                torch_dir = Path(torch.__file__).parent
                cuda_cflags += (target_flag(stable), f"-I{torch_dir / 'include'}")
                if (torch_dir / "lib" / "libtorch_cuda.so").is_file():
                    ldflags += ("-ltorch_cuda",)  # the shim's CUDA functions (the current stream), where they are called
            else:
                cuda_cflags += ("-UTORCH_API_INCLUDE_EXTENSION_H",)
            cuda_cflags += tuple(gencode_flags(archs))
        config = BuildConfig(
            name=f"{project.python_name}_{backend}",
            sources=tuple(sources),
            include_dirs=include_dirs,
            cflags=tuple(dict.fromkeys(cflags)),
            cuda_cflags=cuda_cflags,
            ldflags=ldflags,
            with_cuda=backend == "cuda",
            cuda_archs=archs,
            stable=stable,
            groups=groups,
        )
        # The namespace of this version of the sources: kernel-builder's unique material, here a content hash.
        h = hashlib.sha256()
        for part in (toml.read_bytes(), backend.encode(), stable.encode(), config.sources_digest().encode()):
            h.update(part + b"\0")
        ops_name = f"_{project.python_name}_{backend}_{h.hexdigest()[:10]}"
        config = dataclasses.replace(config, extension_name=ops_name)
        name = variant_name(backend, cuda=cuda, stable=stable)
        shown = [*(p for k in kernels for p in k.src if p in sources), *(p for p in sources if p in project.torch_src)]
        how = f"stable ABI, torch {stable} and later" if stable else f"torch {torch.__version__}"
        what = f"sm {', '.join(archs)}, CUDA {cuda}" if backend == "cuda" else "CPU kernels"
        lines.append(f"  {backend}: {_listed(list(dict.fromkeys(shown)), project)} ({what}; {how})")
        lines.append(f"    variant: build/{name}/{project.python_name}/, namespace {ops_name}")
        if full is not None:
            lines.append(f"    {project.rel(full)} uses pybind11 (torch/extension.h): the library is for this Python alone, not .abi3.so")
        metadata_archs = (*archs, f"{_arch_base(max(archs, key=release))}+PTX") if archs else ()
        variants.append(Variant(backend, name, ops_name, config, metadata_archs, limited_api=full is None))
    return Plan(project, tuple(variants), tuple(lines))


# --------------------------------------------------------------- the build


@dataclasses.dataclass(frozen=True)
class Built:
    variant: Variant
    library: Path  # in build/<variant>/<name>/
    seconds: float | None  # None: found in the cache
    changed: bool = True  # False: the variant folder held this build already


@dataclasses.dataclass(frozen=True)
class Result:
    plan: Plan
    built: tuple[Built, ...]
    in_torch_ext: Variant  # the build torch-ext/<name>/ holds
    ops_py_kept: bool  # torch-ext/<name>/_ops.py is the project's own and was left as it is

    def lines(self) -> list[str]:
        """What was built and where it went, one line each."""
        project = self.plan.project
        said = []
        for b in self.built:
            how = f"built in {b.seconds:.1f} s" if b.seconds is not None else "cached"
            how += "" if b.changed else ", already in place"
            said.append(f"{project.name}: {b.variant.backend} ({how}): {project.rel(b.library)}")
        v = self.in_torch_ext
        ops = "_ops.py left as it is: the project's own, not generated" if self.ops_py_kept else "_ops.py"
        said.append(f"{project.name}: {project.rel(project.package)}/ holds the {v.backend} build: {v.library_name}, {ops}")
        return said


def _needs_torch_cuda(library: Path) -> list[str]:
    """The shim functions a stable-ABI library calls that libtorch_cpu does not
    define (libtorch_cuda's: the current CUDA stream), where torch has no
    libtorch_cuda to link it against; [] where it has, or the library calls none."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libtorch_cuda.so").is_file():
        return []
    calls = [s for s in read_dynamic_symbols(library).undefined if s.startswith(("aoti_torch_", "torch_"))]
    if not calls:
        return []
    defined = set(read_dynamic_symbols(torch_lib / "libtorch_cpu.so").defined)
    return [s for s in calls if s not in defined]


def _preferred(variants: Sequence[Variant]) -> Variant:
    """The build this machine's torch runs: CUDA where torch has CUDA and it was built, else CPU."""
    by_backend = {v.backend: v for v in variants}
    if torch.version.cuda is not None and "cuda" in by_backend:
        return by_backend["cuda"]
    return by_backend.get("cpu", variants[0])


def build_project(root: Path, *, say: Callable[[str], None]) -> Result:
    """Plans (``plan``, its lines said first), builds each variant through the
    engine, writes each variant folder and places this machine's build in
    ``torch-ext/<name>/``. Raises KernelBuilderError or BuildError."""
    p = plan(root)
    for line in p.lines:
        say(line)
    project = p.project
    if not p.variants:
        raise KernelBuilderError(
            f"{project.root / BUILD_TOML}: none of its backends ({', '.join(project.backends)}) can be built here (see above)"
        )
    built = []
    for variant in p.variants:
        lib = build_library(variant.config)
        if variant.backend == "cuda" and variant.config.stable and (missing := _needs_torch_cuda(lib.path)):
            raise BuildError(
                f"opforge: {project.name}: the cuda build calls {', '.join(missing)}, which only torch's libtorch_cuda "
                f"defines, and torch {torch.__version__} has none to link it against: the library would not load. "
                "Build the cuda backend where torch has CUDA (the cpu one builds here with OPFORGE_BUILD_CUDA=0)"
            )
        built.append((variant, lib))
    # One writer at a time in the project's tree (two builds of one project would interleave their files).
    lock = cache_root() / f"kernel-builder-{hashlib.sha256(str(project.root).encode()).hexdigest()[:16]}.lock"
    placed = []
    with exclusive(lock, quiet=False):
        for variant, lib in built:
            library, changed = write_variant(project, variant, lib.path)
            placed.append(Built(variant, library, lib.build_seconds if lib.built_now else None, changed))
        preferred = _preferred(p.variants)
        kept = place_in_torch_ext(project, preferred, next(lib.path for v, lib in built if v is preferred))
    return Result(p, tuple(placed), preferred, kept)


__all__ = ["Built", "Plan", "Result", "build_project", "plan"]
