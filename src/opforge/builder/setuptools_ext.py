"""Ahead-of-time route: the op library (or a user's op folder) as a setuptools
extension, built by ``pip install``.

The extension is made from the same ``BuildConfig`` the JIT route builds, so
the source list, flags and CUDA archs have one definition: every folder under
``csrc/ops``, ``OPFORGE_BUILD_CUDA``, ``TORCH_CUDA_ARCH_LIST``. A library on
PyTorch's stable ABI (``cfg.stable``, opforge's own) is built by the JIT
route's stable builder (opforge.builder.stable) into a cache under the build
folder and copied to ``<name>.abi3.so``: torch's ``BuildExtension`` would link
it against libtorch_python and, for CUDA, libtorch_cuda, which ties it to one
torch build. Such a wheel is tagged ``cp310-abi3`` (``wheel_options``). Any
other library (a user's ATen folder) is compiled by torch's ``BuildExtension``
(ninja, ``MAX_JOBS`` parallel jobs). This module's subclass writes a build
record beside the library, which the import reads to decide whether the
prebuilt library fits this process (opforge.builder.prebuilt: the torch it
targets, the sources, the GPUs' archs) or the JIT route must build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from setuptools import Extension
from setuptools.errors import CompileError
from torch.utils.cpp_extension import BuildExtension as _TorchBuildExtension
from torch.utils.cpp_extension import CppExtension, CUDAExtension

from opforge.builder import toolchain
from opforge.builder.child import run_bounded
from opforge.builder.config import folder_config, library_config
from opforge.builder.errors import BuildError, explain_build_failure
from opforge.builder.jit import BuildConfig, build_library
from opforge.builder.prebuilt import STABLE_SUFFIX
from opforge.builder.store import cache_root, exclusive

#: Beside the library: ``_C.abi3.so`` (or ``_C.<python abi>.so``) and ``_C.build.json``.
RECORD_SUFFIX = ".build.json"
#: The wheel tag's Python of a stable library: the oldest Python opforge runs on. The
#: library itself calls no Python API (a package's module init uses the limited API of 3.10).
LIMITED_API = "cp310"


def extension(cfg: BuildConfig, name: str, setup_dir: Path) -> Extension:
    """The extension building ``cfg`` as module ``name``; setuptools wants
    sources relative to ``setup_dir``. A stable config (``cfg.stable``) gives a
    plain Extension for the limited API (file ``<name>.abi3.so``), which
    ``BuildExtension`` builds through opforge's stable route; any other a
    CppExtension (CUDAExtension for a CUDA config) that torch builds."""
    sources = [os.path.relpath(s, setup_dir) for s in cfg.sources]
    if cfg.stable:
        # The sources are listed for setuptools (an sdist carries them); the flags are cfg's alone.
        ext = Extension(name, sources=sources, language="c++", py_limited_api=True)
    else:
        make = CUDAExtension if cfg.with_cuda else CppExtension
        # setuptools compiles with the CFLAGS Python was built with, usually -g: for a torch/extension.h
        # file, 1.4x the compile time and an object 50x larger than the JIT route's, which has no -g.
        # -g0 after them keeps the two routes' flags alike; a -g of cfg's own is kept.
        cxx = [*cfg.cflags] if any(f.startswith("-g") for f in cfg.cflags) else [*cfg.cflags, "-g0"]
        ext = make(
            name,
            sources=sources,
            include_dirs=[str(d) for d in cfg.include_dirs],
            # The -gencode flags are in cuda_cflags: torch then adds no arch flags of its own.
            extra_compile_args={"cxx": cxx, "nvcc": list(cfg.cuda_cflags)},
            extra_link_args=list(cfg.ldflags),
        )
    ext._opforge_config = cfg  # read back by BuildExtension: the stable route, the build record
    return ext


def _config_of(ext: Extension) -> BuildConfig | None:
    return getattr(ext, "_opforge_config", None)


def _is_stable(ext: Extension) -> bool:
    cfg = _config_of(ext)
    return cfg is not None and bool(cfg.stable)


def wheel_options(*extensions: Extension) -> dict[str, dict[str, str]]:
    """``setup(options=...)`` for these extensions: a wheel tagged
    ``cp310-abi3`` when every one is on the stable ABI (it then installs in
    every Python from 3.10 on), else nothing (the wheel is for this Python)."""
    if extensions and all(_is_stable(e) for e in extensions):
        return {"bdist_wheel": {"py_limited_api": LIMITED_API}}
    return {}


def build_record(cfg: BuildConfig) -> dict[str, Any]:
    """What a prebuilt library must match to be loaded instead of a JIT build
    (opforge.builder.prebuilt.prebuilt_fits). A stable library records the
    torch it targets, and fits every torch from that one on, any CUDA and any
    Python (the torch it was built with is there for information); any other,
    the exact torch, CUDA and Python it was built for."""
    common = {"with_cuda": cfg.with_cuda, "cuda_archs": list(cfg.cuda_archs), "sources_digest": cfg.sources_digest()}
    if cfg.stable:
        return {"format": 2, "stable": cfg.stable, "built_with_torch": torch.__version__, **common}
    return {
        "format": 1,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.implementation.cache_tag,
        **common,
    }


@contextlib.contextmanager
def _cache_dir(path: Path) -> Iterator[None]:
    """``OPFORGE_CACHE_DIR`` set to ``path`` meanwhile: a pip build keeps its
    objects in its own build folder (incremental across builds of that tree),
    never in the user's cache."""
    before = os.environ.get("OPFORGE_CACHE_DIR")
    os.environ["OPFORGE_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OPFORGE_CACHE_DIR", None)
        else:
            os.environ["OPFORGE_CACHE_DIR"] = before


class BuildExtension(_TorchBuildExtension):
    """torch's BuildExtension (ninja, MAX_JOBS), plus opforge's stable route
    for stable configs, the build record, and progress lines: a CUDA build
    takes minutes and pip shows nothing otherwise. A compiler that links
    libstdc++ statically is replaced as on the JIT route."""

    def run(self) -> None:
        torch_built = [e for e in self.extensions if not _is_stable(e)]
        if not torch_built:  # the stable route resolves the compilers itself, as the JIT route does
            super().run()
            return
        with_cuda = any(str(s).endswith(".cu") for e in torch_built for s in e.sources)
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

    def build_extensions(self) -> None:
        # torch's builder would check nvcc against torch's CUDA (a CPU torch has none) and add
        # its flags to every extension: it sees only those it builds.
        everything = self.extensions
        self.extensions = [e for e in everything if not _is_stable(e)]
        try:
            if self.extensions:
                super().build_extensions()
        finally:
            self.extensions = everything
        for ext in everything:
            if _is_stable(ext):
                self.build_extension(ext)

    def get_ext_filename(self, fullname: str) -> str:
        filename = super().get_ext_filename(fullname)
        ext = self.ext_map.get(fullname)
        if ext is None or not _is_stable(ext):
            return filename
        # One name whatever this Python's abi3 suffix (newer ones add the platform): the file
        # is loaded by torch.ops.load_library, or imported by CPython, which takes .abi3.so.
        head, tail = os.path.split(filename)
        return os.path.join(head, tail.split(".", 1)[0] + STABLE_SUFFIX)

    def build_extension(self, ext: Extension) -> None:
        cfg = _config_of(ext)
        if cfg is not None:
            what = (
                f"{len(cfg.sources)} sources, CUDA kernels for sm {', '.join(cfg.cuda_archs)}"
                if cfg.with_cuda
                else (f"{len(cfg.sources)} sources, CPU kernels only")
            )
            if cfg.stable:
                what += f", stable ABI: torch {cfg.stable} and later"
            print(f"opforge: building {ext.name} ({what})", file=sys.stderr, flush=True)
        if cfg is not None and cfg.stable:
            self._build_stable(ext, cfg)
        else:
            super().build_extension(ext)
        if cfg is not None:
            so = Path(self.get_ext_fullpath(ext.name))
            record = so.with_name(so.name.split(".", 1)[0] + RECORD_SUFFIX)
            record.write_text(json.dumps(build_record(cfg), indent=1) + "\n")

    def _build_stable(self, ext: Extension, cfg: BuildConfig) -> None:
        """``cfg`` built by the JIT route's stable builder into a cache under
        build_temp, then copied to the extension's path."""
        # TORCH_EXTENSION_NAME is the module's own name: a package's library may have a
        # module init (PyInit__C) to be imported by, as well as loaded into torch.ops.
        named = dataclasses.replace(cfg, extension_name=ext.name.rsplit(".", 1)[-1])
        with _cache_dir(Path(self.build_temp).resolve() / "opforge-cache"):
            try:
                lib = build_library(named)
            except BuildError as exc:
                raise CompileError(str(exc)) from exc
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Through a new file and a rename: an editable install's running process may have the
        # old library mapped, and writing into that inode would change its code under it.
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        shutil.copy2(lib.path, tmp)
        os.replace(tmp, dest)


def build_folder(folder: Path, *, quiet: bool = False) -> Path:
    """A user's TORCH_LIBRARY op folder built by setuptools (``build_ext``, as
    ``pip install`` would) into the cache; returns the library. Built once per
    content hash, under the cache's lock, in a subprocess: setuptools keeps
    global state and prints, and a failed build must not take this process down."""
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
        res = run_bounded(cmd, timeout=None, cwd=folder, env=env)
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
    return extension(library_config(), "opforge._C", setup_dir)


__all__ = [
    "LIMITED_API",
    "RECORD_SUFFIX",
    "BuildExtension",
    "build_folder",
    "build_record",
    "extension",
    "library_extension",
    "wheel_options",
]
