"""The dynamic symbols of a shared library: what it takes from other libraries
(undefined), what it defines, and the libraries it names (DT_NEEDED).

binutils' ``nm -D`` reads them when it is installed; otherwise a small reader of
the ELF's ``.dynsym``, ``.dynstr`` and ``.dynamic`` sections, in the standard
library only, does. Both give the same names (symbol versions such as
``@GLIBC_2.2.5`` stripped).
"""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
import sys
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


_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_NOBITS = 8
_SHF_ALLOC, _SHF_TLS = 2, 0x400
_ET_DYN = 3
#: e_machine of each machine Python names (platform.machine()).
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "ppc64": 21, "s390x": 22, "riscv64": 243}


def check_complete(path: Path) -> None:
    """Raises ElfError unless ``path`` is a shared library for this machine
    whose headers agree with each other and whose every part that the loader
    maps or reads lies inside the file. The dynamic loader trusts the headers:
    a truncated library (a copy cut short, a disk that filled up) is mapped and
    the process killed by SIGBUS on the first touch of a page past its end; a
    damaged program header (a segment's entry zeroed) maps the library in
    pieces and the process dies with SIGSEGV in its relocations."""
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
        _check_header(path, elf, ident, header)
        ph_fmt = "IIQQQQQQ" if elf.wide else "IIIIIIII"
        reach = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
        if reach > size:
            raise ElfError(f"{path} is truncated: it ends at byte {size:,}, and its headers reach byte {reach:,}")
        # (offset, vaddr, filesz, memsz, align) of each loadable segment; the dynamic segment's (vaddr, memsz).
        loads: list[tuple[int, int, int, int, int]] = []
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            ph = elf.unpack(f, ph_fmt, phoff + i * phentsize)
            if elf.wide:
                kind, offset, vaddr, filesz, memsz, align = ph[0], ph[2], ph[3], ph[5], ph[6], ph[7]
            else:
                kind, offset, vaddr, filesz, memsz, align = ph[0], ph[1], ph[2], ph[4], ph[5], ph[7]
            if kind == _PT_LOAD:
                loads.append((offset, vaddr, filesz, memsz, align))
                reach = max(reach, offset + filesz)
            elif kind == _PT_DYNAMIC:
                dynamic = (vaddr, memsz)
        _check_segments(path, loads, dynamic)
        if reach <= size and shoff:
            f.seek(0)
            sections = _section_headers(f, path)[1]
            for s_type, s_offset, s_size, _, _ in sections:
                if s_type != _SHT_NOBITS:
                    reach = max(reach, s_offset + s_size)
            if reach <= size:
                _check_sections_mapped(path, f, elf, shoff, shentsize, shnum, loads)
    if reach > size:
        raise ElfError(f"{path} is truncated: it ends at byte {size:,}, and its contents reach byte {reach:,}")


def _check_header(path: Path, elf: _Layout, ident: bytes, header: tuple) -> None:
    """The ELF header's fields that the loader trusts: class, byte order, type, machine and the headers' sizes."""
    e_type, machine, ehsize, phentsize, phnum, shentsize, shnum, shstrndx = (
        header[0], header[1], header[7], header[8], header[9], header[10], header[11], header[12],
    )  # fmt: skip
    damaged = f"{path} is damaged or not a library for this machine"
    wide = sys.maxsize > 2**32
    if elf.wide != wide:
        raise ElfError(f"{damaged}: it is a {64 if elf.wide else 32}-bit ELF file, this Python is {64 if wide else 32}-bit")
    if (elf.endian == "<") != (sys.byteorder == "little"):
        raise ElfError(
            f"{damaged}: its byte order is {'little' if elf.endian == '<' else 'big'}-endian, this machine's is {sys.byteorder}-endian"
        )
    if e_type != _ET_DYN:
        raise ElfError(f"{damaged}: its ELF type is {e_type}, a shared library's is {_ET_DYN} (ET_DYN)")
    wanted = _MACHINES.get(platform.machine().lower())
    if wanted is not None and machine != wanted:
        raise ElfError(f"{damaged}: it is built for ELF machine {machine}, this {platform.machine()} machine is {wanted}")
    sizes = (64, 56, 64) if elf.wide else (52, 32, 40)
    for what, value, want in zip(
        ("ELF header", "program header entry", "section header entry"), (ehsize, phentsize, shentsize), sizes, strict=True
    ):
        if value != want and not (what == "section header entry" and shnum == 0 and value == 0):
            raise ElfError(f"{damaged}: its {what} size is {value}, an ELF{64 if elf.wide else 32} file's is {want}")
    if phnum == 0:
        raise ElfError(f"{damaged}: it has no program headers, so nothing for the loader to map")
    if shnum and shstrndx >= shnum:
        raise ElfError(f"{damaged}: its section name table is section {shstrndx} of {shnum}")


def _check_segments(path: Path, loads: list[tuple[int, int, int, int, int]], dynamic: tuple[int, int] | None) -> None:
    """The loadable segments as the loader maps them: in address order, none larger in the file than in memory,
    each at an offset congruent to its address, the dynamic segment inside one of them."""
    damaged = f"{path} is damaged (its program headers)"
    if not loads:
        raise ElfError(f"{damaged}: no loadable segment")
    for k, (offset, vaddr, filesz, memsz, align) in enumerate(loads):
        if filesz > memsz:
            raise ElfError(f"{damaged}: loadable segment {k} holds {filesz:,} bytes of the file in {memsz:,} bytes of memory")
        if align > 1 and (align & (align - 1) or (vaddr - offset) % align):
            raise ElfError(
                f"{damaged}: loadable segment {k} is at offset {offset:#x} and address {vaddr:#x}, not aligned alike to {align:#x}"
            )
        if k and vaddr < loads[k - 1][1] + loads[k - 1][3]:
            raise ElfError(f"{damaged}: loadable segment {k} (address {vaddr:#x}) overlaps or precedes the one before it")
    if loads[0][0] != 0:
        raise ElfError(f"{damaged}: the first loadable segment starts at offset {loads[0][0]:#x}, not at the ELF header")
    if dynamic is not None and not any(v <= dynamic[0] and dynamic[0] + dynamic[1] <= v + m for _, v, _, m, _ in loads):
        raise ElfError(f"{damaged}: its dynamic section (address {dynamic[0]:#x}) lies in no loadable segment")


def _check_sections_mapped(
    path: Path, f: BinaryIO, elf: _Layout, shoff: int, shentsize: int, shnum: int, loads: list[tuple[int, int, int, int, int]]
) -> None:
    """Every section the library needs in memory (SHF_ALLOC) lies inside a loadable segment, at its address."""
    sh_fmt = "IIQQQQIIQQ" if elf.wide else "IIIIIIIIII"
    for i in range(1, shnum):
        _, s_type, flags, addr, offset, s_size, *_ = elf.unpack(f, sh_fmt, shoff + i * shentsize)
        # A thread-local .tbss takes no room in its segment: each thread's copy is made apart.
        if not flags & _SHF_ALLOC or s_size == 0 or (s_type == _SHT_NOBITS and flags & _SHF_TLS):
            continue
        inside = any(v <= addr and addr + s_size <= v + m and (s_type == _SHT_NOBITS or offset - o == addr - v) for o, v, _, m, _ in loads)
        if not inside:
            raise ElfError(
                f"{path} is damaged (its program headers): section {i} (address {addr:#x}, {s_size:,} bytes) lies in no loadable segment"
            )


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
