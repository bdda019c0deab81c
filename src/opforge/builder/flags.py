"""Compiler flags: torch's own, ``OPFORGE_BUILD_CUDA``, and flags of some sources alone.

``torch_cxx_flags``: the flags torch's JIT builder compiles C++ sources with.
A precompiled header must be built with the flags of the files that use it.
Torch decides part of them (``-std=c++17`` or ``c++20`` by version, ``-fPIC``,
its macros and include paths) inside its ninja writer, which is not public:
rather than copy its logic, which changes between versions, let torch build an
empty library once and read the ``cflags`` it wrote into ``build.ninja``.
Cached per torch and Python under the build cache (about half a second, once).

``build_cuda_flag``: ``OPFORGE_BUILD_CUDA``, read in one place, below the build
configurations (``opforge.builder.config``), so that what explains a load failure
(``opforge.builder.symbols``) can read it without importing every build's definition.

``by_compiled``, ``scoped_flags``: flags of some sources alone (``BuildConfig.groups``), given to ninja as the
compile step of each such source: ``cxxflags = $cxxflags -mavx512f`` under its
``build`` line, so that the rest of the library never sees them.

The stable route writes its own ninja file (``opforge.builder.stable``); the
torch route's file is written by torch's ``load``, which has one set of flags
for every source: ``in_torch_ninja_file`` adds each source's own to the file
torch writes, before ninja runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import sys
import sysconfig
import tempfile
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from opforge.builder import store
from opforge.builder.errors import BuildError
from opforge.builder.recipe import BuildConfig, SourceFlags

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


_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def build_cuda_flag() -> bool | None:
    """``OPFORGE_BUILD_CUDA``, the one place it is read: True or False when set
    (1/0, true/false, yes/no, on/off, in any case), None when unset or empty.
    Any other value is a BuildError: a typo must not quietly mean "off"."""
    raw = os.environ.get("OPFORGE_BUILD_CUDA", "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _YES or value in _NO:
        return value in _YES
    raise BuildError(
        f"opforge: OPFORGE_BUILD_CUDA={raw!r} is neither on nor off: set it to 1 or 0 (or true/false, yes/no, on/off), "
        "or unset it for the default (CUDA kernels when torch has CUDA and nvcc is found)"
    )


# A compile step of torch's ninja file: "build a.o: compile /abs/a.cpp" (a space in the path as "$ ").
_TORCH_STEP = re.compile(r"build (?P<obj>\S+): (?P<rule>compile|cuda_compile) (?P<src>.+)")


def scoped_flags(variable: str, flags: Sequence[str]) -> str:
    """A ninja binding, indented under a ``build`` line, that gives that one
    step ``flags`` after the file's own ``variable``."""
    if bad := [f for f in flags if "\n" in f]:
        raise BuildError(f"opforge: a compiler flag holds a line break: {bad[0]!r}")
    return f"  {variable} = ${variable} {shlex.join(flags).replace('$', '$$')}"


def by_compiled(cfg: BuildConfig, compiled: Sequence[Path]) -> dict[Path, SourceFlags]:
    """``cfg.source_flags()`` by the file ninja compiles (a source's generated
    wrapper where the engine made one, for a precompiled header or an object
    name of its own): one file a source, in order, but for the unity unit, last,
    whose sources have no flags of their own (BuildConfig refuses them)."""
    own = cfg.source_flags()
    if not own:
        return {}
    originals = [s for s in cfg.sources if s not in cfg.unity]
    return {c: own[s] for c, s in zip(compiled, originals, strict=False) if s in own}


@contextlib.contextmanager
def in_torch_ninja_file(cpp_extension: types.ModuleType, own: Mapping[Path, SourceFlags]) -> Iterator[None]:
    """While torch's ``load`` runs: the ninja file it writes gains, under the
    compile step of each of ``own``'s sources, that source's own flags after
    the rest (``post_cflags`` and ``cuda_post_cflags``, which its load leaves empty)."""
    if not own:
        yield
        return
    original = getattr(cpp_extension, "_write_ninja_file", None)
    if original is None:
        raise BuildError(
            f"opforge: torch {torch.__version__} writes its build file in a way opforge does not know, so the flags of "
            f"some sources alone ({', '.join(s.name for s in own)}) cannot be given"
        )

    def write(*args: object, **kwargs: object) -> None:
        original(*args, **kwargs)
        _add(Path(str(kwargs["path"] if "path" in kwargs else args[0])), own)

    cpp_extension._write_ninja_file = write
    try:
        yield
    finally:
        cpp_extension._write_ninja_file = original


def _add(ninja: Path, own: Mapping[Path, SourceFlags]) -> None:
    wanted = {os.path.abspath(s): flags for s, flags in own.items()}
    lines, seen = [], set()
    text = ninja.read_text()
    for line in text.splitlines():
        lines.append(line)
        if (m := _TORCH_STEP.fullmatch(line)) and (src := m["src"].replace("$ ", " ")) in wanted:
            seen.add(src)
            cuda = m["rule"] == "cuda_compile"
            if flags := wanted[src][1 if cuda else 0]:
                lines.append(scoped_flags("cuda_post_cflags" if cuda else "post_cflags", flags))
    if missing := [s for s in wanted if s not in seen]:
        # Never build without them: a kernel's flags silently lost is a library that differs from its project's.
        raise BuildError(f"opforge: torch's build file has no compile step for {', '.join(missing)}, whose own flags were to go there")
    new = "\n".join(lines) + "\n"
    if new != text:
        ninja.write_text(new)


__all__ = ["build_cuda_flag", "by_compiled", "in_torch_ninja_file", "scoped_flags", "torch_cxx_flags"]
