"""The extensions a user's ``setup.py`` declares, read without building them.

``read`` runs the setup.py in a subprocess (its own code decides what it
declares: globs, ``torch.version.cuda`` tests, an ``if`` on an environment
variable) with ``setuptools.setup`` replaced by a function that records its
``ext_modules`` and stops, and with torch's ``CppExtension`` and
``CUDAExtension`` recording what the author passed, before torch adds its own
paths and libraries (the engine adds those itself). ``build_ext`` does not
run, so nothing is compiled by it, but the rest of the setup.py's code does
(what it writes is written), as under pip: only ``opforge.folders.plan`` reads
a setup.py without running it (the script is ``opforge.folders.setup_py_reader``'s).
A setup.py that fails by itself (said in one line, at its line, as the
project's failure), never calls ``setup()`` or runs past ``READ_TIMEOUT_S``
(the whole process group is ended then) is an error that names it.

``extension_config`` turns one extension into a build of the JIT engine
(cache, lock, progress, compiler errors), named as setuptools names it, so
that ``TORCH_EXTENSION_NAME`` and the module's init are what Python expects;
``inplace_target`` is where ``build_ext --inplace`` would put its library, as
setuptools itself said when the setup.py was read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from opforge.builder.archs import (
    ALL_ARCHS_VAR,
    cuda_archs,
    cuda_home,
    gencode_archs,
    gencode_flags,
    narrow_gencode,
    narrowed,
    parse_arch_list,
    present_archs,
)
from opforge.builder.child import run_bounded
from opforge.builder.config import env_cxxflags
from opforge.builder.errors import BuildError
from opforge.builder.jit import BuildConfig
from opforge.builder.pch import with_torch_pch
from opforge.builder.sources import CPP_SUFFIXES, CUDA_SUFFIXES, DiscoveryError, SourceKinds
from opforge.folders.package_init import abi3_suffix, extension_suffix
from opforge.folders.setup_py_reader import READER, own_failure

#: A setup.py mostly declares: a minute covers importing torch on a loaded machine.
READ_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class SetupExtension(SourceKinds):
    """One extension of a setup.py, as its author declared it (paths made absolute)."""

    name: str  # the module's dotted name, "pkg._C"
    kind: str  # CppExtension, CUDAExtension or Extension (setuptools' own)
    sources: tuple[Path, ...]
    include_dirs: tuple[Path, ...] = ()
    define_macros: tuple[tuple[str, str | None], ...] = ()
    undef_macros: tuple[str, ...] = ()
    cxx_flags: tuple[str, ...] = ()
    nvcc_flags: tuple[str, ...] = ()
    extra_link_args: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    library_dirs: tuple[Path, ...] = ()
    runtime_library_dirs: tuple[str, ...] = ()
    extra_objects: tuple[Path, ...] = ()
    dlink: bool = False
    # On Python's limited API: setuptools names its file <module>.abi3.so.
    py_limited_api: bool = False
    # TORCH_CUDA_ARCH_LIST as the setup.py left it ("" unset), which torch's BuildExtension builds for.
    arch_list: str = ""
    # Where build_ext --inplace puts the library, as setuptools itself said; None where it could not.
    inplace: Path | None = None

    def macros(self) -> list[str]:
        """The macros as compiler flags, in the order setuptools gives them."""
        return [f"-D{n}" if v is None else f"-D{n}={v}" for n, v in self.define_macros] + [f"-U{m}" for m in self.undef_macros]

    def summary(self, root: Path) -> list[str]:
        """What was read, a few lines, for ``opforge build`` to print before compiling."""

        def rel(p: Path) -> str:
            return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)

        n = len(self.sources)
        lines = [f"  {self.name} ({self.kind}): {n} source{'s' if n != 1 else ''}: {', '.join(rel(s) for s in self.sources)}"]
        parts = [
            ("include", ", ".join(rel(d) for d in self.include_dirs)),
            ("macros", " ".join([n if v is None else f"{n}={v}" for n, v in self.define_macros] + [f"-U{m}" for m in self.undef_macros])),
            ("cxx flags", " ".join(self.cxx_flags)),
            ("nvcc flags", " ".join(self.nvcc_flags)),
            ("libraries", " ".join([*self.libraries, *(rel(o) for o in self.extra_objects)])),
            ("link flags", " ".join(self.extra_link_args)),
            ("py_limited_api", "yes (Python's limited API: the file is named .abi3.so)" if self.py_limited_api else ""),
        ]
        lines += [f"    {what}: {value}" for what, value in parts if value]
        return lines


@dataclasses.dataclass(frozen=True)
class SetupPy:
    path: Path
    extensions: tuple[SetupExtension, ...]
    # setup()'s package_dir with setup.cfg's and pyproject.toml's applied, as setuptools applies them
    package_dir: Mapping[str, str]
    seconds: float
    # Why setuptools could not say where the libraries go ("" when it did): opforge follows package_dir then
    inplace_error: str = ""


def read(setup_py: Path, *, timeout: float = READ_TIMEOUT_S) -> SetupPy:
    """The extensions ``setup_py`` declares (see the module's doc). Raises
    DiscoveryError, naming the file, when it fails, times out, calls no
    ``setup()``, declares no extension or names a source that is not there."""
    setup_py = setup_py.resolve()
    root = setup_py.parent
    how = "opforge runs it with setuptools.setup replaced, to read its extensions without building them"
    with tempfile.TemporaryDirectory(prefix="opforge-setup-py-") as tmp:
        out = Path(tmp) / "extensions.json"
        start = time.perf_counter()
        try:
            # A group of its own, killed whole at the limit: a helper the setup.py started goes too.
            res = run_bounded(
                [sys.executable, "-c", READER, str(setup_py), str(out)],
                cwd=root,
                env={**os.environ, "OPFORGE_NO_AUTOLOAD": "1"},
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise DiscoveryError(
                f"{setup_py} did not finish within {timeout:.0f} s ({how}); a setup.py that waits for input, downloads "
                "or builds something before setup() cannot be read: build with pip, or give the folder a --route"
            ) from None
        seconds = time.perf_counter() - start
        failure = json.loads(out.read_text()) if out.is_file() else {}
        if failure.get("failed"):
            raise DiscoveryError(own_failure(setup_py, failure, res.stderr))
        if res.returncode != 0 or not out.is_file():
            lines = (res.stderr or res.stdout).strip().splitlines()
            # The reader's own frames (runpy's, "<string>") say nothing about the setup.py.
            first = next((i for i, ln in enumerate(lines) if ln.strip().startswith(f'File "{setup_py}"')), None)
            if first is not None:
                lines = ["Traceback (most recent call last):", *lines[first:]]
            tail = "\n".join(lines[-15:])
            raise DiscoveryError(f"{setup_py} failed (exit {res.returncode}) when read ({how}):\n{tail}")
        found = json.loads(out.read_text())
    if not found["setup_called"]:
        raise DiscoveryError(f"{setup_py} ran to its end without calling setuptools.setup(): there is nothing to read")
    if not found["extensions"]:
        raise DiscoveryError(f"{setup_py} calls setup() with no ext_modules: it declares no extension to build")
    extensions = tuple(_extension(e, root, setup_py, found.get("arch_list", "")) for e in found["extensions"])
    return SetupPy(setup_py, extensions, found["package_dir"], seconds, found.get("inplace_error", ""))


def _extension(raw: dict, root: Path, setup_py: Path, arch_list: str) -> SetupExtension:
    def path(p: str) -> Path:
        return (root / p).resolve()

    sources = tuple(path(s) for s in raw["sources"])
    for s in sources:
        if s.suffix not in (*CPP_SUFFIXES, *CUDA_SUFFIXES):
            raise DiscoveryError(
                f"{setup_py}: extension {raw['name']} lists {s.name}: opforge builds C++ (.cpp, .cc, .cxx) and CUDA (.cu) sources"
            )
        if not s.is_file():
            raise DiscoveryError(f"{setup_py}: extension {raw['name']} lists the source {s}, which is not there")
    if not sources:
        raise DiscoveryError(f"{setup_py}: extension {raw['name']} lists no source")
    flags = raw["extra_compile_args"]
    return SetupExtension(
        name=raw["name"],
        kind=raw["kind"],
        sources=sources,
        include_dirs=tuple(path(d) for d in raw["include_dirs"]),
        define_macros=tuple((n, v) for n, v in raw["define_macros"]),
        undef_macros=tuple(raw["undef_macros"]),
        cxx_flags=tuple(flags.get("cxx", ())),
        nvcc_flags=tuple(flags.get("nvcc", ())),
        extra_link_args=tuple(raw["extra_link_args"]),
        libraries=tuple(raw["libraries"]),
        library_dirs=tuple(path(d) for d in raw["library_dirs"]),
        runtime_library_dirs=tuple(raw["runtime_library_dirs"]),
        extra_objects=tuple(path(o) for o in raw["extra_objects"]),
        dlink=bool(raw["dlink"]),
        py_limited_api=bool(raw.get("py_limited_api")),
        arch_list=arch_list,
        inplace=Path(raw["inplace"]) if raw.get("inplace") else None,
    )


def _python_optimisation() -> list[str]:
    """The optimisation flags setuptools takes from Python's own build
    (``-DNDEBUG -fwrapv -O3`` for most), without its ``-g`` and warnings:
    the library behaves as a ``build_ext`` one does, asserts included."""
    wanted = ("-O", "-DNDEBUG", "-fwrapv")
    return [f for f in (sysconfig.get_config_var("CFLAGS") or "").split() if f.startswith(wanted)]


def cuda_targets(ext: SetupExtension, *, all_archs: bool = False) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """The arch flags ``ext``'s CUDA sources are built with, the archs they give
    machine code for, and a line that says how they were chosen ("" when there
    is nothing to say). A project asks for its archs with -gencode flags or
    TORCH_CUDA_ARCH_LIST (set before opforge runs, or by the setup.py itself);
    on a machine with GPUs, only the archs asked for that are this machine's are
    built, when every GPU here is among them: a wheel needs them all, a build
    in place runs here. ``all_archs`` (``--all-archs``, ``OPFORGE_ALL_ARCHS=1``)
    builds all of them; with no archs asked, this machine's GPUs' (``cuda_archs``)."""
    own = any(f.startswith(_ARCH_FLAGS) for f in ext.nvcc_flags)
    asked = gencode_archs(ext.nvcc_flags) if own else parse_arch_list(ext.arch_list)
    if not asked and own:  # a single -arch flag, which chooses one arch: as the project says
        return ext.nvcc_flags, (), ""
    if not asked:  # no archs asked for: this machine's GPUs', as opforge's other routes build
        return (*ext.nvcc_flags, *gencode_flags(cuda_archs())), cuda_archs(), ""
    how = "-gencode flags" if own else f"TORCH_CUDA_ARCH_LIST={ext.arch_list}"
    said = f"{ext.name} asks for {len(asked)} arch{'s' if len(asked) != 1 else ''} (sm {', '.join(asked)}, by {how})"
    here = present_archs()
    kept = None if all_archs else narrowed(asked, here)
    if kept is None:
        built = asked
        if all_archs and narrowed(asked, here) is not None:
            note = f"{said}: building all of them (--all-archs or {ALL_ARCHS_VAR}=1)"
        elif here and len(asked) > 1 and not all_archs:
            note = f"{said}: building all of them (this machine's sm {', '.join(here)} is not among them)"
        else:
            note = ""
    else:
        built = kept
        note = (
            f"{said}: building for this machine's GPU{'s' if len(here) != 1 else ''} only, sm {', '.join(kept)} "
            f"(--all-archs or {ALL_ARCHS_VAR}=1 builds all {len(asked)}, as a wheel needs)"
        )
    if own:
        return narrow_gencode(ext.nvcc_flags, built), built, note
    return (*ext.nvcc_flags, *gencode_flags(built)), built, note


# nvcc's flags that choose archs: a project that gives one chooses its own.
_ARCH_FLAGS = ("-gencode", "-arch", "--generate-code", "--gpu-architecture")


def cuda_include_flags() -> tuple[str, ...]:
    """The CUDA toolkit's include folders as torch's ``CUDAExtension`` puts them
    on every source of the extension (CUDA_HOME's include/, CUDA_INC_PATH,
    cuDNN's), as ``-isystem`` flags. A torch without CUDA finds no toolkit:
    then the one ``cuda_home`` finds, so that a C++ source of a CUDA extension
    still compiles where its CUDA sources are left out; none without one."""
    # lazy: import time (torch.utils.cpp_extension, 40 ms; only a setup.py build needs it)
    from torch.utils.cpp_extension import include_paths

    try:
        torch_own = set(include_paths("cpu"))
        folders = [d for d in include_paths("cuda") if d not in torch_own]
    except OSError:  # torch found no CUDA_HOME: a torch without CUDA
        home = cuda_home()
        # nvcc on the PATH may be a link or a script into the toolkit from elsewhere (/usr/local/bin).
        homes = [home, Path(os.path.realpath(home / "bin" / "nvcc")).parent.parent] if home is not None else []
        found = [h / "include" for h in [*homes, Path("/usr/local/cuda")] if (h / "include" / "cuda_runtime.h").is_file()]
        folders = [str(found[0])] if found else []
    return tuple(f for d in folders if Path(d).is_dir() for f in ("-isystem", d))


def extension_config(ext: SetupExtension, *, with_cuda: bool, all_archs: bool = False) -> BuildConfig:
    """``ext`` as a build of the JIT engine: its flags after Python's, its
    macros, include and library folders as declared, then ``OPFORGE_CXXFLAGS``;
    CUDA sources only with ``with_cuda``, for the archs ``cuda_targets`` gives.
    A ``CUDAExtension`` is a CUDA build with ``with_cuda`` even when all its
    sources are C++ (CUDA's libraries linked, cudart among them, as torch
    links them), and its C++ sources find the toolkit's headers
    (``cuda_include_flags``) whether or not CUDA is built here: torch's
    ``CUDAExtension`` adds them to every source it declares.
    The library is named by the module's last part (``_C``)."""
    if ext.dlink:
        raise BuildError(
            f"opforge: {ext.name} asks for a device link step (dlink=True), which opforge's engine does not run; build with pip"
        )
    cuda_ext = ext.kind == "CUDAExtension"
    cuda = with_cuda and (bool(ext.cuda) or cuda_ext)
    sources = ext.cpp + (ext.cuda if cuda else ())
    if not sources:
        raise BuildError(f"opforge: {ext.name}: only CUDA sources, and CUDA cannot be built here")
    nvcc, archs = cuda_targets(ext, all_archs=all_archs)[:2] if cuda else ((), ())
    env_host, env_both = env_cxxflags()
    ldflags = [f"-L{d}" for d in ext.library_dirs] + [f"-l{lib}" for lib in ext.libraries]
    ldflags += [f"-Wl,-rpath,{d}" for d in ext.runtime_library_dirs] + [str(o) for o in ext.extra_objects] + list(ext.extra_link_args)
    cfg = BuildConfig(
        name=ext.name.replace(".", "_"),
        sources=sources,
        include_dirs=ext.include_dirs,
        # The toolkit's headers in cflags, not include_dirs: the precompiled header is built with them too.
        cflags=(*_python_optimisation(), *ext.macros(), *ext.cxx_flags, *env_host, *(cuda_include_flags() if cuda_ext else ())),
        cuda_cflags=(*ext.macros(), *nvcc, *env_both) if cuda else (),
        ldflags=tuple(ldflags),
        with_cuda=cuda,
        cuda_archs=archs,
        extension_name=ext.name.rsplit(".", 1)[-1],
    )
    return with_torch_pch(cfg)[0]


def package_folder(package: str, root: Path, package_dir: Mapping[str, str]) -> Path:
    """The folder of ``package`` ("a.b") as setuptools finds it from ``package_dir``
    (``{"": "src"}``, ``{"a": "lib/a"}``); "" is the top level."""
    parts = package.split(".") if package else []
    for i in range(len(parts), -1, -1):
        head = ".".join(parts[:i])
        if head in package_dir:
            return root.joinpath(package_dir[head], *parts[i:])
    return root.joinpath(*parts)


def inplace_target(ext: SetupExtension, root: Path, package_dir: Mapping[str, str]) -> Path:
    """Where ``build_ext --inplace`` puts ``ext``'s library: where setuptools
    said, when it was read (``package_dir`` from setup(), setup.cfg or
    pyproject.toml, the build_ext's ``no_python_abi_suffix``); else
    ``pkg/_C<EXT_SUFFIX>`` for ``pkg._C`` below its package folder,
    ``pkg/_C.abi3.so`` for one on Python's limited API."""
    if ext.inplace is not None:
        return ext.inplace
    package, _, module = ext.name.rpartition(".")
    return package_folder(package, root, package_dir) / f"{module}{abi3_suffix() if ext.py_limited_api else extension_suffix()}"


def import_root(ext: SetupExtension, root: Path, package_dir: Mapping[str, str]) -> Path:
    """The folder to put on sys.path for ``import <ext.name>``: where its top-level package lives."""
    top = ext.name.split(".")[0]
    return package_folder(top, root, package_dir).parent if "." in ext.name else inplace_target(ext, root, package_dir).parent


__all__ = [
    "READ_TIMEOUT_S",
    "SetupExtension",
    "SetupPy",
    "cuda_include_flags",
    "cuda_targets",
    "extension_config",
    "import_root",
    "inplace_target",
    "package_folder",
    "read",
]
