"""Turns a failed ninja run into the compiler's own words, with file and line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


class BuildError(RuntimeError):
    """A build of an op library failed; the message says where and why."""


def load_reason(exc: BaseException) -> str:
    """Why a library did not load, in the dynamic loader's words: torch's
    ``load_library`` says only "Could not load this library: PATH" and keeps
    the loader's own message (an undefined symbol, a missing libc10.so) as the
    cause; and, for a library built with ``-fsanitize=``, how to load it."""
    cause = exc.__cause__
    reason = str(cause) if isinstance(cause, OSError) and str(cause) else str(exc)
    note = sanitizer_note(reason)
    return f"{reason}; {note}" if note else reason


# A sanitizer's instrumentation calls into its runtime (__asan_*, __ubsan_*), which python does not
# load and which must come first in the process: the loader says only that a symbol is undefined.
_SANITIZER = re.compile(r"\b__(asan|ubsan|tsan|lsan)_\w+|\b(ASan|UBSan|TSan|LSan) runtime does not come first")
_RUNTIMES = {"asan": ("address", "libasan.so"), "ubsan": ("undefined", "libubsan.so"), "tsan": ("thread", "libtsan.so"),
             "lsan": ("leak", "liblsan.so")}  # fmt: skip


def runtime_not_first(needed: tuple[str, ...]) -> str | None:
    """The note for a library that links a sanitizer's runtime (DT_NEEDED ``needed``)
    which must come first in the process and is not loaded in this one: loading it
    here would end the process (ASan: "runtime does not come first"); else None."""
    for kind, tag in (("asan", "ASan"), ("tsan", "TSan")):
        runtime = _RUNTIMES[kind][1]
        if any(n.startswith(runtime) for n in needed) and not _loaded_here(runtime):
            return sanitizer_note(f"{tag} runtime does not come first")
    return None


def _loaded_here(runtime: str) -> bool:
    try:
        return f"/{runtime}" in Path("/proc/self/maps").read_text()
    except OSError:
        return True  # cannot tell: leave it to the loader


def sanitizer_note(text: str) -> str | None:
    """How to load a library built with ``-fsanitize=`` (OPFORGE_CXXFLAGS, or a
    build's own flags), where ``text`` (a loader's message, a load's output)
    shows that its sanitizer's runtime is missing; else None."""
    m = _SANITIZER.search(text)
    if m is None:
        return None
    kind = (m[1] or m[2]).lower()
    flag, runtime = _RUNTIMES[kind]
    # LeakSanitizer (part of ASan) would report python's own allocations, never freed, at exit.
    options = " ASAN_OPTIONS=detect_leaks=0" if kind == "asan" else ""
    return (
        f"the library was built with -fsanitize={flag}, whose runtime must be loaded first in the process: "
        f"run LD_PRELOAD=$(gcc -print-file-name={runtime}){options} python ..., or build without -fsanitize={flag}"
    )


@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int
    message: str


# gcc/clang: "path/file.cpp:12:5: error: ..." (also "fatal error:")
_GCC = re.compile(r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<msg>.*)$")
# nvcc front end: "path/file.cu(12): error: ..."
_NVCC = re.compile(r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<msg>.*)$")
_LINKER = re.compile(r"(undefined reference to .*|cannot find -l\S+)")

# How much of the compiler's output to show inline; the rest is in the log.
_MAX_LINES = 40


def parse_diagnostics(output: str) -> list[Diagnostic]:
    """The compiler errors in a build log, first to last, without repeats."""
    seen: set[tuple[str, int, str]] = set()
    found: list[Diagnostic] = []
    for raw in output.splitlines():
        m = _GCC.match(raw.strip()) or _NVCC.match(raw.strip())
        if m:
            d = Diagnostic(m["file"], int(m["line"]), m["msg"].strip())
            if (d.file, d.line, d.message) not in seen:
                seen.add((d.file, d.line, d.message))
                found.append(d)
    return found


def _compiler_output(output: str) -> list[str]:
    """The output of the failed commands: ninja's status lines and the giant
    command lines are dropped, the compiler's messages kept."""
    kept: list[str] = []
    in_failure = False
    for line in output.splitlines():
        if line.startswith("FAILED:"):
            in_failure = True
            continue
        if re.match(r"^\[\d+/\d+\] ", line) or line.startswith("ninja: "):
            in_failure = False
            continue
        if in_failure and not re.match(r"^\S*(c\+\+|g\+\+|gcc|clang\+\+|nvcc)\s", line):
            kept.append(line)
    return kept


def explain_build_failure(name: str, output: str, log: Path) -> BuildError:
    """A BuildError whose message leads with file:line of each compiler error."""
    diags = parse_diagnostics(output)
    lines = [f"opforge: building {name} failed."]
    if diags:
        lines.append(f"{len(diags)} compiler error(s):")
        lines += [f"  {d.file}:{d.line}: {d.message}" for d in diags[:10]]
    else:
        linker = _LINKER.findall(output)
        if linker:
            lines.append("link errors:")
            lines += [f"  {m}" for m in dict.fromkeys(linker)][:10]
    body = _compiler_output(output) or output.splitlines()[-_MAX_LINES:]
    if body:
        lines.append("compiler output:")
        lines += body[:_MAX_LINES]
        if len(body) > _MAX_LINES:
            lines.append(f"  ... {len(body) - _MAX_LINES} more lines")
    lines.append(f"full log: {log}")
    return BuildError("\n".join(lines))
