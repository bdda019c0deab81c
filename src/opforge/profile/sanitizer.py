"""compute-sanitizer's side of ``opforge profile --sanitize``: its command
line over ``opforge check`` and the parser of what its tools report."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

SANITIZER_TOOLS: tuple[str, ...] = ("memcheck", "racecheck", "initcheck", "synccheck")
_SANITIZER_OPTIONS: dict[str, tuple[str, ...]] = {
    # PyTorch keeps allocations alive in its caching allocator until exit: every one would be a "leak".
    "memcheck": ("--leak-check", "no"),
}
#: compute-sanitizer's exit status when its tool reported an error.
SANITIZER_ERROR_EXIT = 9


@dataclass
class SanitizerReport:
    errors: int  # -1: no "ERROR SUMMARY" line (the tool did not finish)
    kernels: list[str]
    kinds: list[str]  # distinct error headlines, "Invalid __global__ write of size 4 bytes"


_SUMMARY = re.compile(r"ERROR SUMMARY:\s*([\d,]+)\s+errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:.*?\(([\d,]+)\s+errors?")
_PREFIX = re.compile(r"^=+\s*")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")
# "kernel(float *)+0x1b0" or "kernel(float *)+0x1b0 in /src/add.cu:41": the kernel, then its offset.
_AT_OFFSET = re.compile(r"^(.+?)\+0x[0-9a-fA-F]+(?: in .+)?$")
# "add.cu:41" or, in older versions, "add.cu:41:kernel(int*)".
_SOURCE = re.compile(r"^\S+\.(?:cu|cuh|h|hpp|cpp|cc|c|py):\d+(?::(.+))?$")
# racecheck names both sides of a race on one line or two.
_ACCESS = re.compile(r"\b(?:Write|Read) access at (.+?)(?= and (?:Write|Read) access|\s*\[[\d,]+ hazards?\]|$)")
_API_ACCESS = re.compile(r"\bon access by (cuda\w+|cu\w+)")
_HEADLINE = re.compile(
    r"^((?:Invalid|Uninitialized|Barrier error|Race reported|Error:|Program hit|Host API|Malloc/Free error|Out-of-range|Potential)\b.*)"
)


def _kernel_of(location: str) -> str | None:
    """The kernel in a sanitizer location ("0x1b0 in k(float *)", "k(float *)+0x1b0 in add.cu:41",
    "0x250 in add.cu:41:k(int*)"), or None where it names only an address or a source line."""
    loc = location.strip()
    if m := _AT_OFFSET.match(loc):
        return m.group(1).strip()
    for part in (p.strip() for p in loc.split(" in ")):
        if not part or _ADDRESS.match(part):
            continue
        if src := _SOURCE.match(part):
            if src.group(1):
                return src.group(1).strip()
            continue
        return part
    return None


def _kernels_named(line: str) -> list[str | None]:
    """The kernels (or host API calls) one line of an error record names."""
    if races := _ACCESS.findall(line):
        return [_kernel_of(loc) for loc in races]
    if line.startswith("at "):
        return [_kernel_of(line[3:])]
    if line.startswith("Device Frame:"):  # older versions' device backtraces
        return [line.removeprefix("Device Frame:").split(" (", 1)[0].strip()]
    if m := _API_ACCESS.search(line):
        return [f"({m.group(1)})"]  # a host API call (a copy) read the memory, not a kernel
    return []


def parse_sanitizer(text: str) -> SanitizerReport:
    """The error count, the kernels named and the distinct error headlines of one tool's output."""
    errors = -1
    kernels: list[str] = []
    kinds: list[str] = []
    for raw in text.splitlines():
        # Every line the sanitizer writes starts with "=========": the checked program's own output does not.
        if not raw.startswith("=="):
            continue
        line = _PREFIX.sub("", raw).strip()
        if m := _SUMMARY.search(line):
            errors = int(m.group(1).replace(",", ""))
            continue
        if (m := _RACE_SUMMARY.search(line)) and errors < 0:
            errors = int(m.group(1).replace(",", ""))
            continue
        for k in _kernels_named(line):
            if k and k not in kernels:
                kernels.append(k)
        if (h := _HEADLINE.match(line)) and h.group(1) not in kinds:
            kinds.append(h.group(1))
    return SanitizerReport(errors, kernels, kinds)


def parse_sanitizer_summary(text: str) -> tuple[int, list[str]]:
    """(errors, kernels) from compute-sanitizer's output: the count on its
    "ERROR SUMMARY: N errors" line (-1 if there is none: the tool did not finish)
    and the kernels its error records name, in order of first appearance."""
    rep = parse_sanitizer(text)
    return rep.errors, rep.kernels


def sanitizer_command(sanitizer: str, tool: str, op: str | Sequence[str], seed: int, *, python: str = sys.executable) -> list[str]:
    """The compute-sanitizer command line that runs ``opforge check OP [OP ...]``
    on CUDA under ``tool``; an OP may be a package directory (``opforge check DIR``)."""
    ops = [op] if isinstance(op, str) else list(op)
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(SANITIZER_ERROR_EXIT),
        *_SANITIZER_OPTIONS.get(tool, ()),
        python,
        "-m",
        "opforge",
        "check",
        *ops,
        "--device",
        "cuda",
        "--checks",
        "reference",
        "--reference-on",
        "cpu",
        "--seed",
        str(seed),
    ]
