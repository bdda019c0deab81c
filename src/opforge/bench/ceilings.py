"""The machine's limits, measured once and cached: device-to-device copy
bandwidth (bytes read + written) and matrix-multiply throughput per dtype
through torch. A benchmark result is then a fraction of what the hardware did,
not of a datasheet number.

A ceiling measured while other work had the machine is low, and a low one
cached would make every later result look better than the hardware allows
(on a loaded 2-core VM: 139-196 % of limit). So each figure is the fastest of
its repetitions, a cache measured on a busy CPU is measured again on the first
idle run, and a run whose result beats the ceilings measures them again
(``Roofline``): each figure that comes out higher replaces the cached one.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from opforge.builder.store import cache_root

# Copy: 1 GiB on a GPU (many times any L2); 128 MiB on a CPU (past its caches,
# and quick on two cores). Matmul: 8192^3 fills an H100/H200 (measured: cuBLAS
# 687 TFLOP/s bf16 at that size); 1024^3 on a CPU takes ~0.1 s in float32.
_COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}
_MATMUL_N = {"cuda": 8192, "cpu": 1024}
_DTYPES = {"cuda": ("float32", "float16", "bfloat16"), "cpu": ("float32",)}
# A figure measured again replaces the cached one only when higher by more than
# this: the repetitions' own scatter, which would otherwise rewrite the cache on
# every run whose results pass the copy a little.
_NOISE = 0.02
# How far a time may beat its roofline floor before it is not believed: a copy
# reads a line and writes one, and on a CPU also reads the line it is about to
# write (write-allocate), so it moves 3 bytes for the 2 it is credited; a kernel
# that only reads is credited all it moves, up to 1.5x a copy's rate. Past that
# the figure is not the kernel's: the inputs were in cache, the cost model counts
# work the operator does not do (a quantised matmul's FLOPs at float32's rate),
# or the ceiling is wrong.
LIMIT_MARGIN = 1.5


@dataclass
class Ceilings:
    device_name: str
    torch_version: str
    date: str
    copy_gbps: float
    matmul_tflops: dict[str, float]
    # Why the machine was busy while these were measured (a loaded CPU), None if it was not:
    # such figures may be low, and are measured again on the first run that finds it idle.
    busy: str | None = None

    def raised_to(self, other: Ceilings) -> tuple[Ceilings, list[str]]:
        """Each figure the higher of ``self``'s and ``other``'s (``other`` a new
        measurement of the same machine), and the figures that rose, in words.
        A rise within the measurement's scatter (``_NOISE``) is not one."""
        rises = []
        copy = self.copy_gbps
        if other.copy_gbps > self.copy_gbps * (1 + _NOISE):
            copy = other.copy_gbps
            rises.append(f"copy {_rate(self.copy_gbps)} -> {_rate(other.copy_gbps)} GB/s")
        tflops = dict(self.matmul_tflops)
        for name, rate in other.matmul_tflops.items():
            old = tflops.get(name)
            if old is None or rate > old * (1 + _NOISE):
                tflops[name] = rate
                rises.append(f"{name} matmul {_rate(old) if old else 'none'} -> {_rate(rate)} TFLOP/s")
        # Figures that rose came from ``other``, as busy as it was; figures that did not
        # are confirmed by an idle ``other``.
        busy = other.busy if rises or self.busy else None
        date = other.date if rises else self.date
        return Ceilings(self.device_name, self.torch_version, date, copy, tflops, busy), rises

    def floor_us(self, nbytes: int, flops: int, dtype: str) -> float:
        """The roofline floor: the larger of moving the bytes at copy speed and
        doing the FLOPs at matmul speed (a bound no kernel beats by much)."""
        t_bytes = nbytes / (self.copy_gbps * 1e3)
        rate = self.matmul_tflops.get(dtype) or max(self.matmul_tflops.values())
        t_flops = flops / (rate * 1e6)
        return max(t_bytes, t_flops)


def slug(name: str) -> str:
    """``name`` as part of a file name: lower case, every run of other characters one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _best_seconds(fn: Callable[[], object], device: torch.device, reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of ``reps`` calls, after a warm-up. A ceiling is the most the
    machine did: a slower call was waiting for it (20 copies of 128 MiB on a
    shared 2-core VM at load 2: median 27.7 GB/s, fastest 30.9), and the
    buffers, larger than any cache, leave nothing for a fast call to find there."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return min(times)


def measure(device: torch.device, device_name: str, *, busy: str | None = None) -> Ceilings:
    """This machine's ceilings, measured now; ``busy``: why the machine is busy (recorded with them)."""
    kind = device.type
    n = _COPY_BYTES[kind] // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(functools.partial(dst.copy_, src), device, reps=20)
    tflops = {}
    size = _MATMUL_N[kind]
    for name in _DTYPES[kind]:
        dtype = getattr(torch, name)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        # float32 is timed as float32: TF32 would be another, faster dtype.
        allow = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            t = _best_seconds(functools.partial(torch.mm, a, b), device, reps=10)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow
        tflops[name] = 2 * size**3 / t / 1e12
    return Ceilings(
        device_name=device_name,
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        copy_gbps=2 * n * 4 / copy_s / 1e9,
        matmul_tflops=tflops,
        busy=busy,
    )


def cache_path(device_name: str) -> Path:
    return cache_root() / "ceilings" / f"{slug(device_name)}_torch-{slug(torch.__version__)}.json"


def save(ceilings: Ceilings) -> None:
    """Write ``ceilings`` to this machine's cache file."""
    path = cache_path(ceilings.device_name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # processes measuring at once (parallel tests) each write their own
    tmp.write_text(json.dumps(asdict(ceilings), indent=1))
    tmp.replace(path)


def load_or_measure(
    device: torch.device,
    device_name: str,
    *,
    remeasure: bool = False,
    busy: str | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Ceilings:
    """The cached ceilings of this machine, measured on first use. ``busy``: why
    the machine is busy now (None: idle). Ceilings cached from a busy machine
    are measured again on an idle one, each figure kept at the higher of the two."""
    path = cache_path(device_name)
    cached = None
    if not remeasure:
        with contextlib.suppress(OSError, ValueError, TypeError):  # none cached, or unreadable: measured below
            cached = Ceilings(**json.loads(path.read_text()))
    if cached is not None and not (cached.busy and not busy):
        return cached
    ceilings = measure(device, device_name, busy=busy)
    if cached is not None:
        ceilings, rises = cached.raised_to(ceilings)
        say(
            f"the cached ceilings were measured on a busy machine ({cached.busy}); measured again: "
            + (", ".join(rises) if rises else "none higher")
        )
    save(ceilings)
    return ceilings


class _Floored(Protocol):
    """What a roofline floor is computed for: a benchmark row."""

    bytes: int
    flops: int
    dtype: str
    floor_us: float | None


class Roofline:
    """The ceilings one run divides by. A time under a case's floor beats them,
    and a ceiling measured while the machine was busy is one reason it can: they
    are measured again (``measure_again``), once a run; each figure that comes out
    higher replaces the cached one (``save``), is said (``say``, and ``news``)
    and every row floored so far is floored again."""

    def __init__(
        self,
        ceilings: Ceilings,
        *,
        measure_again: Callable[[], Ceilings] | None = None,
        save: Callable[[Ceilings], None] = save,
        say: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.ceilings = ceilings
        self._measure_again = measure_again
        self._save = save
        self._say = say
        self.remeasured = False
        self.news: list[str] = []  # the ceilings that rose, in words, for the report
        self._rows: list[_Floored] = []

    def floor(self, row: _Floored) -> None:
        """Set ``row.floor_us``, again whenever the ceilings rise."""
        row.floor_us = self.ceilings.floor_us(row.bytes, row.flops, row.dtype)
        self._rows.append(row)

    def beaten(self, by: str) -> bool:
        """A time (``by``, in words) beat its floor: measure the ceilings again,
        the first time in this run. True if any rose."""
        if self.remeasured or self._measure_again is None:
            return False
        self.remeasured = True
        old = self.ceilings
        self.ceilings, rises = old.raised_to(self._measure_again())
        if not rises:
            self._say(f"{by} beat the machine's ceilings: measured again, none higher (copy {_rate(old.copy_gbps)} GB/s)")
            return False
        when = f"measured {_when(old.date)}" + (f" while {old.busy}" if old.busy else "")
        news = f"{by} beat the cached ceilings ({when}): measured again, {', '.join(rises)}; the cache now holds the higher figures"
        self.news.append(news)
        self._say(news)
        self._save(self.ceilings)
        for row in self._rows:
            row.floor_us = self.ceilings.floor_us(row.bytes, row.flops, row.dtype)
        return True

    def beyond(self, row: _Floored, impl: str, median_us: float) -> str | None:
        """Why ``impl``'s time ``median_us`` is past what the machine's limits
        allow for the row's case by more than ``LIMIT_MARGIN``, in words; None
        if it is not."""
        if not row.floor_us or median_us * LIMIT_MARGIN >= row.floor_us:
            return None
        c = self.ceilings
        pct = 100 * row.floor_us / median_us
        again = ", and again in this run" if self.remeasured else ""
        busy = ", or the ceilings, measured while the machine was busy, are low (--remeasure on an idle machine)" if c.busy else ""
        t_bytes = row.bytes / (c.copy_gbps * 1e3)
        if t_bytes >= row.floor_us:
            return (
                f"{impl} at {pct:,.0f} % of limit moved its {_bytes(row.bytes)} faster than the {_rate(c.copy_gbps)} GB/s this machine's "
                f"copy reached (measured {_when(c.date)}{again}), by more than a kernel can gain over a copy ({LIMIT_MARGIN}x): its inputs "
                f"came from cache, or its cost model counts bytes the operator does not move{busy}"
            )
        rated = row.dtype if row.dtype in c.matmul_tflops else max(c.matmul_tflops, key=c.matmul_tflops.__getitem__)
        return (
            f"{impl} at {pct:,.0f} % of limit did its {row.flops / 1e9:,.3g} GFLOP faster than the {_rate(c.matmul_tflops[rated])} TFLOP/s "
            f"this machine's {rated} matmul reached (measured {_when(c.date)}{again}): the operator computes in another type, "
            f"or fewer FLOPs than its cost model counts{busy}"
        )


def _when(date: str) -> str:
    """An ISO date and time as "2026-11-26 16:11 UTC"."""
    return date[:16].replace("T", " ") + " UTC" if len(date) >= 16 else date


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.3g} {unit}"
    return f"{n} bytes"


def roofline(
    device: torch.device,
    device_name: str,
    *,
    remeasure: bool = False,
    busy: Callable[[], str | None] = lambda: None,
    say: Callable[[str], None] = lambda _: None,
) -> Roofline:
    """This machine's ceilings for a run (``load_or_measure``), measured again
    if a result beats them. ``busy``: why the machine is busy now, or None."""
    ceilings = load_or_measure(device, device_name, remeasure=remeasure, busy=busy(), say=say)
    return Roofline(ceilings, measure_again=lambda: measure(device, device_name, busy=busy()), say=say)
