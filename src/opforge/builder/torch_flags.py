"""The flags torch's JIT builder compiles C++ sources with.

A precompiled header must be built with the flags of the files that use it.
Torch decides part of them (``-std=c++17`` or ``c++20`` by version, ``-fPIC``,
its macros and include paths) inside its ninja writer, which is not public:
rather than copy its logic, which changes between versions, let torch build an
empty library once and read the ``cflags`` it wrote into ``build.ninja``.
Cached per torch and Python under the build cache (about half a second, once).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from opforge.builder import store

_FORMAT = "1"


def torch_cxx_flags() -> list[str]:
    """torch's own C++ flags for a JIT build, without the per-library
    ``-DTORCH_EXTENSION_NAME`` (the precompiled headers don't use it) and
    without the caller's extra flags, which follow them on the command line."""
    # lazy: import time (torch.utils.cpp_extension, 40 ms; `import opforge` loads this module)
    from torch.utils import cpp_extension

    where = [str(Path(torch.__file__).parent), sys.implementation.cache_tag, sysconfig.get_path("include")]
    ident = "\0".join([_FORMAT, torch.__version__, *where])
    record = store.cache_root() / "toolchain" / f"torch-cflags-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    known = store.read_json(record)
    if isinstance(known, list):
        return known
    with tempfile.TemporaryDirectory(prefix="opforge-flags-") as tmp:
        src = Path(tmp) / "empty.cpp"
        src.write_text("")
        cpp_extension.load(
            name="opforge_torch_flags",
            sources=[str(src)],
            build_directory=tmp,
            is_python_module=False,
            verbose=False,
        )
        line = next(ln for ln in (Path(tmp) / "build.ninja").read_text().splitlines() if ln.startswith("cflags = "))
    flags = [f for f in shlex.split(line.removeprefix("cflags = ")) if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    store.write_json(record, flags)
    return flags


__all__ = ["torch_cxx_flags"]
