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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from opforge.builder import store, toolchain

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


__all__ = ["Pch", "key", "precompiled_header"]
