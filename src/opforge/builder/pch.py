"""Precompiled headers: a header set compiled once per compiler and flags,
kept in the build cache and reused by every later build that asks for it.

Most of the compile time of a torch-facing translation unit is torch's
headers, parsed again by every file (measured on 2 cores: a 70-line wrapper
takes as long as a 500-line one). GCC loads a ``.gch`` instead when a file is
compiled with ``-include <dir>/pch.h`` and ``<dir>/pch.h.gch`` was built from
the same headers with the same flags. When they differ in a way that matters
(another ``-std``, ``-fPIC``, a macro the headers test) GCC says so under
``-Winvalid-pch`` and parses the headers itself: slower, never wrong, since
the stub ``pch.h`` includes the real headers.

Entries live in the cache as ``pch-<16 hex>/`` (the key: compiler path, mtime,
size and version, the flags, the header list), built under the entry's flock
and used under a shared one, so ``opforge cache clean`` never removes one a
compiler is reading. An entry records every header it was made from (GCC's
dependency list, with mtimes and sizes): an edited or reinstalled header
rebuilds it.

For users' code (``opforge build PATH``), most of the compile time of a user's torch-facing file is torch's headers
(``torch/extension.h`` alone is tens of thousands of lines and pybind11).
``plan`` reads how each C++ source begins: the run of ``#include <...>``
lines at its top, up to its last torch header (``torch/``, ``ATen/``, ``c10/``).
That prefix, exactly as written, becomes the precompiled header
(``precompiled_header``: built once per compiler, flags and header list, kept in
the cache and shared by every folder that begins the same way), and each
source that begins with it is compiled with it in front (``BuildConfig.pch_units``).

opforge's own ATen kit for users' code (``#include "opforge/aten/common.h"``,
what ``opforge new`` writes) counts as a torch header: it holds only torch's
headers and opforge's, so a source that begins with it gets it precompiled too.

A source is left alone when anything could make the header mean something
else for it: a ``#define``, ``#if`` or another quoted include before its torch
headers, no torch header at its top, or a folder on the include path (or the
source's own folder, for the kit) holding a file of one of the header's names
(``torch/extension.h`` of its own), which the file would find instead of
torch's or opforge's. GCC checks the rest (flags, macros from the command
line) and compiles without the header where it does not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from opforge.builder import store, toolchain
from opforge.builder.config import csrc_dir
from opforge.builder.recipe import BuildConfig
from opforge.builder.source_text import strip_comments
from opforge.builder.sources import CPP_SUFFIXES

_FORMAT = "1"
_MARKER = "COMPLETE.json"
_FAILED = "FAILED.json"
_STUB = "pch.h"
_RETRY_FAILED_S = 24 * 3600


@dataclass(frozen=True)
class Pch:
    """A built precompiled header: compile with ``flags()`` to use it."""

    header: Path  # the stub; its .gch lies beside it
    seconds: float | None  # the time it took to build now; None when reused

    @property
    def gch(self) -> Path:
        return self.header.with_name(self.header.name + ".gch")

    def flags(self) -> list[str]:
        return ["-include", str(self.header), "-Winvalid-pch"]


def key(headers: Sequence[str], flags: Sequence[str], compiler: str) -> str | None:
    """The entry's key, or None when the compiler is not found. A quoted
    header (``"my/all.h"``) found on the flags' ``-I`` paths counts by its
    contents too; torch's own headers count by the paths in the flags."""
    path = shutil.which(compiler)
    if path is None:
        return None
    real = os.path.realpath(path)
    st = os.stat(real)
    h = hashlib.sha256()
    for part in (_FORMAT, path, real, st.st_mtime_ns, st.st_size, toolchain.verdict(compiler).version, "|", *flags, "|", *headers):
        h.update(str(part).encode() + b"\0")
    dirs = [f[2:] for f in flags if f.startswith("-I") and len(f) > 2]
    dirs += [flags[i + 1] for i, f in enumerate(flags[:-1]) if f in ("-I", "-isystem")]
    for header in headers:
        if header.startswith('"'):
            for d in dirs:
                candidate = Path(d) / header.strip('"')
                if candidate.is_file():
                    h.update(candidate.read_bytes())
                    break
    return h.hexdigest()


@contextlib.contextmanager
def precompiled_header(headers: Sequence[str], flags: Sequence[str], *, compiler: str, quiet: bool = False) -> Iterator[Pch | None]:
    """Yields the precompiled ``headers`` for ``flags`` and ``compiler``,
    built now if the cache has no good one, and keeps it from being cleaned
    away until the block ends; yields None where there can be none (not GCC,
    ``OPFORGE_PCH=0``, or it failed to build: said once, and the build goes
    on without it).

    ``headers`` are include spellings (``<torch/library.h>``, ``"my/all.h"``);
    ``flags`` must be every flag the translation units are compiled with that
    can change what the headers mean (``-std``, ``-D``, ``-O``, ``-f``, ``-m``),
    plus the include paths that find them."""
    if os.environ.get("OPFORGE_PCH", "1") == "0" or not headers or not toolchain.is_gcc(compiler):
        yield None
        return
    k = key(headers, flags, compiler)
    if k is None:
        yield None
        return
    root = store.cache_root()
    entry = root / f"pch-{k[:16]}"
    lock = root / f"{entry.name}.lock"
    for _ in range(2):  # a second try if a cleaner removed it between the two locks
        seconds = None
        with store.exclusive(lock, quiet=quiet):
            failed = _failed_recently(entry)
            if not failed and not _is_current(entry):
                seconds = _build(entry, headers, flags, compiler, quiet=quiet)
                failed = seconds is None
        if failed:
            break
        with store.shared(lock):
            if _is_current(entry):
                with contextlib.suppress(OSError):
                    os.utime(entry)  # its last use, for `opforge cache clean --older-than`
                yield Pch(entry / _STUB, seconds)
                return
    yield None


def _failed_recently(entry: Path) -> bool:
    """A failed build is not tried again by every build that day: it costs
    as much as a compile, and says nothing new until something changes."""
    try:
        return time.time() - (entry / _FAILED).stat().st_mtime < _RETRY_FAILED_S
    except OSError:
        return False


def _is_current(entry: Path) -> bool:
    """Complete, and every header it was made from unchanged."""
    meta = store.read_json(entry / _MARKER)
    if not isinstance(meta, dict) or not (entry / (_STUB + ".gch")).is_file():
        return False
    for path, mtime_ns, size in meta.get("deps", []):
        try:
            st = os.stat(path)
        except OSError:
            return False
        if st.st_mtime_ns != mtime_ns or st.st_size != size:
            return False
    return True


def _deps(depfile: Path) -> list[list[object]]:
    """The headers of a GCC dependency file, each with its mtime and size."""
    text = depfile.read_text().replace("\\\n", " ").replace("\\ ", "\0")
    paths = [p.replace("\0", " ") for p in text.split(":", 1)[-1].split()]
    found = []
    for p in dict.fromkeys(paths):
        with contextlib.suppress(OSError):
            st = os.stat(p)
            found.append([os.path.abspath(p), st.st_mtime_ns, st.st_size])
    return found


def _build(entry: Path, headers: Sequence[str], flags: Sequence[str], compiler: str, *, quiet: bool) -> float | None:
    """Compiles the entry (its lock held); the seconds it took, or None on failure."""
    shutil.rmtree(entry, ignore_errors=True)
    entry.mkdir(mode=0o700, parents=True)
    stub = entry / _STUB
    stub.write_text("".join(f"#include {h}\n" for h in headers))
    tmp = entry / f"{_STUB}.{os.getpid()}.tmp.gch"
    argv = [compiler, *flags, "-x", "c++-header", str(stub), "-o", str(tmp), "-MD", "-MF", str(entry / "deps.d")]
    if not quiet:
        shown = ", ".join(headers)
        print(f"opforge: precompiling {shown} (once per compiler and flags)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        output = (res.stderr or res.stdout).strip().splitlines()
        store.write_json(entry / _FAILED, {"command": shlex.join(argv), "output": output[-40:]})
        if not quiet:
            why = f"details: {entry / _FAILED}"
            print(f"opforge: the precompiled header did not build; compiling without it ({why})", file=sys.stderr, flush=True)
        return None
    os.replace(tmp, entry / f"{_STUB}.gch")
    size = (entry / f"{_STUB}.gch").stat().st_size
    meta = {"seconds": round(seconds, 2), "size": size, "headers": list(headers), "compiler": compiler, "flags": list(flags)}
    store.write_json(entry / _MARKER, {**meta, "deps": _deps(entry / "deps.d")})
    return seconds


# The header families torch installs; a CUDA or HIP header (c10/cuda/...) needs the toolkit's.
_TORCH_FAMILY = ("torch/", "ATen/", "c10/")
_DEVICE_FOLDERS = {"cuda", "hip", "mps", "xpu", "mtia"}
# opforge's kit for users' builds, included quoted (found on the include path opforge adds).
KIT_HEADERS = ("opforge/aten/common.h",)
_DIRECTIVE = re.compile(r"#\s*(\w+)\s*(.*)")
_ANGLE = re.compile(r"<([^<>\s]+)>\s*$")
_QUOTED = re.compile(r'"([^"\s]+)"\s*$')


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which precompiled header a build gets, and for which of its sources."""

    headers: tuple[str, ...]  # include spellings, "<torch/extension.h>"; empty: none
    units: tuple[Path, ...]  # the .cpp sources that begin with exactly those headers
    why_not: str = ""  # why there is none, when there is none and a source wanted one

    def summary(self, root: Path, n_cpp: int) -> str:
        """One line for ``opforge build``'s description."""
        if not self.headers:
            return self.why_not or "none (no C++ source begins with torch's headers)"
        names = ", ".join(_rel(u, root) for u in self.units[:4]) + (f" and {len(self.units) - 4} more" if len(self.units) > 4 else "")
        return f"{' '.join(self.headers)} for {len(self.units)} of {n_cpp} C++ sources ({names}); built once, shared through the cache"


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def is_torch_header(name: str) -> bool:
    """A header torch installs and a C++-only build can parse (not a CUDA or HIP one)."""
    parts = name.split("/")
    device = any(p.lower() in _DEVICE_FOLDERS for p in parts[:-1]) or parts[-1].upper().startswith(("CUDA", "HIP"))
    return name.startswith(_TORCH_FAMILY) and not device


def torch_prefix(text: str) -> tuple[str, ...]:
    """The ``#include <...>`` lines ``text`` begins with, up to and with its
    last torch header, as spellings (``"<torch/extension.h>"``); empty when it
    does not begin with torch headers (a ``#define``, ``#if``, quoted include
    or code comes first). ``#pragma once`` and comments are passed over."""
    taken: list[str] = []
    last_torch = 0
    for raw in strip_comments(text).splitlines():
        line = raw.strip()
        if not line:
            continue
        m = _DIRECTIVE.fullmatch(line)
        if m is None or (m[1] == "pragma" and m[2].strip() != "once"):
            break  # code, or a pragma that may change how headers compile
        if m[1] == "pragma":
            continue
        if m[1] != "include":
            break
        angle = _ANGLE.fullmatch(m[2].strip())
        if angle is None:
            quoted = _QUOTED.fullmatch(m[2].strip())
            if quoted is not None and quoted[1] in KIT_HEADERS:
                taken.append(f'"{quoted[1]}"')
                last_torch = len(taken)
                continue
            break  # a quoted header may #define what torch's headers test
        name = angle[1]
        if name.startswith(_TORCH_FAMILY) and not is_torch_header(name):
            break  # a CUDA header: the host compiler alone cannot precompile it
        taken.append(f"<{name}>")
        if is_torch_header(name):
            last_torch = len(taken)
    return tuple(taken[:last_torch])


def shadowed(headers: Sequence[str], include_dirs: Sequence[Path]) -> str:
    """The first of ``include_dirs`` that holds a file of one of ``headers``'
    names, said as "<dir> has <name>"; "" when none does. The sources would
    find that file, the precompiled header torch's (or opforge's: its own
    kit, found where opforge keeps it, is the header, not a shadow)."""
    for d in include_dirs:
        for h in headers:
            name = h.strip('<>"')
            found = Path(d) / name
            if found.is_file() and not (h.startswith('"') and _is_kit(found, name)):
                return f"{d} has its own {name}"
    return ""


def _is_kit(path: Path, name: str) -> bool:
    kit = csrc_dir() / name
    return kit.is_file() and path.samefile(kit)


def plan(sources: Sequence[Path], include_dirs: Sequence[Path]) -> Plan:
    """The precompiled header for ``sources``: the torch prefix most of the
    C++ sources begin with (the first such source's on a tie), and those
    sources. ``OPFORGE_PCH=0`` turns it off."""
    prefixes = {s: torch_prefix(s.read_text(errors="replace")) for s in sources if s.suffix in CPP_SUFFIXES}
    counts = Counter(p for p in prefixes.values() if p)
    if not counts:
        return Plan((), ())
    if os.environ.get("OPFORGE_PCH", "1") == "0":
        return Plan((), (), "off (OPFORGE_PCH=0)")
    best = max(counts.values())
    headers = next(p for p in prefixes.values() if counts.get(p) == best)
    units = tuple(s for s, p in prefixes.items() if p == headers)
    # A quoted include is looked for in the including file's folder first.
    own = [u.parent for u in units] if any(h.startswith('"') for h in headers) else []
    if why := shadowed(headers, [*dict.fromkeys(own), *include_dirs]):
        return Plan((), (), f"none: {why}, which the sources would include instead of torch's")
    return Plan(headers, units)


def with_torch_pch(cfg: BuildConfig) -> tuple[BuildConfig, Plan]:
    """``cfg`` with the plan's precompiled header for its C++ sources, and the plan."""
    p = plan(cfg.sources, cfg.include_dirs)
    if not p.headers:
        return cfg, p
    return dataclasses.replace(cfg, pch_headers=p.headers, pch_units=p.units), p


__all__ = [
    "KIT_HEADERS",
    "Pch",
    "Plan",
    "is_torch_header",
    "key",
    "plan",
    "precompiled_header",
    "shadowed",
    "torch_prefix",
    "with_torch_pch",
]
