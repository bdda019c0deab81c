"""What a build is: ``BuildConfig`` (sources, flags, target; its content hash is
the cache key) and ``Library`` (a built library on disk and how it got there).
Every route and every config module shares them, below the routes themselves."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import torch

from opforge.builder.sources import headers_under

# Bumped when the layout of a cache entry or the build recipe changes.
_CACHE_FORMAT = "2"


#: A source's own flags: (the C++ compiler's, nvcc's).
SourceFlags = tuple[tuple[str, ...], tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class SourceGroup:
    """Some of a build's sources with flags of their own, added after the
    build's: a kernel's ``-mavx512f`` reaches that kernel's files and not the
    binding's, whose code runs at load on any CPU. As CMake's per-source
    COMPILE_OPTIONS and INCLUDE_DIRECTORIES do; a source in two groups gets both."""

    sources: tuple[Path, ...]
    # The C++ compiler's, for the group's C++ sources.
    cflags: tuple[str, ...] = ()
    # nvcc's, for the group's CUDA sources.
    cuda_cflags: tuple[str, ...] = ()
    # Searched by the group's sources alone (C++ and CUDA), after the build's own include_dirs.
    include_dirs: tuple[Path, ...] = ()


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything that determines a built library; its hash is the cache key."""

    name: str
    sources: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    with_cuda: bool = False
    cuda_archs: tuple[str, ...] = ()
    # A pybind11 extension module (PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)) to
    # import, rather than a TORCH_LIBRARY library to load into torch.ops.
    python_module: bool = False
    # Headers every .cpp source is compiled with precompiled (opforge.builder.pch),
    # as include spellings: "<torch/extension.h>", '"my/all.h"'. Pays off for a
    # build of many .cpp files; two units (the op library's) gain nothing from it.
    pch_headers: tuple[str, ...] = ()
    # The .cpp sources that get ``pch_headers``, where only some should: each
    # one begins with exactly those headers (opforge.builder.pch), and is
    # compiled from a generated file that includes the header, then it. The
    # headers are torch's, found without ``include_dirs``, so one precompiled
    # header serves every folder. Empty: every .cpp source, by ``-include``.
    pch_units: tuple[Path, ...] = ()
    # .cpp sources (a subset of ``sources``) compiled as one translation unit,
    # a generated file that includes each: torch's headers are parsed once for
    # all of them and the inline code they share is compiled once. Names at
    # namespace scope must then be unique across those files.
    unity: tuple[Path, ...] = ()
    # TORCH_EXTENSION_NAME and the library's file stem, where a name is imposed:
    # "_C" for a package's library, which Python imports by calling PyInit__C.
    # Empty: "<name>_<objects key>" (module_name).
    extension_name: str = ""
    # On PyTorch's stable ABI for every torch from this one on ("2.10"; opforge.builder.stable).
    stable: str = ""
    # Flags and include folders of some sources alone (SourceGroup), on top of the ones above.
    groups: tuple[SourceGroup, ...] = ()

    def __post_init__(self) -> None:
        for group in self.groups:
            if stray := [str(s) for s in group.sources if s not in self.sources]:
                raise ValueError(f"{self.name}: a source group names files that are not among its sources: {stray}")
            if merged := [str(s) for s in group.sources if s in self.unity]:
                raise ValueError(f"{self.name}: sources with flags of their own cannot compile in the unity unit: {merged}")

    def source_flags(self) -> dict[Path, SourceFlags]:
        """Each grouped source's own (C++ flags, nvcc flags): its groups' flags,
        then their include folders as ``-I``; a source in no group is not a key."""
        out: dict[Path, SourceFlags] = {}
        for g in self.groups:
            includes = tuple(f"-I{d}" for d in g.include_dirs)
            for s in g.sources:
                cxx, cuda = out.get(s, ((), ()))
                out[s] = ((*cxx, *g.cflags, *includes), (*cuda, *g.cuda_cflags, *includes))
        return out

    def _all_include_dirs(self) -> list[Path]:
        return [*self.include_dirs, *(d for g in self.groups for d in g.include_dirs)]

    def key(self) -> str:
        """The cache key: everything that determines the built library."""
        return self._hash(contents=True)

    def objects_key(self) -> str:
        """Everything but the sources' contents: builds that differ only in
        what the files say share one object directory, so ninja recompiles
        only the files that changed (its depfiles track the headers)."""
        return self._hash(contents=False)

    def sources_digest(self) -> str:
        """The sources' and headers' contents alone: what a prebuilt library
        records, so that an editable install notices edited sources."""
        h = hashlib.sha256()
        # Headers below an include folder as the source walk finds them: build outputs, virtualenvs, tests left out.
        for path in sorted(set(self.sources) | set(headers_under(self._all_include_dirs()))):
            h.update(path.name.encode() + b"\0")
            h.update(path.read_bytes())
        return h.hexdigest()

    def _hash(self, *, contents: bool) -> str:
        h = hashlib.sha256()

        def put(*parts: object) -> None:
            for p in parts:
                h.update(str(p).encode())
                h.update(b"\0")

        if self.stable:
            # One build for every torch from the target on: the key carries the target, not this torch.
            put(_CACHE_FORMAT, self.name, "stable", self.stable)
        else:
            put(_CACHE_FORMAT, self.name, torch.__version__, torch.version.cuda, sys.implementation.cache_tag)
        # The compilers torch will use: another compiler is another library.
        put(*(f"{v}={os.environ.get(v, '')}" for v in ("CXX", "CC", "CUDAHOSTCXX", "CUDA_HOME")))
        put(*self.cflags, "|", *self.cuda_cflags, "|", *self.ldflags, "|", self.with_cuda, *self.cuda_archs, "|", self.python_module)
        # Headers put in front of every unit (-include) change what it compiles; a users' unit gets only
        # the headers it begins with, so with or without them it is the same library: one entry for
        # both (a folder imported, then built by `opforge build`, is found in the cache).
        put(*(() if self.pch_units else self.pch_headers), "|", *(str(u) for u in self.unity))
        if self.extension_name:  # only when set: the keys of every other build stay as they were
            put("extension_name", self.extension_name)
        for source, (cxx, cuda) in sorted(self.source_flags().items()):  # none: the keys stay as they were
            put("source flags", source, *cxx, "|", *cuda)
        if not contents:
            put(*sorted(str(s) for s in self.sources), "|", *sorted(str(d) for d in self._all_include_dirs()))
            return h.hexdigest()
        for path in sorted(set(self.sources) | set(headers_under(self._all_include_dirs()))):
            put(path.name)
            h.update(path.read_bytes())
        return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Library:
    """A built library on disk and how it got there."""

    path: Path
    key: str
    with_cuda: bool
    built_now: bool
    build_seconds: float | None
    # "jit" (built into the cache), "prebuilt" (opforge._C, built by pip install) or
    # "file" (a library built by another route, named by OPFORGE_LIBRARY).
    route: str = "jit"
