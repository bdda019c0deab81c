"""The stable-ABI route: a library that loads in every torch from a target version on.

Its C++ uses only PyTorch's stable C shim and header-only code
(``torch/csrc/stable``, ``torch/headeronly``); ``TORCH_TARGET_VERSION`` hides
every API newer than the target, so the build fails rather than the load.
torch's own JIT builder cannot make such a library: it links libc10,
libtorch_python and, for CUDA, libc10_cuda and libtorch_cuda, which a CPU
build of torch lacks. This route writes its own ninja file instead:

* C++ sources with torch's compile flags (``torch_flags``) and the target;
* CUDA sources (pure CUDA: the launchers take raw pointers and a stream) with
  nvcc, whatever CUDA torch has or lacks: a CPU build of torch can build the
  CUDA kernels;
* the link: libtorch_cpu alone (the shim) and the CUDA runtime linked
  statically, so that the library loads on a machine without a GPU or CUDA
  toolkit and finds the driver only when a CUDA tensor reaches it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from opforge.builder.archs import cuda_home
from opforge.builder.errors import BuildError, explain_build_failure
from opforge.builder.flags import scoped_flags, torch_cxx_flags
from opforge.builder.recipe import SourceFlags
from opforge.builder.sources import CUDA_SUFFIXES

if TYPE_CHECKING:
    from opforge.builder.progress import Progress
    from opforge.builder.recipe import BuildConfig
    from opforge.builder.toolchain import Toolchain

#: The first torch of the versioned stable ABI, and opforge's own library's target.
FLOOR = "2.10"


def parse_target(value: str) -> tuple[int, int]:
    """``"2.10"`` -> (2, 10); a ValueError naming the value for anything else or below FLOOR."""
    parts = value.strip().split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
        if len(parts) > 3:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"opforge: a stable-ABI target is a torch version such as {FLOOR}, got {value!r}") from None
    if (major, minor) < tuple(int(p) for p in FLOOR.split(".")):
        raise ValueError(f"opforge: the stable ABI is versioned from torch {FLOOR} on, got a target of {value!r}")
    return major, minor


def target_flag(target: str) -> str:
    """The ``-DTORCH_TARGET_VERSION`` of a target: major in bits 56-63, minor in 48-55."""
    major, minor = parse_target(target)
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000ULL"


def _objects_of(sources: Sequence[Path]) -> list[str]:
    return [s.stem + (".cuda.o" if s.suffix in CUDA_SUFFIXES else ".o") for s in sources]


def write_ninja(
    build_dir: Path,
    so_name: str,
    sources: Sequence[Path],
    *,
    include_dirs: Sequence[Path],
    cflags: Sequence[str],
    cuda_cflags: Sequence[str],
    ldflags: Sequence[str],
    cxx: str,
    cuda_home: Path | None,
    cuda_host: str | None,
    torch_flags: Sequence[str],
    extension_name: str,
    source_flags: Mapping[Path, SourceFlags] | None = None,
) -> Path:
    """``build.ninja`` for ``sources`` -> ``<so_name>.so`` in ``build_dir``; its path.
    ``source_flags``: a source's own (C++ flags, nvcc flags), after the build's."""
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{d}" for d in include_dirs]
    # torch's flags carry its include paths, -fPIC, the C++ standard and the C++ ABI macro.
    cxx_flags = [*includes, *torch_flags, f"-DTORCH_EXTENSION_NAME={extension_name}", *cflags]
    if f"-I{sysconfig.get_path('include')}" not in cxx_flags:
        cxx_flags.append(f"-I{sysconfig.get_path('include')}")
    q = shlex.join
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {cxx}",
        f"cxxflags = {q(cxx_flags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compiling $in",
    ]
    has_cuda = any(s.suffix in CUDA_SUFFIXES for s in sources)
    link = ["-shared", f"-L{torch_lib}", "-Wl,--as-needed", "-ltorch_cpu", *ldflags]
    if has_cuda:
        if cuda_home is None:
            raise FileNotFoundError("nvcc")
        nvcc = cuda_home / "bin" / "nvcc"
        host = ["-ccbin", cuda_host] if cuda_host else []
        nv_flags = [*host, *includes, "-std=c++17", "-Xcompiler", "-fPIC", *cuda_cflags]
        lines += [
            f"nvcc = {q([str(nvcc)])}",
            f"nvflags = {q(nv_flags)}",
            "rule nvcc",
            "  command = $nvcc -MD -MF $out.d $nvflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = compiling $in",
        ]
        link += [f"-L{cudart_dir(cuda_home)}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
    objects = _objects_of(sources)
    for src, obj in zip(sources, objects, strict=True):
        rule = "nvcc" if src.suffix in CUDA_SUFFIXES else "cxx"
        lines.append(f"build {obj}: {rule} {_escape(str(src))}")
        cxx_own, cuda_own = (source_flags or {}).get(src, ((), ()))
        if own := cuda_own if rule == "nvcc" else cxx_own:
            lines.append(scoped_flags("nvflags" if rule == "nvcc" else "cxxflags", own))
    lines += [
        f"ldflags = {q(link)}",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = linking $out",
        f"build {so_name}.so: link {' '.join(objects)}",
        f"default {so_name}.so",
    ]
    path = build_dir / "build.ninja"
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text() != text:  # a new mtime would make ninja rebuild everything
        path.write_text(text)
    return path


def cudart_dir(cuda_home: Path) -> Path:
    """The folder of the static CUDA runtime: the toolkit's lib64 (or lib, or its
    target folder); nvcc on the PATH may be a link into the toolkit from elsewhere."""
    homes = [cuda_home, Path(os.path.realpath(cuda_home / "bin" / "nvcc")).parent.parent, Path("/usr/local/cuda")]
    for home in homes:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (home / sub / "libcudart_static.a").is_file():
                return home / sub
    raise FileNotFoundError(f"libcudart_static.a (the static CUDA runtime) under {', '.join(str(h) for h in homes)}")


def _escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def run_ninja(build_dir: Path) -> tuple[bool, str]:
    """Runs ninja in ``build_dir`` on every core; (ok, its output)."""
    ninja = shutil.which("ninja") or "ninja"
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    res = subprocess.run([ninja, "-C", str(build_dir), "-j", jobs], capture_output=True, text=True)
    return res.returncode == 0, res.stdout + res.stderr


def build(
    cfg: BuildConfig,
    objects: Path,
    so_name: str,
    sources: list[Path],
    tc: Toolchain,
    pch_flags: list[str],
    progress: Progress,
    source_flags: Mapping[Path, SourceFlags] | None = None,
) -> None:
    """Builds ``cfg`` (a stable config) into ``objects/<so_name>.so``: the ninja
    file, then ninja; a failure is a BuildError that leads with the compiler's errors.
    ``source_flags``: the flags of some of ``sources`` alone, by the file ninja compiles."""
    host = tc.cuda_host.use if tc.cuda_host is not None and tc.cuda_host.fell_back else os.environ.get("CUDAHOSTCXX")
    try:
        write_ninja(
            objects,
            so_name,
            sources if cfg.with_cuda else [s for s in sources if s.suffix not in CUDA_SUFFIXES],
            include_dirs=cfg.include_dirs,
            cflags=[*cfg.cflags, *pch_flags],
            cuda_cflags=cfg.cuda_cflags,
            ldflags=cfg.ldflags,
            cxx=tc.cxx.use,
            cuda_home=cuda_home() if cfg.with_cuda else None,
            cuda_host=host,
            torch_flags=torch_cxx_flags(),
            extension_name=so_name,
            source_flags=source_flags,
        )
    except FileNotFoundError as exc:
        progress.stop(ok=False)
        raise BuildError(f"opforge: building {cfg.name} with CUDA kernels: not found: {exc}") from None
    ok, output = run_ninja(objects)
    if not ok:
        progress.stop(ok=False)
        log = objects / "build.log"
        log.write_text(output)
        raise explain_build_failure(cfg.name, output, log) from None


__all__ = ["FLOOR", "build", "cudart_dir", "parse_target", "run_ninja", "target_flag", "write_ninja"]
