"""Precompiled torch headers for users' code (``opforge build PATH``).

Most of the compile time of a user's torch-facing file is torch's headers
(``torch/extension.h`` alone is tens of thousands of lines and pybind11).
``plan`` reads how each C++ source begins: the run of ``#include <...>``
lines at its top, up to its last torch header (``torch/``, ``ATen/``, ``c10/``).
That prefix, exactly as written, becomes the precompiled header
(``opforge.builder.pch``: built once per compiler, flags and header list, kept in
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

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from opforge.builder.binding import strip_comments
from opforge.builder.config import csrc_dir
from opforge.builder.discover import CPP_SUFFIXES
from opforge.builder.jit import BuildConfig

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


__all__ = ["KIT_HEADERS", "Plan", "is_torch_header", "plan", "shadowed", "torch_prefix", "with_torch_pch"]
