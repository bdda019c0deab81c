"""Ahead-of-time route: the op library (or a user's op folder) as a setuptools
extension, built by ``pip install``.

The extension is made from the same ``BuildConfig`` the JIT route builds, so
the source list, flags and CUDA archs have one definition: every folder under
``csrc/ops``, ``OPFORGE_BUILD_CUDA``, ``TORCH_CUDA_ARCH_LIST``. torch's
``BuildExtension`` compiles it (ninja, ``MAX_JOBS`` parallel jobs) and this
module's subclass writes a build record beside the library, which the import
reads to decide whether the prebuilt library fits this process (same torch,
same CUDA, same sources, the GPUs' archs covered) or the JIT route must build.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from setuptools import Extension
from torch.utils.cpp_extension import BuildExtension as _TorchBuildExtension

from opforge.builder.jit import BuildConfig

#: Beside the library: ``_C.<abi>.so`` and ``_C.build.json``.
RECORD_SUFFIX = ".build.json"


def extension(cfg: BuildConfig, name: str, setup_dir: Path) -> Extension:
    """A CppExtension (CUDAExtension for a CUDA config) building ``cfg`` as
    module ``name``; setuptools wants sources relative to ``setup_dir``."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    make = CUDAExtension if cfg.with_cuda else CppExtension
    ext = make(
        name,
        sources=[os.path.relpath(s, setup_dir) for s in cfg.sources],
        include_dirs=[str(d) for d in cfg.include_dirs],
        # The -gencode flags are in cuda_cflags: torch then adds no arch flags of its own.
        extra_compile_args={"cxx": list(cfg.cflags), "nvcc": list(cfg.cuda_cflags)},
        extra_link_args=list(cfg.ldflags),
    )
    ext._opforge_config = cfg  # read back by BuildExtension for the build record
    return ext


def build_record(cfg: BuildConfig) -> dict[str, Any]:
    """What a prebuilt library must match to be loaded instead of a JIT build."""
    return {
        "format": 1,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.implementation.cache_tag,
        "with_cuda": cfg.with_cuda,
        "cuda_archs": list(cfg.cuda_archs),
        "sources_digest": cfg.sources_digest(),
    }


class BuildExtension(_TorchBuildExtension):
    """torch's BuildExtension (ninja, MAX_JOBS), plus the build record, and
    progress lines: a CUDA build takes minutes and pip shows nothing otherwise.
    A compiler that links libstdc++ statically is replaced as on the JIT route."""

    def run(self) -> None:
        from opforge.builder import toolchain

        with_cuda = any(str(s).endswith(".cu") for e in self.extensions for s in e.sources)
        tc = toolchain.resolve(with_cuda=with_cuda)
        notes = tc.notes()
        if not notes:  # the environment's compilers, untouched
            super().run()
            return
        for note in notes:
            print(note, file=sys.stderr, flush=True)
        # setuptools reads CXX (and CC) when it makes its compiler, in run().
        with toolchain.applied(tc):
            super().run()

    def build_extension(self, ext: Extension) -> None:
        cfg: BuildConfig | None = getattr(ext, "_opforge_config", None)
        if cfg is not None:
            what = (
                f"{len(cfg.sources)} sources, CUDA kernels for sm {', '.join(cfg.cuda_archs)}"
                if cfg.with_cuda
                else (f"{len(cfg.sources)} sources, CPU kernels only")
            )
            print(f"opforge: building {ext.name} ({what})", file=sys.stderr, flush=True)
        super().build_extension(ext)
        if cfg is not None:
            so = Path(self.get_ext_fullpath(ext.name))
            record = so.with_name(so.name.split(".", 1)[0] + RECORD_SUFFIX)
            record.write_text(json.dumps(build_record(cfg), indent=1) + "\n")


def build_folder(folder: Path, *, quiet: bool = False) -> Path:
    """A user's TORCH_LIBRARY op folder built by setuptools (``build_ext``, as
    ``pip install`` would) into the cache; returns the library. Built once per
    content hash, under the cache's lock, in a subprocess: setuptools keeps
    global state and prints, and a failed build must not take this process down."""
    import subprocess
    import time

    from opforge.builder import folder_config
    from opforge.builder.errors import explain_build_failure
    from opforge.builder.store import cache_root, exclusive

    cfg = folder_config(folder)
    out = cache_root() / f"setuptools-{cfg.name}-{cfg.key()[:16]}"
    # The same completion marker as a JIT entry: `opforge cache` lists and cleans both alike.
    marker = out / "COMPLETE.json"

    def built() -> Path | None:
        found = sorted(out.glob(f"{cfg.name}.*.so"))
        return found[0] if found and marker.is_file() else None

    with exclusive(cache_root() / f"{out.name}.lock", quiet=quiet):
        so = built()
        if so is not None:
            return so
        shutil.rmtree(out, ignore_errors=True)  # debris of a failed or killed build
        script = (
            "import sys; from pathlib import Path; from setuptools import setup\n"
            "from opforge.builder import folder_config\n"
            "from opforge.builder.setuptools_ext import BuildExtension, extension\n"
            "folder, out = Path(sys.argv[1]), sys.argv[2]\n"
            "setup(name=folder.name, script_args=['-q', 'build_ext', '--build-lib', out, '--build-temp', out + '/temp'],\n"
            "      ext_modules=[extension(folder_config(folder), sys.argv[3], folder)],\n"
            "      cmdclass={'build_ext': BuildExtension.with_options(use_ninja=True)})\n"
        )
        path = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])
        env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1", "PYTHONPATH": path}
        start = time.perf_counter()
        cmd = [sys.executable, "-c", script, str(folder), str(out), cfg.name]
        res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if res.returncode != 0 or not sorted(out.glob(f"{cfg.name}.*.so")):
            out.mkdir(mode=0o700, parents=True, exist_ok=True)
            log = out / "build.log"
            log.write_text(res.stdout + res.stderr)
            raise explain_build_failure(cfg.name, res.stdout + res.stderr, log)
        shutil.rmtree(out / "temp", ignore_errors=True)
        marker.write_text(json.dumps({"seconds": round(seconds, 2), "route": "setuptools"}) + "\n")
        if not quiet:
            print(f"opforge: built {cfg.name} with setuptools in {seconds:.1f} s", file=sys.stderr, flush=True)
        so = built()
        assert so is not None
        return so


def library_extension(setup_dir: Path) -> Extension:
    """opforge's own op library as ``opforge._C``."""
    from opforge.builder import library_config

    return extension(library_config(), "opforge._C", setup_dir)


__all__ = ["RECORD_SUFFIX", "BuildExtension", "build_folder", "build_record", "extension", "library_extension"]
