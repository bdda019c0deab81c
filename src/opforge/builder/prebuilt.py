"""Loading a library built elsewhere (CMake, setuptools, another machine) into
torch.ops, with the loader's errors turned into causes and fixes; and the
choice between a package's prebuilt library and a JIT build.

A prebuilt library carries a build record (``_C.build.json``, written by
opforge.builder.setuptools_ext). A library on PyTorch's stable ABI
(``_C.abi3.so``) fits every torch from the one it targets on, with or
without CUDA, under any Python; any other library fits only the torch, CUDA
and Python it was built for. Either must come from the sources as they are
now, with CUDA kernels for the GPUs here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from opforge import nvml
from opforge.builder.archs import arch_covered
from opforge.builder.config import library_config, want_cuda
from opforge.builder.errors import BuildError, load_reason, runtime_not_first, sanitizer_note
from opforge.builder.jit import BuildConfig, Library, check_safe_to_load, load_library
from opforge.builder.stable import parse_target
from opforge.builder.symbols import refuse_clashes, torch_library_registrations, undefined_symbol_error
from opforge.elf_symbols import ElfError, check_complete, demangle, read_dynamic_symbols

#: ``OPFORGE_LIBRARY``: auto (the prebuilt library when it fits, else JIT), prebuilt, jit;
#: or the path of a library built by another route (CMake), loaded as opforge's own.
MODES = ("auto", "prebuilt", "jit")
#: A stable-ABI library's suffix, whatever the Python: ``_C.abi3.so``.
STABLE_SUFFIX = ".abi3.so"


def explain_load_error(path: Path, message: str) -> str:
    """The cause and the fix behind a dynamic loader's message, or "" if unknown."""
    if re.search(r"lib(c10|torch\w*)\.so", message) and "cannot open shared object file" in message:
        return (
            f"{path.name} needs torch's own libraries (libc10.so, libtorch*.so), which are found only once torch is "
            "imported: `import torch` before loading it (opforge.load_library does), or build it with an rpath to torch/lib"
        )
    if "undefined symbol" in message and not sanitizer_note(message):  # a sanitizer's runtime: load_reason says so
        mangled = message.rsplit("undefined symbol:", 1)[-1].strip().split(",")[0].strip()
        symbol = demangle([mangled]).get(mangled, mangled)
        if not symbol.startswith(("c10::", "at::", "torch::", "caffe2::", "_ZN3c10", "_ZN2at", "_ZN5torch")):
            return str(undefined_symbol_error(path.name, message, ())).removeprefix("opforge: ")
        return (
            f"{path.name} was built against another torch (or another C++ ABI, _GLIBCXX_USE_CXX11_ABI) than this "
            f"process's torch: the symbol {symbol} is missing. Rebuild it with this torch; opforge's JIT cache keys on the "
            "torch version and rebuilds by itself"
        )
    if "wrong ELF class" in message or "invalid ELF header" in message:
        return f"{path.name} is not a shared library for this machine (another architecture, or a truncated file): rebuild it"
    return ""


def check_mappable(path: Path) -> None:
    """Raises BuildError for a file that the dynamic loader would map but that
    is cut short: loading it would end the process with SIGBUS, not an error."""
    try:
        check_complete(path)
    except ElfError as exc:
        raise BuildError(f"opforge: could not load {path}: {exc}; rebuild it (or copy it again)") from None


def load_library_file(path: str | Path) -> Path:
    """Loads a TORCH_LIBRARY shared library built by any route into torch.ops.

    It must belong to this user and be writable by no one else, and register
    no operator this process has already (a second copy of a library, or one
    built by another route, would abort it); loader errors come back as a
    BuildError naming the cause and the fix."""
    p = Path(path).resolve()
    if not p.is_file():
        raise BuildError(f"opforge: no library at {p}")
    check_safe_to_load(p, in_cache=False)
    check_mappable(p)
    with contextlib.suppress(ElfError):  # unreadable: the loader says why
        if note := runtime_not_first(read_dynamic_symbols(p, reader="elf").needed):
            raise BuildError(f"opforge: could not load {p}: {note}")
    refuse_clashes(p)
    try:
        torch.ops.load_library(str(p))
    except OSError as exc:
        reason = load_reason(exc)
        why = explain_load_error(p, reason)
        raise BuildError(f"opforge: could not load {p}: {reason}" + (f"\n{why}" if why else "")) from exc
    return p


def prebuilt_path() -> Path:
    """Where ``pip install`` puts the op library: ``opforge/_C.abi3.so`` (on
    the stable ABI, as opforge's own now is), else ``opforge/_C<this Python's
    suffix>`` (a library for one torch and Python); the first when neither is there."""
    here = Path(__file__).resolve().parent.parent
    candidates = (here / f"_C{STABLE_SUFFIX}", here / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    return next((p for p in candidates if p.is_file()), candidates[0])


def library_mode() -> str:
    """One of MODES, or "file" when ``OPFORGE_LIBRARY`` names a library (``library_file``)."""
    raw = os.environ.get("OPFORGE_LIBRARY", "auto").strip()
    mode = raw.lower() or "auto"
    if mode in MODES:
        return mode
    if "/" in raw or raw.endswith(".so"):
        return "file"
    raise BuildError(
        f"opforge: OPFORGE_LIBRARY={raw!r} is not one of {', '.join(MODES)}, nor the path of an op library "
        "(such as build/libopforge_ops.so)"
    )


def library_file() -> Path | None:
    """The library ``OPFORGE_LIBRARY`` names for opforge's own operators, or None."""
    return Path(os.environ["OPFORGE_LIBRARY"].strip()).expanduser().resolve() if library_mode() == "file" else None


#: A package's sources as a build, given whether CUDA kernels are wanted (None: the default).
SourcesConfig = Callable[[bool | None], BuildConfig]


def prebuilt_fits(so: Path, sources: SourcesConfig | None) -> tuple[bool, str]:
    """Whether a prebuilt library (``so``, its build record ``_C.build.json``
    beside it) fits this process, and why in words: a stable-ABI library
    (its record names the torch it targets) fits every torch from that one
    on, any CUDA and any Python; any other was built for this torch, CUDA and
    Python. Either must come from ``sources`` as they are now (an editable
    install whose sources were edited since must rebuild; None: not checked),
    with CUDA kernels for every GPU here when this machine could build them."""
    if not so.is_file():
        return False, "no prebuilt library (it is built by `pip install --no-build-isolation .`)"
    record_path = so.with_name("_C.build.json")
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        return False, f"the prebuilt {so.name} has no readable build record {record_path.name} ({exc})"
    target = record.get("stable")
    if target:
        ok, why = _fits_torch(so, str(target), torch.__version__)
        if not ok:
            return False, why
    else:
        for field, here in (("torch", torch.__version__), ("cuda", torch.version.cuda), ("python", sys.implementation.cache_tag)):
            if record.get(field) != here:
                return False, f"the prebuilt {so.name} was built for {field} {record.get(field)}, this is {here}"
    with_cuda = bool(record.get("with_cuda"))
    if sources is not None and record.get("sources_digest") != sources(with_cuda).sources_digest():
        return False, f"the sources changed since {so.name} was built (an editable install): the JIT route builds them"
    # Only where the JIT route would build CUDA kernels: a package without them (`opforge new --no-cuda`)
    # would build the same CPU library again.
    if not with_cuda and want_cuda(stable=bool(target)) and _gpu_capabilities() and (sources is None or sources(None).with_cuda):
        return False, f"the prebuilt {so.name} has no CUDA kernels, and this machine has a GPU and nvcc: the JIT route builds them"
    if with_cuda:
        built = tuple(record.get("cuda_archs", ()))
        missing = sorted(c for c in _gpu_capabilities() if not arch_covered(c, built))
        if missing:
            return False, f"the prebuilt {so.name} has kernels for sm {', '.join(built)}, not for this GPU's {', '.join(missing)}"
    what = f"CUDA kernels for sm {', '.join(record.get('cuda_archs', []))}" if with_cuda else "CPU kernels only"
    if target:
        return True, f"prebuilt {so.name} (stable ABI: torch {target} and later, this is {torch.__version__}; {what})"
    return True, f"prebuilt {so.name} (torch {record['torch']}, {what})"


def _fits_torch(so: Path, target: str, version: str) -> tuple[bool, str]:
    """Whether torch ``version`` is the stable-ABI ``target`` or newer, by major.minor."""
    try:
        wanted = parse_target(target)
    except ValueError:
        return False, f"the build record of the prebuilt {so.name} names no torch version it targets (stable: {target!r})"
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return False, f"this torch's version {version!r} cannot be compared with the torch {target} the prebuilt {so.name} targets"
    if (int(m[1]), int(m[2])) < wanted:
        return False, f"the prebuilt {so.name} is on the stable ABI of torch {target} and later, this is torch {version}"
    return True, ""


def choose_prebuilt() -> tuple[Path | None, str]:
    """opforge's own prebuilt library if it fits (``prebuilt_fits``), else None; the reason, in words."""
    mode = library_mode()
    if mode in ("jit", "file"):
        return None, f"OPFORGE_LIBRARY={os.environ['OPFORGE_LIBRARY'].strip()}"
    so = prebuilt_path()
    ok, why = prebuilt_fits(so, lambda cuda: library_config(with_cuda=cuda))
    return (so if ok else None), why


def _gpu_capabilities() -> set[str]:
    found = nvml.query()
    return {g.capability for g in found[0]} if found else set()


_covered = arch_covered  # the name older callers and tests use


def load_prebuilt(so: Path) -> Library:
    """Loads a prebuilt library into torch.ops (an installed package's may belong to root)."""
    check_safe_to_load(so, in_cache=False, root_ok=True)
    check_mappable(so)
    torch.ops.load_library(str(so))
    record = json.loads(so.with_name("_C.build.json").read_text())
    return Library(
        path=so, key=record["sources_digest"], with_cuda=bool(record["with_cuda"]), built_now=False, build_seconds=None, route="prebuilt"
    )


def load_op_library() -> Library:
    """opforge's op library: the one ``OPFORGE_LIBRARY`` names, else the
    prebuilt one when it fits, else the JIT build."""
    named = library_file()
    if named is not None:
        return load_named_library(named)
    return load_package_library(prebuilt_path(), lambda cuda: library_config(with_cuda=cuda), what="opforge")


def load_named_library(path: Path) -> Library:
    """A library of opforge's operators built by another route (CMake), as
    ``OPFORGE_LIBRARY=<path>`` asks; with CUDA kernels if it registered any."""
    if not path.is_file():
        raise BuildError(f"opforge: OPFORGE_LIBRARY={path} names no file; build it (CMake: build/libopforge_ops.so) or unset it")
    regs = torch_library_registrations(path)
    if regs is not None and "opforge" not in regs:
        raise _no_operators(path, f"it registers {', '.join(f'{ns}::' for ns in sorted(regs)) or 'no operators'}")
    p = load_library_file(path)
    ops = [q for q in torch._C._dispatch_get_all_op_names() if q.startswith("opforge::")]
    if not ops:
        raise _no_operators(path, "it loaded, and no opforge:: operator is defined")
    with_cuda = any(torch._C._dispatch_has_kernel_for_dispatch_key(q, "CUDA") for q in ops)
    key = hashlib.sha256(p.read_bytes()).hexdigest()
    return Library(path=p, key=key, with_cuda=with_cuda, built_now=False, build_seconds=None, route="file")


def _no_operators(path: Path, found: str) -> BuildError:
    return BuildError(
        f"opforge: OPFORGE_LIBRARY={path} registers no opforge operators ({found}): it names opforge's own op library, "
        "a build of opforge's sources (CMake: build/libopforge_ops.so); unset it, or load another library with opforge.load_library"
    )


def load_package_library(so: Path, sources: SourcesConfig | None, *, what: str) -> Library:
    """A package's op library, opforge's own or one of ``opforge new``'s: the
    prebuilt ``so`` when it fits (``prebuilt_fits``; ``OPFORGE_LIBRARY``
    forces either way), else the JIT build of ``sources(None)``. A path in
    ``OPFORGE_LIBRARY`` names opforge's own library: a package chooses as in auto."""
    mode = library_mode()
    ok, why = (False, "OPFORGE_LIBRARY=jit") if mode == "jit" else prebuilt_fits(so, sources)
    if ok:
        return load_prebuilt(so)
    if mode == "prebuilt":
        raise BuildError(f"{what}: OPFORGE_LIBRARY=prebuilt, but {why}")
    if sources is None:
        raise BuildError(f"{what}: {why}, and no sources to build it from")
    return load_library(sources(None))


__all__ = [
    "MODES",
    "STABLE_SUFFIX",
    "SourcesConfig",
    "check_mappable",
    "choose_prebuilt",
    "explain_load_error",
    "library_file",
    "library_mode",
    "load_library_file",
    "load_named_library",
    "load_op_library",
    "load_package_library",
    "load_prebuilt",
    "prebuilt_fits",
    "prebuilt_path",
]
