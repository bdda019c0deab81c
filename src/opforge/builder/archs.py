"""The CUDA architecture policy: which archs a build targets, the nvcc
``-gencode`` flags for them, and which GPUs a library built for them runs on.

Every route follows it: the JIT, setuptools and inline builds
(``cuda_archs``, ``gencode_flags``), the prebuilt-library check
(``arch_covered``) and CMakeLists.txt, which runs this file as a script::

    python -I src/opforge/builder/archs.py "8.0;9.0+PTX"
    8.0;9.0a
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90

Nothing but the standard library is imported at module level: CMake runs it
before torch is found, and importing the ``opforge`` package would load (and
perhaps build) the op library.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: The archs of a CUDA build on a machine without GPUs, and of a CMake build
#: without TORCH_CUDA_ARCH_LIST (CMake never looks at the GPUs).
DEFAULT_ARCHS: tuple[str, ...] = ("8.0", "9.0a")

_ARCH = re.compile(r"^(\d+)\.(\d+)a?$")


def cuda_home() -> Path | None:
    """Where the CUDA toolkit is, found as torch.utils.cpp_extension finds it
    (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda) without importing
    that module: it pulls in setuptools, about 0.5 s of every import."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def arch_number(arch: str) -> tuple[int, int]:
    """(major, minor) of "9.0" or "9.0a"; a ValueError for anything else."""
    m = _ARCH.match(arch.strip())
    if m is None:
        raise ValueError(f"opforge: {arch!r} is not a CUDA arch: write major.minor, such as 8.0, 9.0 or 9.0a (sm_90a)")
    return int(m[1]), int(m[2])


def normalise_archs(archs: Iterable[str]) -> tuple[str, ...]:
    """The archs as built: "9.0" and "9.0a" name one target (sm_90a SASS),
    numeric order, so that 10.0 sorts after 9.0a."""
    named = {"9.0a" if a.strip() in ("9.0", "9.0a") else a.strip() for a in archs}
    return tuple(sorted(named, key=arch_number))


def parse_arch_list(value: str) -> tuple[str, ...]:
    """A ``TORCH_CUDA_ARCH_LIST`` value ("8.0;9.0+PTX", "9.0a 8.6") as
    ``normalise_archs`` gives them; () for an empty one. "+PTX" is dropped:
    ``gencode_flags`` always embeds PTX for the newest arch."""
    return normalise_archs(a.removesuffix("+PTX") for a in value.replace(";", " ").split())


def cuda_archs() -> tuple[str, ...]:
    """Target compute capabilities: ``TORCH_CUDA_ARCH_LIST`` if set, else the
    visible GPUs', else ``DEFAULT_ARCHS`` (a CUDA build on a machine without GPUs).

    A 9.0 target is always built as 9.0a: Hopper's warpgroup MMA (``wgmma``)
    and ``setmaxnreg``, which the GEMM kernels use, exist only in sm_90a code,
    and an sm_90a cubin runs on every 9.0 GPU. Sorted oldest first, by number.
    """
    env = parse_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    if env:
        return env
    return present_archs() or DEFAULT_ARCHS


def present_archs() -> tuple[str, ...]:
    """The archs of this machine's GPUs, as ``normalise_archs`` gives them; () without any."""
    caps = _nvml_capabilities()
    if caps is None:
        # lazy: CMake runs archs.py as a script before torch is found: neither torch nor opforge at its top
        import torch

        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return normalise_archs(f"{ma}.{mi}" for ma, mi in caps) if caps else ()


#: Set to 1 (or true, yes, on): a project's every arch is built, not only this machine's GPUs' (``narrowed``).
ALL_ARCHS_VAR = "OPFORGE_ALL_ARCHS"
_GENCODE = ("-gencode", "--generate-code")
_CODE = re.compile(r"\b(sm|compute)_(\d+)([af]?)\b")


def all_archs_asked() -> bool:
    return os.environ.get(ALL_ARCHS_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _same(a: str, b: str) -> bool:
    """One GPU generation: 9.0 and 9.0a, 10.0 and 10.0f."""
    return arch_number(a.rstrip("af")) == arch_number(b.rstrip("af"))


def _gencodes(flags: Sequence[str]) -> list[tuple[list[str], str]]:
    """``flags`` grouped: each ``-gencode`` (``--generate-code``) with its value, one or two
    tokens, and its value's text; every other flag alone, with ""."""
    out: list[tuple[list[str], str]] = []
    i = 0
    while i < len(flags):
        f = flags[i]
        if f in _GENCODE and i + 1 < len(flags):
            out.append(([f, flags[i + 1]], flags[i + 1]))
            i += 2
            continue
        opt = next((o for o in _GENCODE if f.startswith(o + "=")), None)
        out.append(([f], f[len(opt) + 1 :] if opt else ""))
        i += 1
    return out


def _sass(spec: str) -> list[str]:
    """The archs a -gencode value compiles machine code for: "arch=compute_90a,code=[sm_90a,compute_90a]" gives 9.0a."""
    code = spec.split("code=", 1)[-1] if "code=" in spec else spec
    return [f"{int(d[:-1])}.{d[-1]}{x}" for kind, d, x in _CODE.findall(code) if kind == "sm"]


def gencode_archs(flags: Sequence[str]) -> tuple[str, ...]:
    """The archs nvcc ``flags`` compile machine code for, by their -gencode flags, in order."""
    return tuple(dict.fromkeys(a for _, spec in _gencodes(flags) if spec for a in _sass(spec)))


def narrowed(asked: Sequence[str], here: Sequence[str]) -> tuple[str, ...] | None:
    """The archs of ``asked`` that this machine's GPUs (``here``) are, when every
    GPU here is one of them and some are not here; None otherwise (nothing to
    leave out, no GPU here, or a GPU here that none of them is)."""
    if not here or not all(any(_same(a, h) for a in asked) for h in here):
        return None
    kept = tuple(a for a in asked if any(_same(a, h) for h in here))
    return kept if len(kept) < len(asked) else None


def narrow_gencode(flags: Sequence[str], here: Sequence[str]) -> tuple[str, ...]:
    """``flags`` with only the -gencode flags whose machine code or PTX is for
    one of ``here``'s archs (the others as they are)."""
    kept: list[str] = []
    for group, spec in _gencodes(flags):
        targets = [f"{int(d[:-1])}.{d[-1]}" for _, d, _ in _CODE.findall(spec)]
        if not spec or any(_same(t, h) for t in targets for h in here):
            kept += group
    return tuple(kept)


def _nvml_capabilities() -> set[tuple[int, int]] | None:
    """The machine's GPU compute capabilities through NVML, or None.

    Asking torch would initialise CUDA at ``import opforge`` (hundreds of ms,
    and a forked DataLoader worker could then no longer use CUDA). NVML lists
    every GPU, ignoring CUDA_VISIBLE_DEVICES: a superset of archs, never a
    missing one.
    """
    # lazy: CMake runs archs.py as a script before torch is found: neither torch nor opforge at its top
    from opforge import nvml

    found = nvml.query()
    if found is None:
        return None
    return {(int(g.capability.split(".")[0]), int(g.capability.split(".")[1])) for g in found[0]} or None


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """SASS for each arch ("9.0a": sm_90a), plus PTX of the newest one without
    its "a", so that a newer GPU can still JIT the kernels: arch-specific PTX
    (compute_90a) runs on no other GPU. Kernels that need sm_90a features
    compile to a trap in that portable PTX and are never launched from it (the
    launchers check the device and the loaded image first)."""
    flags = []
    for arch in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    newest = max(archs, key=arch_number).removesuffix("a").replace(".", "")
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def arch_covered(capability: str, built: Sequence[str]) -> bool:
    """Whether a GPU of ``capability`` ("8.6") runs a library built for
    ``built`` by ``gencode_flags``: through its exact arch ("9.0a" SASS runs
    on a 9.0 GPU), or by JIT-compiling the PTX embedded for the newest arch,
    portable PTX without the "a" (a 9.0a build carries compute_90 PTX), which
    runs on that arch and every newer one."""
    if any(b.removesuffix("a") == capability for b in built):
        return True
    return bool(built) and arch_number(capability) >= max(arch_number(b) for b in built)


def _main(argv: list[str]) -> int:
    """CMake's view of the policy: the archs of a TORCH_CUDA_ARCH_LIST value
    (``DEFAULT_ARCHS`` for an empty one) as a CMake list, then their
    ``gencode_flags`` separated by spaces, as CMAKE_CUDA_FLAGS holds them."""
    if len(argv) > 1:
        print("usage: archs.py [TORCH_CUDA_ARCH_LIST value]", file=sys.stderr)
        return 2
    try:
        archs = parse_arch_list(argv[0] if argv else "") or DEFAULT_ARCHS
    except ValueError as exc:
        print(f"{exc} (TORCH_CUDA_ARCH_LIST={argv[0]!r})", file=sys.stderr)
        return 1
    print(";".join(archs))
    print(" ".join(gencode_flags(archs)))
    return 0


__all__ = [
    "ALL_ARCHS_VAR",
    "DEFAULT_ARCHS",
    "all_archs_asked",
    "arch_covered",
    "arch_number",
    "cuda_archs",
    "cuda_home",
    "gencode_archs",
    "gencode_flags",
    "narrow_gencode",
    "narrowed",
    "normalise_archs",
    "parse_arch_list",
    "present_archs",
]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
