"""Two more ways into the one JIT engine (``opforge.builder.jit``): operators given
as strings (``inline``, torch's ``load_inline`` the opforge way) and a folder of
tutorial-style pybind11 code (``build_pybind_folder``).

Both end in a ``BuildConfig`` built by ``build_library``, so they share its cache
(``OPFORGE_CACHE_DIR``), content-hash key, flock, progress and compiler-error
reporting. Neither calls ``torch.utils.cpp_extension.load_inline``: its build
directory is keyed by name alone, so two processes with different strings under
one name overwrite each other's files, and a killed build leaves a lock behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from opforge.builder.archs import cuda_archs, gencode_flags
from opforge.builder.config import env_cxxflags, want_cuda
from opforge.builder.errors import BuildError
from opforge.builder.jit import BuildConfig, Library, cache_root, load_library, load_module
from opforge.builder.pch import with_torch_pch
from opforge.builder.source_text import pybind_modules, strip_comments
from opforge.builder.sources import walk
from opforge.builder.symbols import undefined_symbol_error

__all__ = [
    "build_pybind_folder",
    "inline",
    "inline_config",
    "pybind_folder_config",
    "pybind_instead_of_torch_library",
]

Functions = str | Sequence[str] | Mapping[str, str]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# What torch's load_inline prepends, so that strings written for it build here unchanged.
_CPP_PRELUDE = ("#include <torch/extension.h>",)
_CUDA_PRELUDE = ("#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>")


def inline(
    name: str,
    cpp: str = "",
    cuda: str = "",
    functions: Functions | None = None,
    *,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    with_cuda: bool | None = None,
    implicit_headers: bool = True,
    verbose: bool = False,
    quiet: bool = False,
) -> types.ModuleType | Library:
    """Builds C++ (and CUDA) source given as strings, like torch's ``load_inline``.

    With ``functions`` (a name, a list of names, or a dict name -> docstring),
    opforge writes the pybind11 bindings (``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``)
    after ``cpp`` and returns the imported Python module. With ``functions=None``
    the sources register operators themselves (``TORCH_LIBRARY``); the library is
    loaded into ``torch.ops`` and its ``Library`` returned.

    ``cpp`` is prefixed with ``#include <torch/extension.h>`` and ``cuda`` with
    ``torch/types.h``, ``cuda.h`` and ``cuda_runtime.h``, as torch does;
    ``implicit_headers=False`` prefixes nothing (a TORCH_LIBRARY source that
    includes only ``<torch/library.h>`` compiles in a fifth of the time; with
    ``functions`` the source then includes ``<torch/extension.h>`` itself).
    Compiler errors name the generated file, with line numbers counted in your
    string. Identical strings are found in the cache; changed ones rebuild.
    The torch headers the C++ source begins with (the prelude's, or the
    string's own) are precompiled once and shared through the cache
    (``opforge.builder.pch``; ``OPFORGE_PCH=0`` turns it off).
    ``verbose`` also says where the sources went and which library was loaded;
    ``quiet`` silences the build progress.
    """
    cfg = inline_config(
        name,
        cpp,
        cuda,
        functions,
        extra_cflags=extra_cflags,
        extra_cuda_cflags=extra_cuda_cflags,
        with_cuda=with_cuda,
        implicit_headers=implicit_headers,
    )
    if verbose:
        print(f"opforge: inline({name!r}) sources in {cfg.sources[0].parent}", file=sys.stderr, flush=True)
    module, lib = _load(cfg, quiet=quiet)
    if verbose:
        how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "from the cache"
        print(f"opforge: inline({name!r}) loaded {lib.path} ({how})", file=sys.stderr, flush=True)
    return module if module is not None else lib


def inline_config(
    name: str,
    cpp: str = "",
    cuda: str = "",
    functions: Functions | None = None,
    *,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    with_cuda: bool | None = None,
    implicit_headers: bool = True,
) -> BuildConfig:
    """``inline``'s build without the build: checks the arguments, writes the
    strings to ``cache_root()/inline/<name>-<hash>/`` and returns the BuildConfig."""
    _check_identifier(name, "name")
    _check_flags(extra_cflags, extra_cuda_cflags)
    docs = _function_docs(functions)
    if not cpp.strip() and not cuda.strip() and docs is None:
        raise ValueError(f"opforge: inline({name!r}): no source, pass cpp= or cuda=")
    cuda_on = bool(cuda.strip()) if with_cuda is None else with_cuda
    if cuda.strip() and not cuda_on:
        raise ValueError(f"opforge: inline({name!r}): cuda source given with with_cuda=False; leave out one of the two")
    if cuda_on and torch.version.cuda is None:
        why = "CUDA source was given" if cuda.strip() else "with_cuda=True"
        raise BuildError(
            f"opforge: inline({name!r}) cannot be built: {why}, but this torch ({torch.__version__}) is a CPU build "
            "(torch.version.cuda is None). Install a CUDA build of torch, or leave out the CUDA part"
        )
    for text, what in ((cpp, "cpp"), (cuda, "cuda")):
        found = pybind_modules(text)
        if found and docs is not None:
            raise BuildError(
                f"opforge: inline({name!r}): the {what} source has its own PYBIND11_MODULE (line {found[0][2]}) and functions= asks "
                "opforge to write one; one module has one PYBIND11_MODULE, so drop it or leave out functions="
            )
        if found:
            raise BuildError(
                f"opforge: inline({name!r}): the {what} source has a PYBIND11_MODULE (line {found[0][2]}), but functions=None builds a "
                "TORCH_LIBRARY library for torch.ops. Pass functions=[...] and drop the PYBIND11_MODULE block (opforge writes it), "
                "or build the code as a folder with opforge.builder.inline.build_pybind_folder"
            )

    files: dict[str, str] = {}
    if cpp.strip() or docs is not None:
        bindings = _bindings(docs) if docs is not None else []
        files[f"{name}.cpp"] = _generated(name, "cpp", cpp, _CPP_PRELUDE if implicit_headers else (), bindings)
    if cuda.strip():
        files[f"{name}.cu"] = _generated(name, "cuda", cuda, _CUDA_PRELUDE if implicit_headers else (), [])
    directory = _write_sources(name, files)

    env_host, env_both = env_cxxflags()  # OPFORGE_CXXFLAGS, after what the call passes
    cflags = ["-O3", *extra_cflags, *env_host]
    cuda_cflags: list[str] = []
    archs: tuple[str, ...] = ()
    if cuda_on:
        archs = cuda_archs()
        cuda_cflags = ["-O3", *gencode_flags(archs), *extra_cuda_cflags, *env_both]
    cfg = BuildConfig(
        name=name,
        sources=tuple(directory / f for f in files),
        include_dirs=(),
        cflags=tuple(cflags),
        cuda_cflags=tuple(cuda_cflags),
        with_cuda=cuda_on,
        cuda_archs=archs,
        python_module=docs is not None,
    )
    # The prelude's torch/extension.h is most of a string's compile time: precompiled once, shared
    # with every other string and folder that begins with the same headers, and with each edit's rebuild.
    return with_torch_pch(cfg)[0]


def build_pybind_folder(
    path: str | os.PathLike[str],
    name: str | None = None,
    *,
    with_cuda: bool | None = None,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    quiet: bool = False,
) -> types.ModuleType:
    """Builds a folder of tutorial-style pybind11 code (``add2.h``, ``add2.cpp`` with
    ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``, ``add2.cu``) and imports it.

    Every C++ source in it and its subfolders (``opforge.builder.sources.walk``)
    is built, and every ``.cu`` when CUDA is (``with_cuda``,
    default: the folder has .cu files and opforge would build CUDA, see
    ``opforge.builder.want_cuda``); ``OPFORGE_WITH_CUDA`` is defined then, so the
    .cpp can hold a CPU fallback. ``name`` defaults to the folder's name.
    The torch headers its sources begin with are precompiled once and shared
    through the cache (``opforge.builder.pch``).
    """
    cfg = pybind_folder_config(path, name, with_cuda=with_cuda, extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags)
    tree = walk(Path(path))
    module, _ = _load(cfg, quiet=quiet, left_out=() if cfg.with_cuda else tree.cuda, root=tree.root)
    assert module is not None
    return module


def folder_module_name(folder: Path) -> str:
    """The module name ``opforge build FOLDER`` gives a pybind11 folder: the folder's name, less a
    ``-<version>`` suffix (a source distribution unpacks into NAME-VERSION), with every character a
    C identifier cannot hold as ``_``."""
    name = re.sub(r"-v?\d+(\.\w+)*$", "", folder.resolve().name)
    name = re.sub(r"\W", "_", name, flags=re.ASCII)
    return name if _IDENTIFIER.fullmatch(name) else f"_{name}"


def pybind_folder_config(
    path: str | os.PathLike[str],
    name: str | None = None,
    *,
    with_cuda: bool | None = None,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
) -> BuildConfig:
    """``build_pybind_folder``'s build without the build: finds the sources and
    checks their PYBIND11_MODULE before any compiler runs."""
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise ValueError(f"opforge: {path} is not a folder")
    if name is None:
        if not _IDENTIFIER.fullmatch(folder.name):
            raise ValueError(f"opforge: the folder name {folder.name!r} is not a C identifier; pass name=, e.g. name='my_op'")
        name = folder.name
    _check_identifier(name, "name")
    _check_flags(extra_cflags, extra_cuda_cflags)
    tree = walk(folder)
    has_cu = bool(tree.cuda)
    if with_cuda is None:
        cuda_on = has_cu and want_cuda()
    elif with_cuda and torch.version.cuda is None:
        raise BuildError(
            f"opforge: {name}: with_cuda=True, but this torch ({torch.__version__}) is a CPU build (torch.version.cuda is None)"
        )
    else:
        cuda_on = with_cuda
    sources = [*tree.cpp, *(tree.cuda if cuda_on else ())]
    if not tree.cpp:
        raise BuildError(f"opforge: {name}: no C++ (.cpp, .cc, .cxx) file in {folder} or its subfolders")
    _check_pybind_module(name, folder, [*sources, *tree.headers()])

    env_host, env_both = env_cxxflags()  # OPFORGE_CXXFLAGS, after what the call passes
    cflags = ["-O3", *extra_cflags, *env_host]
    cuda_cflags: list[str] = []
    archs: tuple[str, ...] = ()
    if cuda_on:
        archs = cuda_archs()
        cflags.append("-DOPFORGE_WITH_CUDA")
        cuda_cflags = ["-O3", "-DOPFORGE_WITH_CUDA", *gencode_flags(archs), *extra_cuda_cflags, *env_both]
    cfg = BuildConfig(
        name=name,
        sources=tuple(sources),
        include_dirs=tree.include_dirs,
        cflags=tuple(cflags),
        cuda_cflags=tuple(cuda_cflags),
        with_cuda=cuda_on,
        cuda_archs=archs,
        python_module=True,
    )
    # torch/extension.h, which such a module includes, is most of each file's compile time.
    return with_torch_pch(cfg)[0]


def _check_identifier(value: str, what: str) -> None:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ValueError(f"opforge: {what} must be a C identifier (letters, digits, '_', not starting with a digit), got {value!r}")


def _check_flags(*flag_lists: Sequence[str]) -> None:
    for flags in flag_lists:
        if isinstance(flags, str):
            # A str is a sequence too: "-O2" would become the flags "-", "O", "2".
            raise TypeError(f"opforge: extra flags are a list of strings, got the string {flags!r}; write [{flags!r}]")


def _function_docs(functions: Functions | None) -> dict[str, str] | None:
    if functions is None:
        return None
    if isinstance(functions, str):
        docs = {functions: functions}
    elif isinstance(functions, Mapping):
        docs = dict(functions)
    elif isinstance(functions, Sequence):
        docs = {f: f for f in functions}
    else:
        raise TypeError(f"opforge: functions must be a name, a list of names or a dict name -> docstring, got {type(functions).__name__}")
    for f, doc in docs.items():
        _check_identifier(f, "each function name")
        if not isinstance(doc, str):
            raise TypeError(f"opforge: the docstring of {f} must be a str, got {type(doc).__name__}")
    return docs


def _c_string(text: str) -> str:
    """A C++ string literal holding ``text`` exactly: anything that is not plain
    printable ASCII becomes an octal escape of its UTF-8 bytes."""
    out = []
    for b in text.encode():
        out.append(chr(b) if 32 <= b < 127 and b not in b'"\\?' else f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _bindings(docs: Mapping[str, str]) -> list[str]:
    # wrap_pybind_function, as torch's load_inline: torch's error and warning handling, so that
    # TORCH_CHECK_VALUE raises ValueError and TORCH_WARN a Python warning, as in torch's own functions.
    lines = ["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"]
    lines += [f'  m.def("{f}", torch::wrap_pybind_function({f}), {_c_string(doc)});' for f, doc in docs.items()]
    lines.append("}")
    return lines


def _generated(name: str, what: str, body: str, prelude: Sequence[str], after: Sequence[str]) -> str:
    # "#line 1": compiler errors count lines in the user's string, which is what they can see.
    lines = [f"// Generated by opforge.builder.inline from the {what} string of inline({name!r}).", *prelude, "#line 1"]
    lines += body.splitlines()
    if after:
        # Back to the file's own numbering for what opforge wrote.
        lines.append(f"#line {len(lines) + 2}")
        lines += after
    return "\n".join(lines) + "\n"


def _write_sources(name: str, files: Mapping[str, str]) -> Path:
    """Writes the generated files to a directory named by their content: the same
    strings find the same files (and so the same cache entry), other strings get
    their own, and concurrent writers of one directory write the same bytes."""
    h = hashlib.sha256()
    for fname, text in sorted(files.items()):
        h.update(fname.encode() + b"\0" + text.encode() + b"\0")
    directory = cache_root() / "inline" / f"{name}-{h.hexdigest()[:16]}"
    directory.parent.mkdir(mode=0o700, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    for fname, text in files.items():
        target = directory / fname
        try:
            if target.read_text() == text:
                continue  # rewriting would change its mtime, and ninja would recompile it
        except OSError:
            pass
        tmp = directory / f".{fname}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    # The folder's mtime is its last use, for `opforge cache clean --older-than` (its files keep theirs: ninja reads them).
    with contextlib.suppress(OSError):
        os.utime(directory)
    return directory


def pybind_instead_of_torch_library(folder: Path) -> str:
    """What to do, when ``folder``'s files declare a pybind11 module and none
    mentions TORCH_LIBRARY: built for torch.ops (which never imports a Python
    module) it would load and register nothing. "" otherwise."""
    tree = walk(folder)
    files = [*tree.sources, *tree.headers()]
    texts = {f: strip_comments(f.read_text(errors="replace")) for f in files}
    if any("TORCH_LIBRARY" in t or "RegisterOperators" in t for t in texts.values()):
        return ""
    found = [(f, *m) for f in files for m in pybind_modules(texts[f])]
    if not found:
        return ""
    f, module, var, line = found[0]
    where = f"{tree.rel(f)}:{line}"
    if module != "TORCH_EXTENSION_NAME":
        return (
            f"{where} declares PYBIND11_MODULE({module}, {var}), a Python module named {module!r} that nothing imports, and no "
            "source registers an operator with TORCH_LIBRARY. For torch.ops, register the operators with "
            "TORCH_LIBRARY(<namespace>, m) { m.def(...); } (their kernels with TORCH_LIBRARY_IMPL); to keep the pybind11 module, "
            f"write PYBIND11_MODULE(TORCH_EXTENSION_NAME, {var}) and build with --route pybind"
        )
    return (
        f"{where} declares a pybind11 module and no source registers an operator with TORCH_LIBRARY: build it with "
        "--route pybind, or register the operators with TORCH_LIBRARY(<namespace>, m) { m.def(...); } for torch.ops"
    )


def _check_pybind_module(name: str, folder: Path, files: Sequence[Path]) -> None:
    """The module must be declared once, as PYBIND11_MODULE(TORCH_EXTENSION_NAME, m).

    opforge names the built file ``<name>_<16 hex>.so`` and Python imports it by
    calling ``PyInit_<that name>``; a hard-coded name defines another function,
    and the import fails after a full build with a message about neither."""
    found = [(f, *m) for f in files for m in pybind_modules(f.read_text(errors="replace"))]
    for f, module, var, line in found:
        if module != "TORCH_EXTENSION_NAME":
            raise BuildError(
                f"opforge: {name}: PYBIND11_MODULE({module}, {var}) in {f.name}: the module name must be TORCH_EXTENSION_NAME "
                f"(opforge sets it to the built file's name); write PYBIND11_MODULE(TORCH_EXTENSION_NAME, {var}) ({f}:{line})"
            )
    if not found:
        raise BuildError(
            f"opforge: {name}: no PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) in {folder}, so there is no Python module to import. "
            "Add one, or load a folder of TORCH_LIBRARY operators with opforge.builder.load_library"
        )
    if len(found) > 1:
        where = ", ".join(f"{f.name}:{line}" for f, _, _, line in found)
        raise BuildError(f"opforge: {name}: PYBIND11_MODULE appears {len(found)} times ({where}); one module has exactly one")


def _load(
    cfg: BuildConfig, *, quiet: bool, left_out: Sequence[Path] = (), root: Path | None = None
) -> tuple[types.ModuleType | None, Library]:
    """load_module or load_library, with an undefined symbol explained."""
    try:
        if not cfg.python_module:
            return None, load_library(cfg, quiet=quiet, verify=True)
        module, lib = load_module(cfg, quiet=quiet, verify=True)
    except (BuildError, OSError) as exc:
        # Without this, load_module blames the PYBIND11_MODULE name, or torch's loader names only the file.
        explained = undefined_symbol_error(cfg.name, exc, left_out, root=root, sources=cfg.sources)
        if explained is None:
            raise
        raise explained from exc
    return module, lib
