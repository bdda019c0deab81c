"""The GPUs through NVML, the driver's management library: names, compute
capabilities, memory and the driver version, without creating a CUDA context
(which costs hundreds of ms and would stop a forked DataLoader worker from using
CUDA). NVML lists every GPU, ignoring CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass


@dataclass
class GpuInfo:
    index: int
    name: str
    capability: str
    memory_gib: float | None = None


def query() -> tuple[list[GpuInfo], str | None, str | None] | None:
    """(GPUs, driver version, driver's CUDA version) through NVML, without a CUDA context; None without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        driver = buf.value.decode() if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0 else None
        cuda_ver = ctypes.c_int(0)
        driver_cuda = None
        # Absent from old drivers' NVML; ctypes raises AttributeError for a missing symbol.
        get_cuda_ver = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None)
        if get_cuda_ver is not None and get_cuda_ver(ctypes.byref(cuda_ver)) == 0 and cuda_ver.value:
            driver_cuda = f"{cuda_ver.value // 1000}.{cuda_ver.value % 1000 // 10}"
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        gpus = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                return None
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            name = buf.value.decode(errors="replace") if nvml.nvmlDeviceGetName(handle, buf, 96) == 0 else "?"
            mem = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
            gib = round(mem[0] / 2**30, 1) if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0 else None
            gpus.append(GpuInfo(index=i, name=name, capability=f"{major.value}.{minor.value}", memory_gib=gib))
        return gpus, driver, driver_cuda
    finally:
        nvml.nvmlShutdown()
