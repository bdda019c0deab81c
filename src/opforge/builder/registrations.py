"""What a TORCH_LIBRARY library registers when it loads, read from the file
before loading it.

Its registrations run in static initialisers: an operator defined twice (a
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
from pathlib import Path

import torch
import torch.library

from opforge.builder.errors import BuildError
from opforge.elf_symbols import ElfError, is_elf, symbol_table_names

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


__all__ = ["refuse_clashes", "registers_nothing", "registration_clashes", "torch_library_registrations"]
