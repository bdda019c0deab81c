"""The eager fast path (csrc/fast/fast_python.cpp): a Python module, built
for this torch, whose ``fast_op(qualname)`` returns a callable that runs an
operator's kernel without torch.ops's generic argument parsing and without the
Python autograd kernel, when no gradient is needed. It returns NotImplemented
when it may not (a tensor needs a gradient, a tensor subclass, keyword
arguments, a __torch_function__ mode): the public function then takes the full
path. The same module holds the C++ autograd kernel of the operators that
write an argument (``writes_arguments``).

The op library itself is on PyTorch's stable ABI and loads in any torch from
its target on; this module uses torch's private autograd headers, so it is
built per torch (in the JIT cache, beside the library) and is optional: its
first build runs in the background, and until it is there, or when it cannot
be built (opforge says so once), every operator takes the torch.ops path,
with the same answers. ``OPFORGE_FAST=0`` turns it off.

That first build is a process of its own, detached from this one: it
finishes and publishes the module in the cache even when the process that
started it exits first (a short script, a test run), so the next process
finds it instead of starting the compile again. Processes that start while it
runs wait on the same cache lock instead of compiling it twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opforge.builder.config import fast_config
from opforge.builder.errors import BuildError
from opforge.builder.jit import build_library, cache_root, cached_path, load_module
from opforge.builder.store import fast_build_log

_module: types.ModuleType | None = None
#: Why the fast path is off, in words; empty while it is on (or not yet tried).
why_off = ""
_building: threading.Thread | None = None
_lock = threading.Lock()
_listeners: list[Callable[[types.ModuleType], None]] = []


def _wanted() -> bool:
    return os.environ.get("OPFORGE_FAST", "1") != "0"


def _cached() -> bool:
    return cached_path(fast_config()) is not None


def build_in_background() -> None:
    """Builds the module in a thread when the cache does not have it yet (the
    compiler is a subprocess): it attaches itself when done, without holding
    up ``import opforge``. The operators run through torch.ops meanwhile, with
    the same results."""
    global _building
    if _module is not None or _building is not None or not _wanted() or _cached():
        return

    def build() -> None:
        try:
            _build_in_a_process()
        except (RuntimeError, OSError) as exc:
            _off(exc)
            return
        _load(quiet=True)

    _building = threading.Thread(target=build, name="opforge-fast-build", daemon=True)
    _building.start()


def _build_in_a_process() -> None:
    """Builds the module into the cache in a detached child process
    (it outlives this one); returns when it is done. Raises RuntimeError with
    the build's message when it fails."""
    log = fast_build_log(cache_root(), os.getpid())
    package_parent = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OPFORGE_NO_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    code = f"from opforge.fast import _build_main; _build_main({str(log)!r})"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True
        )
    if proc.wait() != 0:
        text = log.read_text(errors="replace").strip() if log.exists() else ""
        log.unlink(missing_ok=True)
        raise RuntimeError(text or f"its build process exited {proc.returncode}")


def _build_main(log: str) -> None:
    """The build process: the module into the cache, quietly; its log removed
    when it worked (a failed build's log stays for whoever reads it)."""
    try:
        build_library(fast_config(), quiet=True)
    except (BuildError, OSError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    Path(log).unlink(missing_ok=True)


def _off(exc: BaseException) -> None:
    global why_off
    why_off = str(exc).splitlines()[0]
    print(
        f"opforge: the eager fast path is off ({why_off}); every operator runs through torch.ops, "
        "with the same results and a few microseconds more per call",
        file=sys.stderr,
    )


def _load(*, quiet: bool) -> types.ModuleType | None:
    global _module
    try:
        module, _ = load_module(fast_config(), quiet=quiet)
    except (BuildError, OSError, ImportError) as exc:
        _off(exc)
        return None
    with _lock:
        _module = module
        listeners = list(_listeners)
    for listener in listeners:
        listener(module)
    return module


def attach(*, wait: bool = False, quiet: bool = False) -> types.ModuleType | None:
    """The fast-path module: imported now when the cache has it (built now
    when no background build runs); None while a background build is still
    running (``wait``: until it is done), when turned off, or when it cannot
    be built (the reason in ``why_off``)."""
    global why_off
    if _module is not None:
        return _module
    if not _wanted():
        why_off = "OPFORGE_FAST=0"
        return None
    if _building is not None:
        if wait and _building.is_alive():
            if not quiet:
                print("opforge: waiting for the eager fast path's build (once per torch version)...", file=sys.stderr, flush=True)
            _building.join()
        return _module
    return _load(quiet=quiet)


def on_attach(listener: Callable[[types.ModuleType], None]) -> None:
    """Calls ``listener(module)`` once the module is there: now, or when a
    background build finishes."""
    with _lock:
        module = _module
        if module is None:
            _listeners.append(listener)
    if module is not None:
        listener(module)


def module() -> types.ModuleType | None:
    """The fast-path module when attached, else None."""
    return _module


class Context:
    """The ``ctx`` of a fast-path call that records a gradient: what a spec's
    setup_context and backward use of torch's (save_for_backward,
    saved_tensors, needs_input_grad, attributes). Its slots are read and
    written by the fast path directly; what else setup_context sets goes to
    its ``__dict__``."""

    __slots__ = ("__dict__", "needs_input_grad", "saved_tensors", "to_save")

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors


def fast_op(qualname: str) -> Callable[..., Any] | None:
    """The fast-path callable for ``ns::name``, or None (no fast module, or an
    operator it cannot call: one that writes an argument, or takes or returns
    types other than tensors, floats, ints and bools)."""
    if _module is None:
        return None
    return _module.fast_op(qualname)


__all__ = ["attach", "build_in_background", "fast_op", "module", "on_attach", "why_off"]
