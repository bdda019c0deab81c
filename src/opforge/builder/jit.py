"""JIT route: sources -> cached shared library -> loaded into torch.ops.

Wraps ``torch.utils.cpp_extension.load`` where it is weak:

* the cache key is a content hash (sources and headers, flags, torch, CUDA,
  archs, Python ABI), so a changed file rebuilds and nothing else does;
* an advisory ``flock`` on a lock file serialises builders; the kernel drops it
  when a builder dies, so a killed build never leaves a lock that hangs the next
  one (torch's own ``lock`` file in the build directory does);
* a build directory without its completion marker is debris from a failed or
  killed build and is wiped before the next attempt;
* progress goes to stderr while ninja runs, and a failure is reported as the
  compiler's first errors with file and line (``opforge.builder.errors``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from opforge.builder import stable, toolchain
from opforge.builder.child import verify_load
from opforge.builder.errors import BuildError, explain_build_failure, load_reason, sanitizer_note
from opforge.builder.flags import by_compiled, in_torch_ninja_file, torch_cxx_flags
from opforge.builder.pch import Pch, precompiled_header
from opforge.builder.progress import Progress
from opforge.builder.recipe import BuildConfig, Library
from opforge.builder.sources import CUDA_SUFFIXES
from opforge.builder.store import cache_root, exclusive
from opforge.builder.symbols import refuse_clashes, undefined_symbol_error

_MARKER = "COMPLETE.json"


def build_library(cfg: BuildConfig, *, quiet: bool = False) -> Library:
    """Builds ``cfg`` if its cache entry is missing or broken; loads nothing.

    A cache entry ``<name>-<key>`` holds one finished library and its marker.
    Its objects are built in ``<name>-<objects key>.objects``, shared by every
    version of the sources, so changing one op recompiles that op alone; the
    entry's library is a hard link to the object directory's, made after the
    build, so an entry is never rewritten once complete."""
    key = cfg.key()
    root = cache_root()
    entry = root / f"{cfg.name}-{key[:16]}"
    built_now, seconds = False, None
    so = complete_library(entry)
    if so is None:
        objects = root / f"{cfg.name}-{cfg.objects_key()[:16]}.objects"
        # One lock per object directory: it serialises every build that writes there.
        with exclusive(root / f"{objects.name}.lock", quiet=quiet):
            # Another process may have finished it while we waited.
            so = complete_library(entry)
            if so is None:
                name = module_name(cfg)
                seconds = _build(cfg, objects, name, quiet=quiet)
                so = _publish(objects / f"{name}.so", entry, seconds, len(cfg.sources))
                built_now = True
    # The directory's mtime is its last use: `opforge cache clean --older-than` reads it.
    with contextlib.suppress(OSError):
        os.utime(entry)
    return Library(path=so, key=key, with_cuda=cfg.with_cuda, built_now=built_now, build_seconds=seconds)


def cached_path(cfg: BuildConfig) -> Path | None:
    """The library of ``cfg`` when the cache has it complete, else None; builds nothing."""
    return complete_library(cache_root() / f"{cfg.name}-{cfg.key()[:16]}")


def module_name(cfg: BuildConfig) -> str:
    """The library's file stem and TORCH_EXTENSION_NAME (a pybind11 module's
    import name): ``cfg.extension_name`` where set. Stable across source edits:
    a new name would change every compile command and defeat the incremental build."""
    return cfg.extension_name or f"{cfg.name}_{cfg.objects_key()[:16]}"


def load_library(cfg: BuildConfig, *, quiet: bool = False, verify: bool = False) -> Library:
    """Builds ``cfg`` if needed, then loads it into torch.ops (TORCH_LIBRARY registrations run).
    ``verify``: a user's code, whose first load is tried in a new process first
    (``verify_first_load``): a registration error is a BuildError, not the end of this one."""
    lib = build_library(cfg, quiet=quiet)
    check_safe_to_load(lib.path)
    if verify:  # first: what the library does alone, then what it would clash with here
        verify_first_load(cfg, lib.path)
    refuse_clashes(lib.path)
    try:
        torch.ops.load_library(str(lib.path))
    except OSError as exc:
        if sanitizer_note(reason := load_reason(exc)):  # OPFORGE_CXXFLAGS=-fsanitize=...: said, with the way to load it
            raise BuildError(f"opforge: {cfg.name}: built, but loading {lib.path.name} fails: {reason}") from exc
        raise
    return lib


def verify_first_load(cfg: BuildConfig, path: Path, *, module: str = "") -> None:
    """Raises BuildError, in one line naming the source where torch says, when
    ``path`` does not load in a new process (``opforge.builder.child.verify_load``;
    a library that loaded there once is not tried again). An undefined symbol is
    left to the caller's own load, whose error explains it."""
    failure = verify_load(path, module=module, sources=cfg.sources, root=_common_root(cfg.sources))
    if failure is not None and "undefined symbol" not in failure:
        raise BuildError(f"opforge: {cfg.name}: built, but {failure}")


def _common_root(sources: tuple[Path, ...]) -> Path | None:
    try:
        return Path(os.path.commonpath([str(s.parent) for s in sources])) if sources else None
    except ValueError:
        return None


def load_module(cfg: BuildConfig, *, quiet: bool = False, verify: bool = False) -> tuple[types.ModuleType, Library]:
    """Builds a pybind11 extension (``cfg.python_module``) if needed and imports it.

    The module is named by TORCH_EXTENSION_NAME, which the build sets to the
    library's own name, so the PYBIND11_MODULE name and the file always match."""
    if not cfg.python_module:
        raise ValueError(f"{cfg.name}: load_module needs BuildConfig(python_module=True)")
    lib = build_library(cfg, quiet=quiet)
    check_safe_to_load(lib.path)
    name = lib.path.stem
    if name in sys.modules:
        if getattr(sys.modules[name], "__file__", None) == str(lib.path):
            return sys.modules[name], lib
        # The module name outlives source edits (a new one would recompile
        # every file), and pybind11 keeps one module per name in a process:
        # importing the rebuilt file would hand back the old module, old code
        # included. Build the edited sources once more under a name of their
        # own, as torch's load does with name_v1; a new process gets the
        # incrementally built one.
        renamed = dataclasses.replace(cfg, cflags=(*cfg.cflags, f"-DOPFORGE_IN_PROCESS_REBUILD={lib.key[:16]}"))
        return load_module(renamed, quiet=quiet, verify=verify)
    if verify:
        verify_first_load(cfg, lib.path, module=name)
    spec = importlib.util.spec_from_file_location(name, lib.path)
    if spec is None or spec.loader is None:
        raise BuildError(f"opforge: cannot import {lib.path}")
    try:
        # The library is loaded (dlopen) when the module is made: a missing symbol is an ImportError there.
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        if (explained := undefined_symbol_error(cfg.name, exc, (), root=_common_root(cfg.sources), sources=cfg.sources)) is not None:
            raise explained from exc
        raise BuildError(
            f"opforge: built {lib.path.name} but could not import it: {exc}. A pybind11 module must be declared as "
            "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) so that its name matches the file opforge builds"
        ) from exc
    sys.modules[name] = module
    return module, lib


def check_safe_to_load(path: Path, *, in_cache: bool = True, root_ok: bool = False) -> None:
    """Refuses a library another user could have written: loading it runs its code.

    The library and its directory (and, for the cache's own libraries, the
    cache root) must belong to this user and be writable by no one else (the
    cache is created 0700; a shared or loosened one fails here, with the reason).
    ``root_ok``: an installed package may belong to root, as torch's own do."""
    uid = os.getuid()
    for p in (path, path.parent, cache_root()) if in_cache else (path, path.parent):
        st = p.stat()
        if st.st_uid != uid and not (root_ok and st.st_uid == 0):
            fix = "Use a cache of your own: set OPFORGE_CACHE_DIR to a directory you own" if in_cache else f"Fix: chown it to uid {uid}"
            raise BuildError(f"opforge: refusing to load {path}: {p} belongs to uid {st.st_uid}, not to you (uid {uid}). {fix}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BuildError(
                f"opforge: refusing to load {path}: {p} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}), so someone else could have replaced the library. Fix: chmod go-w {p}"
            )


def complete_library(entry: Path) -> Path | None:
    """The library in cache ``entry`` when its marker exists and the file it
    names matches what it recorded; else None.

    The marker names the file: two checkouts of the same sources share the
    entry (its key is their content), but each builds under a file name of its
    own (``module_name``: their object directories differ), and the one that
    comes second must load the first one's file rather than rebuild the entry
    from under a process that loaded it."""
    try:
        meta = json.loads((entry / _MARKER).read_text())
        so = entry / meta["library"]
        if so.parent == entry and so.stat().st_size == meta["size"] and _sha256(so) == meta["sha256"]:
            return so
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(cfg: BuildConfig, objects: Path, so_name: str, *, quiet: bool) -> float:
    """Runs torch's ninja build in the object directory (we hold its lock);
    returns the seconds it took. Failed and killed builds leave objects that
    are reused or, where a compile did not finish, recompiled: ninja logs a
    step only once it completes and treats an output without a log entry as
    out of date."""
    # lazy: import time (torch.utils.cpp_extension, 40 ms; `import opforge` loads this module)
    from torch.utils import cpp_extension

    start = time.perf_counter()
    _check_toolchain(cfg)
    tc = toolchain.resolve(with_cuda=cfg.with_cuda)
    if not quiet:
        for line in tc.notes():
            print(line, file=sys.stderr, flush=True)
    objects.mkdir(mode=0o700, parents=True, exist_ok=True)
    # torch's own lock file: a killed build leaves it, and torch would wait
    # on it forever. Our flock says no one else is in this directory.
    (objects / "lock").unlink(missing_ok=True)
    # Relink into a new file, never into the inode an entry (and perhaps a
    # running process) uses: the linker would truncate it in place.
    (objects / f"{so_name}.so").unlink(missing_ok=True)
    # torch remembers per process what it built under a name and skips the
    # build when the inputs look unchanged.
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None and hasattr(versioner, "entries"):
        versioner.entries.pop(so_name, None)

    with toolchain.applied(tc), _precompiled(cfg, tc.cxx.use, quiet=quiet) as pch:
        sources = _compiled_sources(cfg, objects, pch)
        own_flags = by_compiled(cfg, sources)
        progress = Progress(objects, cfg.name, len(sources), len(cfg.sources), quiet=quiet)
        progress.start()
        if cfg.stable:
            stable.build(cfg, objects, so_name, sources, tc, _pch_flags(cfg, pch), progress, own_flags)
            seconds = time.perf_counter() - start
            progress.stop(ok=True, seconds=seconds)
            _check_shared_libstdcxx(objects / f"{so_name}.so", tc.cxx.use)
            return seconds
        try:
            with _built_not_loaded(cpp_extension), in_torch_ninja_file(cpp_extension, own_flags):
                cpp_extension.load(
                    name=so_name,
                    sources=[str(s) for s in sources],
                    extra_cflags=[*cfg.cflags, *_pch_flags(cfg, pch)],
                    extra_cuda_cflags=list(cfg.cuda_cflags),
                    extra_ldflags=list(cfg.ldflags),
                    extra_include_paths=[str(d) for d in cfg.include_dirs],
                    build_directory=str(objects),
                    with_cuda=cfg.with_cuda,
                    is_python_module=False,
                    verbose=False,
                )
        except RuntimeError as exc:
            progress.stop(ok=False)
            log = objects / "build.log"
            log.write_text(str(exc))
            raise explain_build_failure(cfg.name, str(exc), log) from None
    seconds = time.perf_counter() - start
    progress.stop(ok=True, seconds=seconds)
    _check_shared_libstdcxx(objects / f"{so_name}.so", tc.cxx.use)
    return seconds


@contextlib.contextmanager
def _built_not_loaded(cpp_extension: types.ModuleType) -> Iterator[None]:
    """torch's ``load`` builds, then loads what it built into this process:
    the caller loads it, after its checks (a user's code in a new process
    first), so the load is left out here."""
    original = getattr(cpp_extension, "_import_module_from_library", None)
    if original is None:
        yield
        return
    cpp_extension._import_module_from_library = lambda module_name, path, is_python_module: os.path.join(path, f"{module_name}.so")
    try:
        yield
    finally:
        cpp_extension._import_module_from_library = original


def _compiled_sources(cfg: BuildConfig, objects: Path, pch: Pch | None = None) -> list[Path]:
    """The files ninja compiles: ``cfg.sources`` with the ``cfg.unity`` ones
    replaced by one generated file that includes them, and the ``cfg.pch_units``
    by one each that includes the precompiled header first (written only when
    its text changes: a new mtime would recompile it; ninja's depfile tracks the
    files it includes)."""
    if not cfg.unity:
        return _unique_objects(_pch_wrapped(cfg, objects, pch), objects)
    stray = [u for u in cfg.unity if u not in cfg.sources or u.suffix != ".cpp"]
    if stray:
        raise BuildError(f"opforge: {cfg.name}: unity sources must be .cpp files among its sources, got {[str(u) for u in stray]}")
    unity = objects / f"{cfg.name}_unity.cpp"
    text = "// Generated by opforge: these sources compile as one translation unit.\n"
    text += "".join(f'#include "{u}"\n' for u in cfg.unity)
    _write_if_changed(unity, text)
    return _unique_objects([s for s in cfg.sources if s not in cfg.unity] + [unity], objects)


def _object_name(source: Path) -> str:
    """The object file torch's ninja file gives ``source``: its file name's stem
    alone, so kernels/a/kernel.cu and kernels/b/kernel.cu would both write kernel.cuda.o."""
    return source.stem + (".cuda.o" if source.suffix in CUDA_SUFFIXES else ".o")


# An object file name that ninja's link line and the shell take as one word: torch's ninja file
# writes the objects of the link unescaped, so "my op.o" is two inputs, "my" and "op.o".
_PLAIN_OBJECT = re.compile(r"[A-Za-z0-9_.+-]+")


def _unique_objects(sources: list[Path], objects: Path) -> list[Path]:
    """``sources`` with each one whose object name another shares, or whose
    name holds a space or another character the build file would split at
    (``my op.cpp``), replaced by a generated file named by its path relative
    to the sources' common folder (``a__kernel.cu``; ``my_op.cpp``), which
    includes it: its own object, and compiler errors still name the real file
    and line (the include is by absolute path, so the file's own quoted
    includes resolve beside it as before)."""
    names = [_object_name(s) for s in sources]
    shared = {n for n in names if names.count(n) > 1}
    unplain = {n for n in names if not _PLAIN_OBJECT.fullmatch(n)}
    if not shared and not unplain:
        return sources
    clashing = [s for s, n in zip(sources, names, strict=True) if n in shared]
    base = Path(os.path.commonpath([str(s.parent) for s in clashing])) if clashing else None
    taken = {n for n in names if n not in shared and n not in unplain}
    by_path = objects / "by_path"
    by_path.mkdir(mode=0o700, exist_ok=True)
    out = []
    for s, n in zip(sources, names, strict=True):
        if n not in shared and n not in unplain:
            out.append(s)
            continue
        stem = "__".join(s.relative_to(base).with_suffix("").parts) if base is not None and n in shared else s.stem
        stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", stem)
        wrapper = by_path / f"{stem}{s.suffix}"
        i = 1
        while _object_name(wrapper) in taken:  # a source already called a__kernel.cu
            i += 1
            wrapper = by_path / f"{stem}_{i}{s.suffix}"
        taken.add(_object_name(wrapper))
        if '"' in str(s) or "\n" in str(s):  # an #include "..." cannot name it
            raise BuildError(f"opforge: cannot compile {str(s)!r}: its path holds a double quote or a line break; rename it")
        _write_if_changed(wrapper, f'// Generated by opforge: {s.name} under a name of its own, for its object file.\n#include "{s}"\n')
        out.append(wrapper)
    return out


def _write_if_changed(path: Path, text: str) -> None:
    # A rewrite would give the file a new mtime, and ninja would compile it again.
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _pch_wrapped(cfg: BuildConfig, objects: Path, pch: Pch | None) -> list[Path]:
    """``cfg.sources`` with each of ``cfg.pch_units`` replaced by a generated
    file of its name that includes the precompiled header, then it: the unit
    begins with those very headers, so it compiles as it would without them.
    Under ``objects/pch/``, in the sources' own folder layout, so that two
    units of one name still get an object each."""
    if pch is None or not cfg.pch_units:
        return list(cfg.sources)
    base = Path(os.path.commonpath([str(u.parent) for u in cfg.pch_units]))
    out = []
    for s in cfg.sources:
        if s not in cfg.pch_units:
            out.append(s)
            continue
        wrapper = objects / "pch" / s.relative_to(base)
        wrapper.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        note = f"// Generated by opforge: {s.name} after its precompiled {', '.join(cfg.pch_headers)}.\n"
        _write_if_changed(wrapper, f'{note}#include "{pch.header}"\n#include "{s}"\n')
        out.append(wrapper)
    return out


def _pch_flags(cfg: BuildConfig, pch: Pch | None) -> list[str]:
    """What the compile lines gain: ``-include`` of the header for every .cpp
    source, or only the warning where some units include it themselves (GCC
    says why it passes over a header it cannot use, then parses the real ones)."""
    if pch is None:
        return []
    return ["-Winvalid-pch"] if cfg.pch_units else pch.flags()


@contextlib.contextmanager
def _precompiled(cfg: BuildConfig, compiler: str, *, quiet: bool) -> Iterator[Pch | None]:
    """``cfg.pch_headers`` precompiled (None without them, or where it cannot
    be), the header kept in the cache meanwhile. Users' units take torch's
    headers from torch's own paths: their include folders stay out of the
    header's flags, and so out of its key, and one header serves every folder
    (the folder of opforge's kit stays in, where the header begins with it)."""
    if not cfg.pch_headers or os.environ.get("OPFORGE_PCH", "1") == "0":
        yield None
        return
    # Of a users' build, only the folders a quoted header (opforge's kit) is found in.
    quoted = [h.strip('"') for h in cfg.pch_headers if h.startswith('"')]
    kept = [d for d in cfg.include_dirs if not cfg.pch_units or any((d / q).is_file() for q in quoted)]
    includes = [f"-I{d}" for d in kept]
    # An in-process rebuild's marker names no header: a header of its own would cost a full parse.
    cflags = [f for f in cfg.cflags if not f.startswith("-DOPFORGE_IN_PROCESS_REBUILD=")]
    with precompiled_header(cfg.pch_headers, [*includes, *torch_cxx_flags(), *cflags], compiler=compiler, quiet=quiet) as pch:
        yield pch


def _publish(built: Path, entry: Path, seconds: float, n_sources: int) -> Path:
    """Makes ``entry`` hold ``built`` (a hard link: the same inode, so a process
    that loaded the object directory's file and then loads the entry's gets
    the library it already has) and, last, its completion marker; returns the
    entry's library. Under the entry's own lock: a build of the same sources
    from another checkout (another object directory, so another lock) may
    finish first, and then its complete entry is kept and returned."""
    with exclusive(entry.with_name(f"{entry.name}.lock"), quiet=True):
        if (done := complete_library(entry)) is not None:
            return done
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(mode=0o700, parents=True)
        so = entry / built.name
        try:
            os.link(built, so)
        except OSError:  # a filesystem without hard links
            shutil.copy2(built, so)
        marker = {"library": so.name, "size": so.stat().st_size, "sha256": _sha256(so), "seconds": round(seconds, 2), "sources": n_sources}
        tmp = entry / (_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, entry / _MARKER)
        return so


def _check_toolchain(cfg: BuildConfig) -> None:
    """Clear errors for the missing tools torch would report obscurely."""
    if shutil.which("ninja") is None:
        try:  # the PyPI 'ninja' package, installed but its venv not activated
            # lazy: optional dependency (the PyPI ninja package)
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise BuildError("opforge: ninja is not installed; `pip install ninja` (or your system's package)") from None
    cxx = toolchain.configured_cxx()
    if shutil.which(cxx) is None:
        raise BuildError(f"opforge: no C++ compiler: '{cxx}' is not on PATH (set CXX or install g++)")
    if cfg.with_cuda and cfg.stable:
        toolchain.check_stable_nvcc()
    elif cfg.with_cuda:
        # lazy: import time (torch.utils.cpp_extension, 40 ms; `import opforge` loads this module)
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = Path(CUDA_HOME or "") / "bin" / "nvcc"
        if not CUDA_HOME or not nvcc.exists():
            raise BuildError(f"opforge: CUDA kernels were asked for but nvcc was not found (CUDA_HOME={CUDA_HOME}; set CUDA_HOME)")
        toolchain.check_nvcc(nvcc, torch.version.cuda)


def _check_shared_libstdcxx(so: Path, compiler: str) -> None:
    """Refuses a library that carries its own copy of libstdc++, should a
    compiler slip past the toolchain's probe (opforge.builder.toolchain): torch
    and the op would hold two copies of the iostream and locale machinery, and
    the first error message that prints a number segfaults."""
    if toolchain.links_libstdcxx_statically(so):
        shutil.rmtree(so.parent, ignore_errors=True)
        raise BuildError(
            f"opforge: the C++ compiler '{compiler}' linked libstdc++ statically into {so.name}. "
            "Torch loads the shared libstdc++; two copies in one process crash on the first error message. "
            "Build with a compiler that links libstdc++ dynamically, e.g. `CXX=g++ CC=gcc CUDAHOSTCXX=g++`."
        )
