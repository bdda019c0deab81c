"""A library that would not load for a missing symbol, said in the user's
words: the symbol demangled, the sources that call it, and the source that
defines it where the build left that one out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from opforge.builder.binding import strip_comments
from opforge.builder.cuda_flag import build_cuda_flag
from opforge.builder.errors import BuildError, sanitizer_note

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
