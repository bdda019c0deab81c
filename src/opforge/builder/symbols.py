"""A built library's symbols: what a missing one means in the user's words, and
what the library registers with torch, read before it loads.

``undefined_symbol_error``: a library that would not load for a missing symbol, said in the user's
words: the symbol demangled, the sources that call it, and the source that
defines it where the build left that one out.

``refuse_clashes``: what a TORCH_LIBRARY library registers when it loads, read from
the file before loading it. Its registrations run in static initialisers: an operator defined twice (a
second copy of a library, or two builds of one by different routes) throws
from one, which no caller can catch, and the process aborts. So the clash is
found first, from the library's symbol table (the static objects that
``TORCH_LIBRARY``, ``TORCH_LIBRARY_FRAGMENT`` and ``TORCH_LIBRARY_IMPL``
define, and their ``STABLE_`` forms) and its schema strings, and refused
with a message instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.library

from opforge.builder.errors import BuildError, sanitizer_note
from opforge.builder.flags import build_cuda_flag
from opforge.builder.source_text import strip_comments
from opforge.elf_symbols import ElfError, is_elf, symbol_table_names

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def undefined_symbol_error(
    name: str,
    failure: BaseException | str,
    left_out: Sequence[Path],
    *,
    root: Path | None = None,
    macro: str = "OPFORGE_WITH_CUDA",
    sources: Sequence[Path] = (),
) -> BuildError | None:
    """A load of ``name``'s library that failed on an undefined symbol, as an
    error that names the symbol (demangled) and why it is missing: the source among
    ``left_out`` (the CUDA sources this machine did not build) that defines
    it, or none of the sources; and which of ``sources`` calls it. None when
    ``failure`` is about something else.
    ``macro``: what the build defines only with CUDA, for a CPU path ("" for none)."""
    symbol = _undefined_symbol(failure)
    if symbol is None or sanitizer_note(symbol):  # a sanitizer's runtime, not a function left out: load_reason says
        return None
    callers = [s for s in referred_in(symbol, sources) if s not in left_out]
    called = f" (called in {', '.join(_shown(p, root) for p in callers)})" if callers else ""
    if left_out:

        def shown(p: Path) -> str:
            return p.relative_to(root).as_posix() if root is not None and p.is_relative_to(root) else str(p)

        definer = _defined_in(symbol, left_out)
        what = f"{shown(definer)} defines it" if definer else f"the CUDA sources ({', '.join(shown(p) for p in left_out)}) would"
        fix = f", or compile the C++ that calls it only under #ifdef {macro} (defined where the .cu files are built)" if macro else ""
        why = f"{what}, and {'it was' if definer else 'they were'} left out because {_why_no_cuda()}. Build it where CUDA is available{fix}"
    else:
        why = (
            "none of the sources defines it: a function declared but never written (inline: a name in functions=, a CUDA "
            "launcher declared in cpp= with no cuda= source), or a library missing from the link"
        )
    return BuildError(f"opforge: {name}: the built library needs `{symbol}`{called}, but {why}")


def _shown(p: Path, root: Path | None) -> str:
    # Without a root, the sources are inline's generated files: their names say which string (cpp=, cuda=).
    return p.relative_to(root).as_posix() if root is not None and p.is_relative_to(root) else p.name


def referred_in(symbol: str, sources: Sequence[Path]) -> list[Path]:
    """The ``sources`` whose code names the function ``symbol`` (demangled, or the
    last part of a mangled name) without defining it: where a missing symbol is asked for."""
    base = _base_name(symbol)
    if base is None:
        return []
    named = re.compile(rf"\b{re.escape(base)}\b")
    found = []
    for source in sources:
        try:
            code = strip_comments(source.read_text(errors="replace"))
        except OSError:
            continue
        if named.search(code) and _defined_in(symbol, [source]) is None:
            found.append(source)
    return found


def _undefined_symbol(failure: BaseException | str) -> str | None:
    """The symbol a failed load reports as undefined, demangled when c++filt is there."""
    if isinstance(failure, str):
        m = re.search(r"undefined symbol: (\S+)", failure)
        return demangle(m[1]) if m else None
    seen: BaseException | None = failure
    while seen is not None:
        m = re.search(r"undefined symbol: (\S+)", str(seen))
        if m:
            return demangle(m[1])
        seen = seen.__cause__ or seen.__context__
    return None


def _defined_in(symbol: str, sources: Sequence[Path]) -> Path | None:
    """The first of ``sources`` whose code defines the function ``symbol`` (demangled, or
    its mangled name's last part) names: ``name(...) {``, templates and qualifiers aside."""
    base = _base_name(symbol)
    if base is None:
        return None
    definition = re.compile(rf"\b{re.escape(base)}\s*(?:<[^;{{}}]*>)?\s*\([^;{{}}]*\)\s*(?:const\s*)?(?:noexcept\s*)?\{{")
    for source in sources:
        try:
            if definition.search(strip_comments(source.read_text(errors="replace"))):
                return source
        except OSError:
            continue
    return None


def _base_name(symbol: str) -> str | None:
    """A function's own name in ``symbol``: demangled (``ns::f<int>(float)``), or
    mangled when c++filt was not there (the length-prefixed names, the last one)."""
    if symbol.startswith("_Z"):
        parts, rest = [], symbol[2:].lstrip("N")
        while (m := re.match(r"(\d+)", rest)) and len(rest) > len(m[1]):
            n = int(m[1])
            parts.append(rest[len(m[1]) : len(m[1]) + n])
            rest = rest[len(m[1]) + n :]
        base = parts[-1] if parts else ""
    else:
        base = re.sub(r"<.*>", "", symbol.split("(", 1)[0]).rsplit("::", 1)[-1].strip()
    return base if _IDENTIFIER.fullmatch(base or "-") else None


def demangle(symbol: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return symbol
    try:
        out = subprocess.run([cxxfilt, symbol], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return symbol
    return out or symbol


def _why_no_cuda() -> str:
    if build_cuda_flag() is False:
        return f"OPFORGE_BUILD_CUDA={os.environ['OPFORGE_BUILD_CUDA'].strip()}"
    if torch.version.cuda is None:
        return "this torch is a CPU build (torch.version.cuda is None)"
    return "nvcc was not found (set CUDA_HOME)"


# TORCH_LIBRARY(ns, m) defines TORCH_LIBRARY_static_init_<ns>; the fragment and
# impl forms add _<key> (impl) and _<counter>, as C10_UID numbers them.
_STATIC_INIT = re.compile(r"(?:STABLE_)?TORCH_LIBRARY(?P<kind>_FRAGMENT|_IMPL)?_static_init_(?P<rest>\w+)")
# A file-local variable's mangled name: _ZL, the name's length, the name.
_MANGLED_LOCAL = re.compile(r"_ZL(\d+)")
_KINDS = {None: "def", "_FRAGMENT": "fragment", "_IMPL": "impl"}
# An operator as a schema string names it ("add(Tensor a) -> Tensor",
# "ns::add.out(...)"), or m.def("add", &fn) alone: a whole C string.
_DEFINED = re.compile(rb"(?<=\x00)(?:[A-Za-z_]\w*::)?([A-Za-z_]\w*)(?:\.\w+)?(?=[(\x00])")


def torch_library_registrations(path: Path) -> dict[str, set[str]] | None:
    """The operator namespaces ``path`` registers when it loads, each with how:
    "def" (TORCH_LIBRARY), "fragment" (TORCH_LIBRARY_FRAGMENT), "impl"
    (TORCH_LIBRARY_IMPL). None when its symbol table was stripped."""
    try:
        names = symbol_table_names(path)
    except (ElfError, OSError):
        return None
    if names is None:
        return None
    found: dict[str, set[str]] = {}
    for name in names:
        m = _MANGLED_LOCAL.match(name)
        if m:
            name = name[m.end() : m.end() + int(m[1])]
        r = _STATIC_INIT.fullmatch(name)
        if r is None:
            continue
        kind, ns = _KINDS[r["kind"]], r["rest"]
        if kind != "def":
            ns = re.sub(r"_\d+$", "", ns)
        if kind == "impl":
            ns = re.sub(r"_[A-Za-z0-9]+$", "", ns)  # the dispatch key (CPU, CUDA, Autograd)
        found.setdefault(ns, set()).add(kind)
    return found


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _already_mapped(path: Path) -> bool:
    """Whether this process has ``path`` loaded already, by torch.ops.load_library
    or as a Python extension module: dlopen then hands back that copy (it
    knows a file by device and inode), and nothing registers again."""
    if any(_same_file(path, Path(p)) for p in torch.ops.loaded_libraries):
        return True
    try:
        st = path.stat()
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    device, inode, name = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino), str(path.resolve())
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        # By name too: on an overlay file system the maps may show the lower layer's device and inode.
        if len(fields) == 6 and (fields[3:5] == [device, inode] or fields[5] == name):
            return True
    return False


def _namespace_held(ns: str) -> str | None:
    """None when a TORCH_LIBRARY(ns) could be defined now; else where the one
    already defined was registered, as the dispatcher says ("" if it does not)."""
    try:
        probe = torch.library.Library(ns, "DEF")
    except (RuntimeError, ValueError) as exc:
        where = re.search(r"Previous registration of TORCH_LIBRARY was registered at (\S+?);", " ".join(str(exc).split()))
        return where[1] if where else ""
    # Undone at once: the probe only asks whether the namespace is free.
    probe._destroy()
    return None


def _holders(ns: str, path: Path) -> list[str]:
    """The libraries loaded into torch.ops that define operators of ``ns``."""
    held = []
    for other in sorted(torch.ops.loaded_libraries):
        regs = torch_library_registrations(Path(other))
        if regs and regs.get(ns, set()) & {"def", "fragment"} and not _same_file(Path(other), path):
            held.append(other)
    return held


def registration_clashes(path: Path) -> list[tuple[str, list[str], str | None]]:
    """For each namespace that loading ``path`` would register again in this
    process: the namespace, its operators already registered, and (for a
    TORCH_LIBRARY whose namespace is taken) where the first one was defined.
    Empty when it loads cleanly."""
    if not is_elf(path) or _already_mapped(path):
        # No library (the loader says why), or the copy already loaded, which
        # dlopen hands back: nothing registers again.
        return []
    regs = torch_library_registrations(path)
    existing: dict[str, set[str]] = {}
    for qualname in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualname.partition("::")
        existing.setdefault(ns, set()).add(name.split(".", 1)[0])
    if regs is None:
        # Stripped: only the namespaces of the libraries loaded by path can be told apart.
        regs = {}
        for other in torch.ops.loaded_libraries:
            for ns, kinds in (torch_library_registrations(Path(other)) or {}).items():
                if kinds & {"def", "fragment"}:
                    regs.setdefault(ns, {"fragment"})
    defining = {ns: kinds for ns, kinds in regs.items() if kinds & {"def", "fragment"} and ns in existing}
    if not defining:
        return []
    defined = {m.decode() for m in _DEFINED.findall(path.read_bytes())}
    clashes = []
    for ns, kinds in sorted(defining.items()):
        twice = sorted(existing[ns] & defined)
        held = _namespace_held(ns) if "def" in kinds else None
        if twice or held is not None:
            clashes.append((ns, twice, held))
    return clashes


def registers_nothing(path: Path, ops_before: set[str]) -> bool:
    """Whether a library just loaded registered nothing: no TORCH_LIBRARY,
    fragment or impl in its symbols and no operator new since ``ops_before``
    (``torch._C._dispatch_get_all_op_names()`` before loading it): operators
    registered with torch::RegisterOperators, the API before TORCH_LIBRARY,
    leave no symbol of their own."""
    if torch_library_registrations(path):
        return False
    return set(torch._C._dispatch_get_all_op_names()) <= ops_before


def refuse_clashes(path: Path) -> None:
    """Raises BuildError when loading ``path`` would register an operator (or
    a TORCH_LIBRARY namespace) a second time, which aborts the process."""
    for ns, twice, held in registration_clashes(path):
        holders = _holders(ns, path)
        by = ", ".join(holders) if holders else "torch or a library loaded another way"
        if twice:
            shown = ", ".join(f"{ns}::{n}" for n in twice[:6]) + (f" and {len(twice) - 6} more" if len(twice) > 6 else "")
            what = f"{shown} (operator namespace {ns!r}), which {by} already registered in this process"
        else:
            what = f"TORCH_LIBRARY({ns}) (operator namespace {ns!r}), which {by} already defined in this process"
            what += f" (at {held})" if held else ""
        fix = "Load one of the two per process (the other in a new one)"
        if ns == "opforge":
            fix += (
                f". To use {path.name} as opforge's op library, set OPFORGE_LIBRARY={path} before `import opforge`: "
                "it is then loaded instead of the JIT or prebuilt one"
            )
        raise BuildError(
            f"opforge: refusing to load {path}: it registers {what}. Loading it would abort the process (a registration "
            f"that fails while a library loads cannot be caught). {fix}"
        )


__all__ = [
    "demangle",
    "referred_in",
    "refuse_clashes",
    "registers_nothing",
    "registration_clashes",
    "torch_library_registrations",
    "undefined_symbol_error",
]
