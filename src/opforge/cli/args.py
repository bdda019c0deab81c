"""The command line's argument types and small helpers: argparse ``type=``
converters, the usage-error exit, the version and the run's seed."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn


def usage_error(message: str) -> NoReturn:
    """A command line that asks for what is not there (an unknown operator,
    check, case or path) or a value out of range: exit status 2, as argparse
    gives its own usage errors, so that a script tells it from a failed check (1)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors in one line (the command, the
    option, the value refused, where the usage is), exit status 2; the full
    usage of a command of many options would bury the one line that matters."""

    def error(self, message: str) -> NoReturn:
        usage_error(f"{self.prog}: error: {message} ({self.prog} --help for usage)")


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


class NumericOption:
    """An argparse ``type=`` for a number within a range: NaN, infinities, and
    values out of [``low``, ``high``] are refused, so that ``--older-than nan``
    cannot compare false against every age and remove every entry. ``expect``
    says what is taken, in the error. Every numeric option of the command takes
    one (the command line's tests walk the parser for them)."""

    def __init__(self, kind: type, expect: str, low: float, high: float, *, low_open: bool = False) -> None:
        self.kind, self.expect, self.low, self.high, self.low_open = kind, expect, low, high, low_open
        self.__name__ = expect  # argparse names a type by it

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text.strip())
            number = float(value)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {self.expect}, got {text!r}") from None
        # NaN compares false both ways: refused by the first test as by the others.
        if number != number or not (value > self.low if self.low_open else value >= self.low) or not value <= self.high:
            raise argparse.ArgumentTypeError(f"expected {self.expect}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"NumericOption({self.expect!r})"


#: Seconds of timing per case, or of a check's step before it is killed: up to a day.
positive_seconds = NumericOption(float, "a number of seconds > 0 and at most 86400 (a day)", 0, 86400, low_open=True)
#: --older-than: days since an entry was used, up to a century.
days = NumericOption(float, "a number of days from 0 to 36500", 0, 36500)
#: --seed: torch.manual_seed takes at most 2^64 - 1, a CUDA generator's Philox seed only a signed 64 bits.
seed = NumericOption(int, "an integer from 0 to 2^63 - 1", 0, 2**63 - 1)
#: --seeds: fresh seeds per sample, each one more run of the reference check.
seed_count = NumericOption(int, "an integer from 1 to 1000", 1, 1000)
#: Calls before the profiled one.
call_count = NumericOption(int, "an integer from 0 to 10000", 0, 10_000)


def output_file(text: str) -> Path:
    """A file to write after the run (--json, --csv, --plot): checked writable
    before anything is measured, by creating (and removing) a file beside it,
    which is what tells on a read-only file system or a folder of another
    user's too. An existing file is opened for appending, which leaves it as it is."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {path}: {parent} {what}")
    try:
        if path.exists():
            with path.open("ab"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".opforge-write-test-"):
                pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def bench_json(text: str) -> Path:
    """--compare: an earlier ``opforge bench --json``, read and checked before anything is measured."""
    path = existing_file(text)
    try:
        data = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        what = "is empty" if not path.read_bytes().strip() else f"is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        raise argparse.ArgumentTypeError(f"{path} {what}; give a file written by opforge bench --json") from None
    if problem := _bench_json_problem(data):
        raise argparse.ArgumentTypeError(f"{path} is not a file of opforge bench --json: {problem}")
    # lazy: import time (opforge.bench, 29 ms, only when the option is given)
    from opforge.bench.results import read_json

    try:
        read_json(path)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"{path} is not a file of opforge bench --json: {exc}") from None
    return path


def _bench_json_problem(data: Any) -> str | None:
    """What makes ``data`` something other than a report of opforge bench --json; None if nothing."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    missing = [k for k in ("device", "device_name", "torch_version", "date", "rows") if k not in data]
    if missing:
        return f"no {', '.join(missing)}"
    if not isinstance(data["rows"], list):
        return "rows is not a list"
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("op", "dtype", "case", "status")):
            return f"row {i} has no op, dtype, case and status"
        timings = row.get("timings", {})
        if not isinstance(timings, dict):
            return f"row {i}: timings is not an object"
        for impl, t in timings.items():
            if t is None:
                continue
            fields = ("median_us", "p25_us", "p75_us")
            if not isinstance(t, dict) or not all(_positive_number(t.get(k)) for k in fields):
                return f"row {i}: the timing of {impl} has no times {', '.join(fields)} > 0"
    return None


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def existing_file(text: str) -> Path:
    """A file to read later (--compare): checked before anything is measured."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def pick_seed(seed: int | None) -> int:
    return random.SystemRandom().randrange(2**31) if seed is None else seed
