"""The command line's argument types and small helpers: argparse ``type=``
converters, the usage-error exit, the version and the run's seed."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import NoReturn


def usage_error(message: str) -> NoReturn:
    """A command line that asks for what is not there (an unknown operator,
    check, case or path) or a value out of range: exit status 2, as argparse
    gives its own usage errors, so that a script tells it from a failed check (1)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


#: The dtypes the operators take, and the other names people type for them.
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64"}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp64": "float64", "double": "float64"}  # fmt: skip


def dtype_list(text: str) -> str:
    """--dtype: comma-separated floating dtypes, aliases spelled out ("fp16" -> "float16")."""
    names = [n.strip().removeprefix("torch.") for n in text.split(",")]
    if not text.strip() or not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes ({', '.join(_DTYPES)}), got {text!r}")
    out = []
    for n in names:
        canonical = _DTYPES.get(n) or _DTYPE_ALIASES.get(n)
        if canonical is None:
            raise argparse.ArgumentTypeError(
                f"{n!r} is not a dtype the operators take; use {', '.join(_DTYPES)} (or fp32, fp16, bf16, fp64)"
            )
        out.append(canonical)
    return ",".join(dict.fromkeys(out))


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def existing_file(text: str) -> Path:
    """A file to read later (--compare): checked before anything is measured."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def pick_seed(seed: int | None) -> int:
    return random.SystemRandom().randrange(2**31) if seed is None else seed
