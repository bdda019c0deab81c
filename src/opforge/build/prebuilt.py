"""Loading a library built elsewhere (CMake, setuptools, another machine) into
torch.ops, with the loader's errors turned into causes and fixes."""

from __future__ import annotations

import re
from pathlib import Path

from opforge.build.errors import BuildError
from opforge.build.jit import check_safe_to_load


def explain_load_error(path: Path, message: str) -> str:
    """The cause and the fix behind a dynamic loader's message, or "" if unknown."""
    if re.search(r"lib(c10|torch\w*)\.so", message) and "cannot open shared object file" in message:
        return (
            f"{path.name} needs torch's own libraries (libc10.so, libtorch*.so), which are found only once torch is "
            "imported: `import torch` before loading it (opforge.load_library does), or build it with an rpath to torch/lib"
        )
    if "undefined symbol" in message:
        symbol = message.rsplit("undefined symbol:", 1)[-1].strip()
        return (
            f"{path.name} was built against another torch (or another C++ ABI, _GLIBCXX_USE_CXX11_ABI) than this "
            f"process's torch: the symbol {symbol} is missing. Rebuild it with this torch; opforge's JIT cache keys on the "
            "torch version and rebuilds by itself"
        )
    if "wrong ELF class" in message or "invalid ELF header" in message:
        return f"{path.name} is not a shared library for this machine (another architecture, or a truncated file): rebuild it"
    return ""


def load_library_file(path: str | Path) -> Path:
    """Loads a TORCH_LIBRARY shared library built by any route into torch.ops.

    It must belong to this user and be writable by no one else; loader errors
    come back as a BuildError naming the cause and the fix."""
    import torch

    p = Path(path).resolve()
    if not p.is_file():
        raise BuildError(f"opforge: no library at {p}")
    check_safe_to_load(p, in_cache=False)
    try:
        torch.ops.load_library(str(p))
    except OSError as exc:
        why = explain_load_error(p, str(exc))
        raise BuildError(f"opforge: could not load {p}: {exc}" + (f"\n{why}" if why else "")) from exc
    return p


__all__ = ["explain_load_error", "load_library_file"]
