"""The dynamic symbols of a shared library: what it takes from other libraries
(undefined), what it defines, and the libraries it names (DT_NEEDED).

binutils' ``nm -D`` reads them when it is installed; otherwise a small reader of
the ELF's ``.dynsym``, ``.dynstr`` and ``.dynamic`` sections, in the standard
library only, does. Both give the same names (symbol versions such as
``@GLIBC_2.2.5`` stripped).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_SHT_DYNAMIC = 6
_DT_NEEDED = 1
_STT_SECTION, _STT_FILE = 3, 4


class ElfError(ValueError):
    """A file that is not an ELF shared library, or one that cannot be read."""


@dataclass(frozen=True)
class DynamicSymbols:
    undefined: tuple[str, ...]  # taken from other libraries, sorted
    defined: tuple[str, ...]  # exported by the library itself, sorted
    needed: tuple[str, ...]  # DT_NEEDED, in the library's order
    reader: str  # "nm" or "elf" (this module's reader)


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def read_dynamic_symbols(path: Path, *, reader: str = "auto") -> DynamicSymbols:
    """The library's dynamic symbols, through ``nm -D`` (``reader="nm"``), the
    standard-library reader (``"elf"``), or ``nm`` when it is on PATH (``"auto"``).
    Raises ElfError for a file that is no ELF shared library."""
    if not is_elf(path):
        raise ElfError(f"{path} is not an ELF file (a shared library .so, or a wheel .whl holding some)")
    own = _read_elf(path)  # also for DT_NEEDED, which nm does not show
    nm = shutil.which("nm") if reader in ("auto", "nm") else None
    if reader == "nm" and nm is None:
        raise ElfError("nm (binutils) is not on PATH")
    if nm is None:
        return own
    return DynamicSymbols(_nm(nm, path, "--undefined-only"), _nm(nm, path, "--defined-only"), own.needed, "nm")


def _nm(nm: str, path: Path, which: str) -> tuple[str, ...]:
    res = subprocess.run([nm, "-D", which, str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ElfError(f"nm -D {which} {path} failed: {res.stderr.strip() or res.returncode}")
    names = set()
    for line in res.stdout.splitlines():
        fields = line.split()
        if fields and not line.endswith(":"):
            names.add(fields[-1].split("@", 1)[0])
    return tuple(sorted(n for n in names if n))


@dataclass(frozen=True)
class _Layout:
    endian: str
    wide: bool  # ELF64

    def unpack(self, f: BinaryIO, fmt: str, offset: int) -> tuple:
        f.seek(offset)
        size = struct.calcsize(self.endian + fmt)
        data = f.read(size)
        if len(data) != size:
            raise ElfError("truncated ELF file")
        return struct.unpack(self.endian + fmt, data)


def _section_headers(f: BinaryIO, path: Path) -> tuple[_Layout, list[tuple[int, int, int, int, int]]]:
    """The file's layout and (type, offset, size, link, entsize) of each section."""
    ident = f.read(16)
    if len(ident) < 16 or ident[:4] != ELF_MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise ElfError(f"{path} is not a readable ELF file")
    elf = _Layout("<" if ident[5] == 1 else ">", ident[4] == 2)
    if elf.wide:
        shoff, shentsize, shnum = _pick(elf.unpack(f, "HHIQQQIHHHHHH", 16), 5, 10, 11)
        sh_fmt = "IIQQQQIIQQ"
    else:
        shoff, shentsize, shnum = _pick(elf.unpack(f, "HHIIIIIHHHHHH", 16), 5, 10, 11)
        sh_fmt = "IIIIIIIIII"
    if shoff == 0 or shnum == 0:
        raise ElfError(f"{path} has no section headers: cannot find its symbols")
    sections = []
    for i in range(shnum):
        s = elf.unpack(f, sh_fmt, shoff + i * shentsize)
        sections.append((s[1], s[4], s[5], s[6], s[9]))
    return elf, sections


_PT_LOAD = 1
_SHT_NOBITS = 8


def check_complete(path: Path) -> None:
    """Raises ElfError unless every part of ``path`` that the loader maps or
    reads lies inside the file: a truncated library (a copy cut short, a
    disk that filled up) would otherwise be mapped, and the process killed by
    SIGBUS on the first touch of a page past its end."""
    if not is_elf(path):
        raise ElfError(f"{path} is not an ELF file")
    size = path.stat().st_size
    with path.open("rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise ElfError(f"{path} is not a readable ELF file (its header is cut short or damaged)")
        elf = _Layout("<" if ident[5] == 1 else ">", ident[4] == 2)
        header = elf.unpack(f, "HHIQQQIHHHHHH" if elf.wide else "HHIIIIIHHHHHH", 16)
        phoff, shoff, phentsize, phnum, shentsize, shnum = header[4], header[5], header[8], header[9], header[10], header[11]
        ph_fmt = "IIQQQQQQ" if elf.wide else "IIIIIIII"
        reach = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
        if reach <= size:
            for i in range(phnum):
                ph = elf.unpack(f, ph_fmt, phoff + i * phentsize)
                kind, offset, filesz = ph[0], (ph[2] if elf.wide else ph[1]), (ph[5] if elf.wide else ph[4])
                if kind == _PT_LOAD:
                    reach = max(reach, offset + filesz)
        if reach <= size and shoff:
            f.seek(0)
            for s_type, s_offset, s_size, _, _ in _section_headers(f, path)[1]:
                if s_type != _SHT_NOBITS:
                    reach = max(reach, s_offset + s_size)
    if reach > size:
        raise ElfError(f"{path} is truncated: it ends at byte {size:,}, and its contents reach byte {reach:,}")


def symbol_table_names(path: Path) -> tuple[str, ...] | None:
    """Every name in the full symbol table (``.symtab``), the file-local
    (``static``) symbols included, which ``.dynsym`` leaves out; None when the
    library was stripped of it. Raises ElfError for a file that is no ELF."""
    if not is_elf(path):
        raise ElfError(f"{path} is not an ELF file")
    with path.open("rb") as f:
        elf, sections = _section_headers(f, path)
        symtab = next((s for s in sections if s[0] == _SHT_SYMTAB), None)
        if symtab is None or symtab[3] >= len(sections):
            return None
        strtab = sections[symtab[3]]
        f.seek(strtab[1])
        strings = f.read(strtab[2])
        f.seek(symtab[1])
        table = f.read(symtab[2])
    entsize = symtab[4] or (24 if elf.wide else 16)
    # Each symbol's name offset (its first field): the linker shares one string
    # between names that end alike, so splitting the table would miss some.
    offsets = {o for (o,) in struct.iter_unpack(f"{elf.endian}I{entsize - 4}x", table[: len(table) - len(table) % entsize])}
    return tuple(sorted(name for name in (_cstring(strings, o) for o in offsets if o) if name))


def _read_elf(path: Path) -> DynamicSymbols:
    with path.open("rb") as f:
        elf, sections = _section_headers(f, path)
        dynsym = next((s for s in sections if s[0] == _SHT_DYNSYM), None)
        if dynsym is None:
            raise ElfError(f"{path} has no dynamic symbol table: not a shared library (an object file or a static binary?)")
        strtab = sections[dynsym[3]]
        f.seek(strtab[1])
        strings = f.read(strtab[2])
        undefined, defined = set(), set()
        entsize = dynsym[4] or (24 if elf.wide else 16)
        for i in range(1, dynsym[2] // entsize):  # entry 0 is the null symbol
            if elf.wide:
                name, info, _, shndx = elf.unpack(f, "IBBH", dynsym[1] + i * entsize)
            else:
                name, _, _, info, _, shndx = elf.unpack(f, "IIIBBH", dynsym[1] + i * entsize)
            if info & 0xF in (_STT_SECTION, _STT_FILE):
                continue
            text = _cstring(strings, name)
            if text:
                (undefined if shndx == 0 else defined).add(text)
        needed = []
        dynamic = next((s for s in sections if s[0] == _SHT_DYNAMIC), None)
        if dynamic is not None:
            f.seek(sections[dynamic[3]][1])
            dynstr = f.read(sections[dynamic[3]][2])
            step = 16 if elf.wide else 8
            for off in range(dynamic[1], dynamic[1] + dynamic[2], step):
                tag, val = elf.unpack(f, "qQ" if elf.wide else "iI", off)
                if tag == 0:
                    break
                if tag == _DT_NEEDED:
                    needed.append(_cstring(dynstr, val))
    return DynamicSymbols(tuple(sorted(undefined)), tuple(sorted(defined)), tuple(needed), "elf")


def _pick(values: tuple, *indices: int) -> tuple[int, ...]:
    return tuple(values[i] for i in indices)


def _cstring(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    return table[offset : end if end >= 0 else len(table)].decode("utf-8", "replace")


def demangle(names: list[str]) -> dict[str, str]:
    """C++ names demangled by ``c++filt`` (one call for all of them); an empty
    dict when c++filt is not installed. Names it leaves alone map to themselves."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {}
    res = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True)
    lines = res.stdout.splitlines()
    if res.returncode != 0 or len(lines) != len(names):
        return {}
    return dict(zip(names, lines, strict=True))


__all__ = ["ELF_MAGIC", "DynamicSymbols", "ElfError", "check_complete", "demangle", "is_elf", "read_dynamic_symbols", "symbol_table_names"]
