"""``opforge abi FILE.so|FILE.whl``: does a built op library stay loadable when torch changes?

A library on PyTorch's stable ABI calls libtorch only through its stable C shim
(``aoti_torch_*``, ``torch_*`` functions declared in ``torch/csrc/stable/c/shim.h``
and ``torch/csrc/inductor/aoti_torch/c/shim.h``); everything else of torch it uses
is header-only and compiled in. Such a library loads in every torch from the
version whose shim has all it calls. A library that takes C++ symbols from
libtorch or libc10 (``c10::``, ``at::``, ``torch::``, ``caffe2::``) is tied to the
torch it was built with: the next release fails with "undefined symbol".

The audit reads the symbols the library takes from other libraries (undefined
dynamic symbols) and sorts each into one of:

- the stable shim, with the torch version that added it: read from the
  installed torch's headers, where ``#if TORCH_FEATURE_VERSION >= TORCH_VERSION_X_Y_0``
  guards each addition (a function outside any guard: 2.10, the first version of
  the versioned stable ABI). Functions of ``c_shim_aten.h`` (the back end of
  ``torch::stable`` ops) count too; deprecated ones are named in a note;
- not stable: C++ symbols in torch's namespaces, C functions of libtorch that
  the shim does not declare (AOTInductor's per-device fallbacks, a shim function
  newer than the installed torch), the Python bindings' ``THP*``;
- allowed: the C and C++ runtimes (libc, libm, libgcc, libstdc++, the C++ ABI),
  OpenMP, the CUDA runtime (``cuda*``, ``__cuda*``), the Python C API (noted when
  the library is no Python module), and any other library's symbols (not torch's).

Symbols the library defines itself are not looked at. Exit status: 0 stable, 1
not stable, 2 when nothing could be audited (no such file, not an ELF, no torch
headers).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from opforge.elf_symbols import ElfError, demangle, read_dynamic_symbols

#: The first torch of the versioned stable ABI: shim functions outside any version guard date from it.
FLOOR = (2, 10)
#: The headers that declare the stable C shim, relative to torch's include directory.
SHIM_HEADERS = (
    "torch/csrc/stable/c/shim.h",
    "torch/csrc/inductor/aoti_torch/c/shim.h",
    "torch/csrc/inductor/aoti_torch/c/shim_deprecated.h",
    "torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h",
)
SHOW = 20  # non-stable symbols listed before "and N more"

_VERSION_GUARD = re.compile(r"TORCH_FEATURE_VERSION\s*>=\s*TORCH_VERSION_(\d+)_(\d+)_\d+")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_EXPORT_NAME = re.compile(r"AOTI_TORCH_EXPORT\b[^;{(]*?\b([A-Za-z_]\w*)\s*\(", re.S)
# Mangled C++ names in torch's namespaces (N, optional cv/ref qualifiers, then c10, at, torch or caffe2),
# for when c++filt is not there to demangle them.
_TORCH_MANGLED = re.compile(r"N[rVKRO]*(?:3c10|2at|5torch|6caffe2)")
_TORCH_DEMANGLED = re.compile(r"(?<![\w:])(c10|at|torch|caffe2)::")
_CUDA = re.compile(r"(cuda|__cuda|__nv|cu[A-Z]|cublas|cufft|curand|cusparse|cusolver|nvrtc)")
_SPECIAL_NAME = re.compile(r"^(?:[A-Za-z -]+? for )+")
_TORCH_C_PREFIXES = ("aoti_torch_", "torch_", "aoti_", "c10_", "THP")


class AbiError(Exception):
    """Nothing could be audited: a missing file, not an ELF or wheel, no torch headers."""


@dataclass(frozen=True)
class ShimTable:
    """The stable C shim of one torch: each function and the version it came in."""

    torch_version: tuple[int, int]
    functions: dict[str, tuple[int, int]]
    deprecated: frozenset[str]
    include: Path

    def versions(self) -> list[tuple[int, int]]:
        return sorted(set(self.functions.values()))


def torch_include() -> Path:
    """The installed torch's include directory, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise AbiError("torch is not installed here: give its headers with --torch-include DIR")
    return Path(next(iter(spec.submodule_search_locations))) / "include"


def parse_shim_header(text: str) -> dict[str, tuple[int, int]]:
    """``{function: (major, minor)}`` of the ``AOTI_TORCH_EXPORT`` functions a
    header declares, each with the newest ``TORCH_FEATURE_VERSION >=`` guard around it."""
    text = _COMMENTS.sub(lambda m: "\n" * m.group().count("\n"), text)
    found: dict[str, tuple[int, int]] = {}
    stack: list[tuple[int, int] | None] = []
    pending = ""
    for line in text.splitlines():
        directive = line.strip()
        if directive.startswith("#"):
            word = directive[1:].strip().split(None, 1)[0] if directive[1:].strip() else ""
            if word in ("if", "ifdef", "ifndef"):
                m = _VERSION_GUARD.search(directive)
                stack.append((int(m.group(1)), int(m.group(2))) if m and word == "if" else None)
            elif word in ("elif", "else") and stack:
                stack[-1] = None  # the other side of a version test is no newer version
            elif word == "endif" and stack:
                stack.pop()
            continue
        if "AOTI_TORCH_EXPORT" in line or pending:
            pending += line + "\n"
            m = _EXPORT_NAME.search(pending)
            if m:
                found[m.group(1)] = max([FLOOR, *(v for v in stack if v is not None)])
                pending = ""
            elif ";" in line:
                pending = ""  # an exported variable, no function
    return found


def shim_table(include: Path | None = None) -> ShimTable:
    """The stable shim of the torch whose headers are under ``include`` (default: the installed torch's)."""
    include = torch_include() if include is None else include
    version_h = include / "torch" / "headeronly" / "version.h"
    if not version_h.is_file():
        raise AbiError(f"{version_h} not found: the stable ABI's versioned shim needs torch >= 2.10 headers")
    text = version_h.read_text()
    major, minor = (re.search(rf"#define TORCH_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR"))
    if major is None or minor is None:
        raise AbiError(f"{version_h}: no TORCH_VERSION_MAJOR/MINOR")
    functions: dict[str, tuple[int, int]] = {}
    deprecated: set[str] = set()
    for rel in SHIM_HEADERS:
        header = include / rel
        if header.is_file():
            found = parse_shim_header(header.read_text())
            if rel.endswith("deprecated.h"):
                deprecated |= set(found)
            for name, version in found.items():
                functions[name] = min(version, functions.get(name, version))
    if not functions:
        raise AbiError(f"no stable shim functions found under {include} ({', '.join(SHIM_HEADERS[:2])})")
    return ShimTable((int(major.group(1)), int(minor.group(1))), functions, frozenset(deprecated), include)


def version_str(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


# --- sorting one library's symbols ---

_ALLOWED_GROUPS = (
    "C runtime (libc, libm, libgcc)",
    "C++ runtime (libstdc++)",
    "OpenMP",
    "CUDA runtime and libraries",
    "Python C API",
    "other libraries",
)


@dataclass
class LibraryAudit:
    """What one shared library takes from outside, sorted."""

    name: str  # as shown: a path, or wheel!member
    shim: dict[str, tuple[int, int]] = field(default_factory=dict)  # stable shim functions it calls
    unstable: dict[str, list[str]] = field(default_factory=dict)  # group -> symbols (demangled where possible)
    allowed: dict[str, int] = field(default_factory=dict)  # group -> count
    torch_libs: tuple[str, ...] = ()  # libtorch*/libc10* it names in DT_NEEDED
    python_module: bool = False
    demangled: bool = True
    reader: str = "nm"
    notes: list[str] = field(default_factory=list)

    @property
    def stable(self) -> bool:
        return not self.unstable

    @property
    def n_unstable(self) -> int:
        return sum(len(v) for v in self.unstable.values())

    def min_version(self) -> tuple[int, int] | None:
        """The oldest torch whose shim has every function it calls (None: it calls none)."""
        return max(self.shim.values()) if self.shim else None


def _torch_group(name: str, pretty: str, torch_c_names: frozenset[str]) -> str | None:
    """The non-stable group of a symbol the shim does not declare: torch's
    namespace (``c10::``), or None when the symbol is not torch's."""
    if name.startswith("THP") or pretty.startswith("THP"):
        return "torch Python bindings (THP*)"
    if name.startswith("_Z"):
        if pretty == name:  # c++filt missing
            return "torch C++ (mangled)" if _TORCH_MANGLED.search(name) else None
        owner = _function_name(pretty)
        m = _TORCH_DEMANGLED.match(owner) or _TORCH_DEMANGLED.search(pretty)
        return f"{m.group(1)}::* (C++)" if m else None
    if name.startswith(_TORCH_C_PREFIXES) or name in torch_c_names:
        return "libtorch C symbols outside the stable shim"
    return None


def _function_name(pretty: str) -> str:
    """The qualified name a demangled symbol is about, without its return type, template
    arguments and parameters: ``at::TensorBase::data_ptr`` for
    ``c10::Half* at::TensorBase::data_ptr<c10::Half>() const``."""
    head = re.sub(r"operator[^\w\s(]+", "operator", pretty).split("(", 1)[0]
    while (stripped := re.sub(r"<[^<>]*>", "", head)) != head:
        head = stripped
    return head.split()[-1] if head.split() else ""


@functools.lru_cache(maxsize=4)
def _torch_c_names(lib_dir: Path) -> frozenset[str]:
    """The C (unmangled) names torch's own libraries export: a library taking one
    (a global of the Python bindings, a bundled dependency's function) takes it from torch."""
    names: set[str] = set()
    for lib in sorted(lib_dir.glob("lib*.so")) if lib_dir.is_dir() else ():
        if lib.name.startswith(("libtorch", "libc10", "libshm")) and "test" not in lib.name:
            try:
                names.update(s for s in read_dynamic_symbols(lib, reader="elf").defined if not s.startswith("_Z"))
            except ElfError:
                continue
    return frozenset(names)


def _allowed_group(name: str, pretty: str) -> str:
    if name.startswith(("Py", "_Py")):
        return "Python C API"
    if _CUDA.match(name):
        return "CUDA runtime and libraries"
    if name.startswith(("omp_", "GOMP_", "__kmpc_")):
        return "OpenMP"
    if name.startswith(("__cxa_", "__gxx_", "__dynamic_cast")):
        return "C++ runtime (libstdc++)"
    if name.startswith("_Z"):
        # "vtable for std::...", "VTT for ...", "typeinfo for ...": the entity after the words
        entity = _SPECIAL_NAME.sub("", pretty)
        if entity.startswith(("std::", "__cxxabiv1::", "__gnu_cxx::", "operator new", "operator delete")):
            return "C++ runtime (libstdc++)"
        return "other libraries"
    return "C runtime (libc, libm, libgcc)"


def audit_library(path: Path, table: ShimTable, *, name: str | None = None, reader: str = "auto") -> LibraryAudit:
    """Sorts the symbols ``path`` takes from other libraries (ElfError: not an ELF shared library)."""
    syms = read_dynamic_symbols(path, reader=reader)
    mangled = [s for s in syms.undefined if s.startswith("_Z")]
    pretty = demangle(mangled)
    audit = LibraryAudit(name or str(path), demangled=bool(pretty) or not mangled, reader=syms.reader)
    audit.torch_libs = tuple(n for n in syms.needed if n.startswith(("libtorch", "libc10")))
    audit.python_module = any(s.startswith("PyInit_") for s in syms.defined)
    torch_c_names = _torch_c_names(table.include.parent / "lib")
    for sym in syms.undefined:
        shown = pretty.get(sym, sym)
        if sym in table.functions:
            audit.shim[sym] = table.functions[sym]
            continue
        group = _torch_group(sym, shown, torch_c_names)
        if group is not None:
            audit.unstable.setdefault(group, []).append(shown)
        else:
            key = _allowed_group(sym, shown)
            audit.allowed[key] = audit.allowed.get(key, 0) + 1
    old = sorted(set(audit.shim) & table.deprecated)
    if old:
        audit.notes.append(f"calls deprecated shim functions, to be removed from a later torch: {', '.join(old)}")
    if audit.allowed.get("Python C API") and not audit.python_module:
        audit.notes.append("takes the Python C API without being a Python module (no PyInit_): it loads only inside Python")
    if not audit.demangled:
        audit.notes.append("c++filt (binutils) is not installed: C++ names are shown mangled")
    return audit


def audit_path(path: Path, table: ShimTable, *, reader: str = "auto") -> list[LibraryAudit]:
    """One audit per library: ``path`` itself, or every ``.so`` inside a wheel."""
    if not path.exists():
        raise AbiError(f"{path}: no such file")
    if path.is_dir():
        raise AbiError(f"{path} is a directory: give a shared library (.so) or a wheel (.whl)")
    if path.suffix == ".whl" or zipfile.is_zipfile(path):
        return _audit_wheel(path, table, reader)
    try:
        return [audit_library(path, table, reader=reader)]
    except ElfError as exc:
        raise AbiError(str(exc)) from None


def _audit_wheel(path: Path, table: ShimTable, reader: str) -> list[LibraryAudit]:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise AbiError(f"{path} is not a wheel (not a zip archive)") from None
    with archive, tempfile.TemporaryDirectory(prefix="opforge-abi-") as tmp:
        members = [m for m in archive.namelist() if re.search(r"\.so(\.\d+)*$", m)]
        if not members:
            raise AbiError(f"{path} holds no shared library (.so): nothing to audit")
        audits = []
        for i, member in enumerate(members):
            target = Path(tmp) / f"{i}.so"
            target.write_bytes(archive.read(member))
            try:
                audits.append(audit_library(target, table, name=f"{path.name}!{member}", reader=reader))
            except ElfError as exc:
                raise AbiError(f"{path.name}!{member}: {str(exc).replace(str(target), member)}") from None
        return audits


# --- the report ---


def render(audits: list[LibraryAudit], table: ShimTable, *, show: int = SHOW) -> str:
    """The report: per library its counts, the non-stable symbols (first ``show``), the
    minimum torch version; then the verdict."""
    lines: list[str] = []
    shim_of = f"the stable shim of torch {version_str(table.torch_version)}'s headers"
    for a in audits:
        taken = len(a.shim) + a.n_unstable + sum(a.allowed.values())
        lines.append(f"{a.name}")
        lines.append(f"  takes {taken} symbols from other libraries: {len(a.shim)} from torch's stable C shim, "
                     f"{a.n_unstable} from torch outside it, {sum(a.allowed.values())} from elsewhere")  # fmt: skip
        if a.torch_libs:
            lines.append(f"  links {', '.join(a.torch_libs)}")
        if a.allowed:
            lines.append("  elsewhere: " + ", ".join(f"{g} {a.allowed[g]}" for g in _ALLOWED_GROUPS if a.allowed.get(g)))
        newest = a.min_version()
        if newest is not None:
            newer = sorted(f for f, v in a.shim.items() if v == newest and v > FLOOR)
            why = f" ({', '.join(newer[:5])}{', ...' if len(newer) > 5 else ''} came in {version_str(newest)})" if newer else ""
            lines.append(f"  its shim calls need torch >= {version_str(newest)}{why}")
        if a.unstable:
            lines.append(f"  NOT STABLE: {a.n_unstable} symbol{'s' * (a.n_unstable != 1)} of libtorch/libc10 outside {shim_of}:")
            quota = max(1, show // len(a.unstable)) if show < a.n_unstable else show  # every group gets its share
            shown = 0
            for group in sorted(a.unstable):
                names = sorted(a.unstable[group])
                lines.append(f"    {group}: {len(names)}")
                lines.extend(f"      {sym}" for sym in names[:quota])
                shown += min(len(names), quota)
            if a.n_unstable > shown:
                lines.append(f"    and {a.n_unstable - shown} more (--all lists every one)")
        lines.extend(f"  note: {n}" for n in a.notes)
    bad = [a for a in audits if not a.stable]
    mins = [v for a in audits if (v := a.min_version()) is not None]
    if bad:
        n = sum(a.n_unstable for a in bad)
        lines.append(f"verdict: NOT STABLE: {n} symbol{'s' * (n != 1)} in {len(bad)} of {len(audits)} "
                     f"librar{'ies' if len(audits) != 1 else 'y'} tie it to the torch it was built with; "
                     "it fails to load ('undefined symbol') once torch changes")  # fmt: skip
    elif mins:
        lines.append(f"verdict: stable: loads in every torch >= {version_str(max(mins))} (checked against {shim_of})")
    else:
        lines.append("verdict: stable: takes nothing from torch")
    return "\n".join(lines)


def run(paths: list[Path], *, show_all: bool = False, include: Path | None = None, reader: str = "auto") -> int:
    """``opforge abi``: prints the report; 0 stable, 1 not stable, 2 nothing audited."""
    try:
        table = shim_table(include)
        audits = [a for p in paths for a in audit_path(p, table, reader=reader)]
    except (AbiError, ElfError) as exc:
        print(f"opforge abi: {exc}", file=sys.stderr)
        return 2
    print(render(audits, table, show=sys.maxsize if show_all else SHOW))
    return 0 if all(a.stable for a in audits) else 1
