"""The machine's limits, measured once and cached: device-to-device copy
bandwidth (bytes read + written) and matrix-multiply throughput per dtype
through torch. A benchmark result is then a fraction of what the hardware did,
not of a datasheet number."""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opforge.builder import cache_root

# Copy: 1 GiB on a GPU (many times any L2); 128 MiB on a CPU (past its caches,
# and quick on two cores). Matmul: 8192^3 fills an H100/H200 (DESIGN: cuBLAS
# 687 TFLOP/s bf16 at that size); 1024^3 on a CPU takes ~0.1 s in float32.
_COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}
_MATMUL_N = {"cuda": 8192, "cpu": 1024}
_DTYPES = {"cuda": ("float32", "float16", "bfloat16"), "cpu": ("float32",)}


@dataclass
class Ceilings:
    device_name: str
    torch_version: str
    date: str
    copy_gbps: float
    matmul_tflops: dict[str, float]

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


def _median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
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
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: torch.device, device_name: str) -> Ceilings:
    kind = device.type
    n = _COPY_BYTES[kind] // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(functools.partial(dst.copy_, src), device, reps=20)
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
            t = _median_seconds(functools.partial(torch.mm, a, b), device, reps=10)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow
        tflops[name] = 2 * size**3 / t / 1e12
    return Ceilings(
        device_name=device_name,
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        copy_gbps=2 * n * 4 / copy_s / 1e9,
        matmul_tflops=tflops,
    )


def cache_path(device_name: str) -> Path:
    return cache_root() / "ceilings" / f"{slug(device_name)}_torch-{slug(torch.__version__)}.json"


def load_or_measure(device: torch.device, device_name: str, *, remeasure: bool = False) -> Ceilings:
    """The cached ceilings of this machine, measured on first use."""
    path = cache_path(device_name)
    if not remeasure:
        try:
            return Ceilings(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    ceilings = measure(device, device_name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # processes measuring at once (parallel tests) each write their own
    tmp.write_text(json.dumps(asdict(ceilings), indent=1))
    tmp.replace(path)
    return ceilings
