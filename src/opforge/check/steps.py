"""What every check of ``opforge check`` shares: its result, the names of its
steps, and what happens around each call of the operator.

A step is one call (or one torch.library / autograd utility run) of the
operator on one sample. Before it, ``step`` tells a watcher which operator,
check and sample it is (``opforge.check.process`` runs the checks in a process
of their own and reports from that which step killed it or ran past its time
limit); after it, ``settle`` makes a CUDA kernel's failure surface in that
step, named by its sample, rather than in whatever calls CUDA next.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException

from opforge.check.values import ErrorStats
from opforge.opspec import OpSpec, Sample


@dataclass
class CheckResult:
    op: str
    check: str
    status: str  # "pass", "fail" or "n/a"
    count: int = 0
    failures: list[str] = field(default_factory=list)
    # Why a check is n/a; for a pass or a failure, what the report says under its table
    # (the dtype and tolerances gradcheck used, the layouts an operator refused).
    note: str = ""
    worst: dict[str, ErrorStats] = field(default_factory=dict)  # reference check: per case
    # A word or two the table shows beside the verdict ("float32", "SIGFPE").
    tag: str = ""
    # A step of this check killed the process that ran it, or ran past the time limit (opforge.check.process).
    crashed: bool = False

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def close(self) -> CheckResult:
        """Pass or fail by the failures found."""
        self.status = "fail" if self.failures else "pass"
        return self


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sample_label(spec: OpSpec, dtype: torch.dtype, sample: Sample) -> str:
    return f"{spec.name} {dtype_name(dtype)} [{sample.desc}]"


def first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"


def map_tensors(args: Sequence[Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    return tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args)


def with_grad(spec: OpSpec, sample: Sample) -> Sample:
    """The sample with every non-mutated floating input requiring grad (views keep their strides)."""
    mutated = set(spec.mutated_args)
    args = tuple(
        a.detach().requires_grad_() if isinstance(a, torch.Tensor) and i not in mutated and a.is_floating_point() else a
        for i, a in enumerate(sample.args)
    )
    return Sample(args, sample.kwargs, sample.desc)


# --- fake tensors ---


def fake_call(spec: OpSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The call as torch.compile traces it: through the fake kernel, on fake
    tensors (one per real tensor, so that aliased inputs stay aliased)."""
    mode = FakeTensorMode()
    memo: dict[int, Any] = {}

    def fake(x: Any) -> Any:
        return memo.setdefault(id(x), mode.from_tensor(x)) if isinstance(x, torch.Tensor) else x

    fargs, fkwargs = [fake(a) for a in args], {k: fake(v) for k, v in kwargs.items()}
    # torch logs every exception a fake kernel raises, with its traceback; here
    # the exception is the expected answer, so it stays out of the report.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with mode:
            spec.overload(*fargs, **fkwargs)
    finally:
        log.setLevel(level)


def missing_fake(spec: OpSpec, sample: Sample, check: str) -> str:
    """ "" where the operator runs on fake tensors; else the one line ``check``
    reports: that no fake kernel is registered, and how to register one.
    opcheck, torch.compile and torch.export all trace the operator on fake
    tensors, and each fails without one in words of its own (opcheck: "scroll
    up for stack trace", with nothing to scroll up to)."""
    try:
        fake_call(spec, sample.args, dict(sample.kwargs))
    except Exception as exc:  # noqa: BLE001 - a fake kernel's own error: the check reports it in its own run
        # An operator with no fake kernel, and a torch.library.custom_op whose Meta kernel says it has none.
        if isinstance(exc, UnsupportedOperatorException) or "no fake impl registered" in str(exc):
            ns, name = spec.qualname.split("::", 1)
            return (
                f"{spec.qualname} has no fake kernel, which {check} needs (it traces the operator on fake tensors): "
                f'register one in Python with torch.library.register_fake("{spec.qualname}") (or the spec\'s fake=), '
                f'or in C++ with m.impl("{name}", ...) in TORCH_LIBRARY_IMPL({ns}, Meta, m)'
            )
    return ""


# --- steps ---

Watcher = Callable[[str, str, str], None]
_watcher: Watcher | None = None


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """While active, ``watcher(qualname, check, label)`` is called before each step."""
    global _watcher
    before, _watcher = _watcher, watcher
    try:
        yield
    finally:
        _watcher = before


def step(spec: OpSpec, check: str, label: str) -> None:
    """The step about to run: the operator, the check and the sample (its label)."""
    if _watcher is not None:
        _watcher(spec.qualname, check, label)


# --- CUDA errors, where they happen ---

_cudart_handles: dict[str, Any] = {}


def _cudarts() -> list[Any]:
    """Each CUDA runtime library mapped into this process (torch's, and an
    extension's own where it links another copy): a kernel launch that fails
    leaves its error in the runtime that launched it, to be returned by the next
    ``cudaGetLastError`` there. Read again at each call: a library loaded later
    may bring its own."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart" in line}
    except OSError:
        return []
    for path in sorted(paths - _cudart_handles.keys()):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.cudaGetLastError.restype = ctypes.c_int
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            lib = None
        _cudart_handles[path] = lib
    return [lib for path, lib in _cudart_handles.items() if path in paths and lib is not None]


class KernelError(RuntimeError):
    """A CUDA error the operator's call left behind: a launch that failed, or a kernel that faulted."""


def settle(device: torch.device) -> None:
    """On CUDA: waits for the work the operator's call queued and raises
    KernelError for an error it left, so that the step that made it reports it.
    A launch that fails (an empty grid, too many threads per block) is not seen
    by the stream: its error waits in the runtime for the next launch, which may
    be PyTorch's own, in another check."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        # A launch of PyTorch's checks the runtime's last error: a failed launch of the operator's surfaces here.
        torch.ones(1, device=device).add_(1)
    except Exception as exc:  # noqa: BLE001 - torch.AcceleratorError, or RuntimeError on older torch
        what = first_line(exc).split(": ", 1)[-1].removeprefix("CUDA error: ")
        raise KernelError(f"CUDA error after the operator's call: {what}") from None
    for lib in _cudarts():
        code = lib.cudaGetLastError()
        if code:
            name = lib.cudaGetErrorString(code).decode(errors="replace")
            raise KernelError(f"CUDA error after the operator's call: {name} (error {code}: a kernel launch failed)")


def device_healthy(device: torch.device) -> bool:
    """False when CUDA can no longer run anything here (a kernel faulted: the
    context is lost for the rest of the process)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False
