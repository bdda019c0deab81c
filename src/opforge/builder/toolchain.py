"""The compilers a build uses, checked before anything is compiled.

Read by the build and by ``opforge doctor``: the C++ compiler (``CXX``, else
``c++``), nvcc (its CUDA version against torch's) and nvcc's host compiler
(``CUDAHOSTCXX``, else ``CC``, else the ``g++`` on PATH).

The trap it exists for: devtoolset-style GCCs (a GPU image's
``CXX=/opt/gcc/bin/g++``) link parts of libstdc++ statically into every shared
library. Torch loads the shared libstdc++, and with two copies in one process
torch's exceptions break: the op library's first error message crashes. A
probe of about a second (a tiny shared library, read back with readelf) tells
such a compiler apart; its verdict is cached per compiler (path, mtime, size,
version) under the build cache, and the build falls back by itself to one that
links libstdc++ dynamically (``g++`` on PATH, ``/usr/bin/g++``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from opforge.builder.archs import cuda_home
from opforge.builder.errors import BuildError
from opforge.builder.store import cache_root, read_json, write_json

Severity = Literal["error", "warning"]

#: Where a build looks for a compiler that links libstdc++ dynamically, in order.
#: ``OPFORGE_CXX_FALLBACKS`` (paths or names, separated by ``os.pathsep``) replaces the list.
FALLBACKS: tuple[str, ...] = ("g++", "/usr/bin/g++")

# A template using std::ostringstream pulls in the iostream/locale machinery
# whose second copy is what crashes the process.
PROBE_SOURCE = """#include <sstream>
#include <string>
std::string opforge_probe(int x) { std::ostringstream s; s << x; return s.str(); }
"""
STATIC_FIX = "export CXX=g++ CC=gcc CUDAHOSTCXX=g++ (or use any C++ compiler that links libstdc++ dynamically)"
# Bumped when the probe changes what it decides.
_PROBE_FORMAT = "1"
_OSTREAM_SYMBOL = "St7num_putIcSt19ostreambuf_iteratorIcSt11char_traitsIcEEE2idE"


@dataclass
class Problem:
    """A finding that breaks ("error") or degrades ("warning") a build, with its fix."""

    severity: Severity
    message: str
    fix: str


def run(argv: list[str], timeout: float = 10) -> subprocess.CompletedProcess[str] | None:
    """The finished process, or None when it could not run or timed out."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None


def first_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else None


def version_tuple(v: str) -> tuple[int, int] | None:
    """(major, minor) from a version string ("13.0", "12.4.1"), None if it has none."""
    m = re.match(r"^\s*(\d+)\.(\d+)", v)
    return (int(m[1]), int(m[2])) if m else None


# ------------------------------------------------------------------- nvcc


def parse_nvcc_version(output: str) -> str | None:
    """``major.minor`` from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    m = re.search(r"release (\d+)\.(\d+)", output)
    return f"{m[1]}.{m[2]}" if m else None


def nvcc_version(nvcc: Path | str, timeout: float = 10) -> str | None:
    """``major.minor`` of an nvcc, None when it does not run or names no release."""
    res = run([str(nvcc), "--version"], timeout=timeout)
    return parse_nvcc_version(res.stdout) if res else None


def compare_cuda_versions(nvcc: str, torch_cuda: str, *, building_cuda: bool = True) -> Problem | None:
    """A problem when nvcc's CUDA differs from torch's, else None.

    A different major version cannot build against torch's CUDA headers and
    runtime (blocking when CUDA kernels are built); a different minor version
    usually works within one major version, so it only warns.
    """
    n, t = version_tuple(nvcc), version_tuple(torch_cuda)
    if n is None or t is None or n == t:
        return None
    msg = f"nvcc is {nvcc} but torch was built with {torch_cuda}"
    if n[0] != t[0]:
        fix = f"point CUDA_HOME at a {t[0]}.x toolkit, or install a torch built for CUDA {n[0]}.x"
        if building_cuda:
            return Problem("error", msg, fix)
        return Problem("warning", msg + " (CUDA kernels are not being built now, so it does not matter yet)", fix)
    return Problem(
        "warning",
        msg + " (same major version: usually works)",
        f"if the build or the kernels misbehave, point CUDA_HOME at a {torch_cuda} toolkit",
    )


def check_stable_nvcc() -> None:
    """A stable build's CUDA kernels need nvcc alone (torch's CUDA does not matter)."""
    home = cuda_home()
    if home is None or not (home / "bin" / "nvcc").exists():
        raise BuildError(f"opforge: CUDA kernels were asked for but nvcc was not found (CUDA_HOME={home}; set CUDA_HOME)")


def check_nvcc(nvcc: Path, torch_cuda: str | None) -> None:
    """Raises before compiling when nvcc cannot build against torch's CUDA
    (another major version fails deep in torch's headers or at load time);
    a minor mismatch only warns."""
    res = run([str(nvcc), "--version"], timeout=60)
    if res is None:
        raise BuildError(f"opforge: {nvcc} does not run; set CUDA_HOME to a working CUDA toolkit")
    version = parse_nvcc_version(res.stdout)
    problem = compare_cuda_versions(version, torch_cuda) if version and torch_cuda else None
    if problem is None:
        return
    if problem.severity == "error":
        raise BuildError(f"opforge: {problem.message} ({nvcc}). Fix: {problem.fix}")
    print(f"opforge: warning: {problem.message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ ninja


def find_ninja() -> tuple[str, str] | None:
    """(path, where from) of the ninja a build runs: the one on PATH, else the
    PyPI package's (installed, its environment not activated), which the build
    puts on PATH itself; None when there is neither."""
    found = shutil.which("ninja")
    if found:
        return found, "PATH"
    try:
        # lazy: optional dependency (the PyPI ninja package)
        import ninja
    except ImportError:
        return None
    candidate = Path(ninja.BIN_DIR) / "ninja"
    return (str(candidate), "pip package") if candidate.exists() else None


# ------------------------------------------------------- libstdc++ linkage


@dataclass(frozen=True)
class Verdict:
    """What a C++ compiler is and how it links libstdc++ into a shared library.

    ``libstdcxx``: "shared" (NEEDED libstdc++), "static" (no NEEDED entry but
    libstdc++'s ostringstream defined inside), "libc++", "none" (neither: a C
    compiler as CXX), "unknown" (the probe did not compile: ``note`` has the
    compiler's output), "skipped" (no readelf) or "missing" (not found)."""

    compiler: str  # as configured: a name on PATH or a path
    path: str | None
    version: str | None
    libstdcxx: str
    note: str = ""
    cached: bool = False  # read from the verdict cache, not probed now


def probe_libstdcxx(compiler: str, readelf: str) -> tuple[str, str]:
    """(linkage, note): how ``compiler -shared`` links libstdc++ into a tiny library (see ``Verdict``)."""
    with tempfile.TemporaryDirectory(prefix="opforge-probe-") as tmp:
        src, lib = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text(PROBE_SOURCE)
        res = run([compiler, "-shared", "-fPIC", "-o", str(lib), str(src)], timeout=60)
        if res is None or res.returncode != 0 or not lib.exists():
            output = (res.stderr or res.stdout).strip() if res else "could not run it"
            return "unknown", "\n".join(output.splitlines()[:8])
        dyn = run([readelf, "-d", str(lib)])
        syms = run([readelf, "--dyn-syms", "-W", str(lib)])
        if dyn is None or dyn.returncode != 0 or syms is None or syms.returncode != 0:
            return "skipped", "readelf failed on the probe library: the static-libstdc++ probe was skipped"
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn.stdout)
    # A defined (not UND) ostringstream symbol: the library carries its own copy.
    defined = any("basic_ostringstream" in ln and " UND " not in ln for ln in syms.stdout.splitlines())
    if any(n.startswith("libstdc++") for n in needed):
        return "shared", ""
    if any(n.startswith("libc++") for n in needed):
        return "libc++", "links LLVM's libc++, torch uses libstdc++"
    if defined:
        return "static", f"no NEEDED libstdc++ (NEEDED: {', '.join(needed) or 'nothing'}), its own copy of std::ostringstream inside"
    return "none", "does not link libstdc++ at all"


def verdict(compiler: str, *, cache: bool = True) -> Verdict:
    """The compiler's verdict, probed once per compiler and then read from the
    cache (``cache=False``: probed now, nothing read or written).

    The cache is keyed by the resolved path, its mtime and size and the first
    line of ``--version``: an upgraded or replaced compiler is probed again."""
    path = shutil.which(compiler)
    if path is None:
        return Verdict(compiler, None, None, "missing", f"'{compiler}' is not found")
    res = run([path, "--version"])
    version = first_line(res.stdout) if res and res.returncode == 0 else None
    readelf = shutil.which("readelf")
    if readelf is None:
        return Verdict(compiler, path, version, "skipped", "readelf not found (binutils): the static-libstdc++ probe was skipped")
    if not cache:
        return Verdict(compiler, path, version, *probe_libstdcxx(path, readelf))
    real = os.path.realpath(path)
    st = os.stat(real)
    ident = "\0".join([_PROBE_FORMAT, path, real, str(st.st_mtime_ns), str(st.st_size), version or ""])
    record = cache_root() / "toolchain" / f"cxx-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    known = read_json(record)
    if isinstance(known, dict) and known.get("path") == path:
        return Verdict(compiler, path, version, known["libstdcxx"], known.get("note", ""), cached=True)
    linkage, note = probe_libstdcxx(path, readelf)
    found = Verdict(compiler, path, version, linkage, note)
    if linkage not in ("unknown", "skipped"):  # a failed probe is asked again next time
        write_json(record, {k: v for k, v in asdict(found).items() if k != "cached"})
    return found


def fallbacks() -> list[str]:
    """The compilers to try instead of one that links libstdc++ statically."""
    env = os.environ.get("OPFORGE_CXX_FALLBACKS")
    if env is not None:
        return [c for c in env.split(os.pathsep) if c.strip()]
    return list(FALLBACKS)


@dataclass(frozen=True)
class Choice:
    """The compiler a build uses for one role, and why if not the configured one."""

    role: str  # "CXX" or "CUDAHOSTCXX"
    configured: str  # what the environment asks for ("c++" when CXX is unset)
    use: str  # what the build runs
    reason: str = ""  # empty when use == configured

    @property
    def fell_back(self) -> bool:
        return self.use != self.configured


def _static_error(configured: str, v: Verdict, tried: list[str]) -> BuildError:
    who = f"'{configured}'" + (f" ({v.path})" if v.path and v.path != configured else "")
    return BuildError(
        f"opforge: the C++ compiler {who} linked libstdc++ statically into a probe library, and no compiler that "
        f"links it dynamically was found (tried: {', '.join(tried) or 'none'}; OPFORGE_CXX_FALLBACKS sets the list). "
        "Torch loads the shared libstdc++; two copies in one process crash on the first error message. "
        "Build with a compiler that links libstdc++ dynamically, e.g. `CXX=g++ CC=gcc CUDAHOSTCXX=g++`."
    )


def choose(configured: str, role: str = "CXX", *, probe: str | None = None, cache: bool = True) -> Choice:
    """The compiler to build with for ``role``: ``configured`` unless it links
    libstdc++ statically (``probe``, the C++ driver that tells, defaults to
    it), then the first of ``fallbacks()`` that links it dynamically; a
    BuildError when there is none."""
    v = verdict(probe or configured, cache=cache)
    if v.libstdcxx != "static":
        return Choice(role, configured, configured)
    tried = []
    for candidate in fallbacks():
        cv = verdict(candidate, cache=cache)
        tried.append(candidate if cv.path in (None, candidate) else f"{candidate} ({cv.path})")
        if cv.path is not None and cv.libstdcxx == "shared" and os.path.realpath(cv.path) != os.path.realpath(v.path or ""):
            reason = f"{role}={configured} links libstdc++ statically (a second copy beside torch's breaks its exceptions)"
            return Choice(role, configured, cv.path, reason)
    raise _static_error(configured, v, tried)


def _cxx_sibling(compiler: str) -> str:
    """The C++ driver beside a C driver (``gcc`` -> ``g++``, ``cc`` -> ``c++``):
    a C driver links no libstdc++ at all, so its C++ sibling is what tells."""
    head, sep, name = compiler.rpartition("/")
    if "clang" in name and "clang++" not in name:
        name = name.replace("clang", "clang++", 1)
    elif "gcc" in name:
        name = name[::-1].replace("ccg", "++g", 1)[::-1]  # the last "gcc": x86_64-linux-gnu-gcc-12
    elif name == "cc":
        name = "c++"
    sibling = head + sep + name
    return sibling if shutil.which(sibling) else compiler


def configured_cxx() -> str:
    return os.environ.get("CXX") or "c++"


def configured_cuda_host() -> str:
    """nvcc's host compiler as configured: CUDAHOSTCXX, else CC (torch passes
    it as -ccbin), else the ``g++`` nvcc finds on PATH."""
    return os.environ.get("CUDAHOSTCXX") or os.environ.get("CC") or "g++"


@dataclass(frozen=True)
class Toolchain:
    cxx: Choice
    cuda_host: Choice | None  # None: no CUDA sources

    def notes(self) -> list[str]:
        """One line per compiler the build replaced, naming the one it used and why."""
        return [f"opforge: {c.reason}; building with {c.use} instead" for c in (self.cxx, self.cuda_host) if c is not None and c.fell_back]


def resolve(*, with_cuda: bool) -> Toolchain:
    """The compilers a build runs, the static-libstdc++ ones replaced."""
    host = None
    if with_cuda:
        configured = configured_cuda_host()
        host = choose(configured, "CUDAHOSTCXX", probe=_cxx_sibling(configured))
    return Toolchain(choose(configured_cxx()), host)


def overrides(tc: Toolchain) -> dict[str, str]:
    """The variables a build's environment takes for ``tc``: ``CXX``, and
    ``CC`` for nvcc's host compiler; also for a build run in a subprocess."""
    # Only what differs from the environment: a build's cache key reads CXX, and a build in another
    # thread (the fast path's, beside the op library's) must not see it change under it.
    wanted = {"CXX": tc.cxx.use} if tc.cxx.fell_back else {}
    if tc.cuda_host is not None and (tc.cuda_host.fell_back or os.environ.get("CUDAHOSTCXX")):
        wanted["CC"] = tc.cuda_host.use
    return wanted


@contextlib.contextmanager
def applied(tc: Toolchain) -> Iterator[None]:
    """The environment torch's builder reads while the build runs: ``CXX``,
    and ``CC`` for nvcc's host compiler (torch passes it as ``-ccbin``; a
    second ``-ccbin`` of ours would be an nvcc error). Restored afterwards:
    the process's own environment is the user's."""
    wanted = overrides(tc)
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def links_libstdcxx_statically(so: Path) -> bool:
    """Whether a built library carries its own copy of libstdc++ (the check
    after linking, for a compiler that slipped past the probe)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return False
    dynamic = run([readelf, "-d", str(so)], timeout=30)
    symbols = run([readelf, "--dyn-syms", "-W", str(so)], timeout=30)
    if dynamic is None or symbols is None:
        return False
    return "libstdc++" not in dynamic.stdout and _OSTREAM_SYMBOL in symbols.stdout


def is_gcc(compiler: str) -> bool:
    """GCC, not clang: a ``.gch`` is GCC's format (``c++ --version`` names
    neither on its first line, hence the whole text)."""
    res = run([compiler, "--version"])
    text = res.stdout.lower() if res and res.returncode == 0 else ""
    return "free software foundation" in text and "clang" not in text


__all__ = [
    "FALLBACKS",
    "PROBE_SOURCE",
    "STATIC_FIX",
    "Choice",
    "Problem",
    "Toolchain",
    "Verdict",
    "applied",
    "check_nvcc",
    "check_stable_nvcc",
    "choose",
    "compare_cuda_versions",
    "configured_cuda_host",
    "configured_cxx",
    "fallbacks",
    "first_line",
    "is_gcc",
    "links_libstdcxx_statically",
    "parse_nvcc_version",
    "probe_libstdcxx",
    "resolve",
    "run",
    "verdict",
]
