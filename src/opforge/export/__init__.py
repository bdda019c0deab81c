"""Deploying a model that calls opforge's (or a user's) operators: an
AOTInductor package that carries the operators' libraries.

``package(model, args, path)`` exports the model, compiles it with
AOTInductor into a ``.pt2`` and puts in it every op library its graph needs
(the library that registers each custom operator's namespace: opforge's own,
and users' libraries built by opforge), and, unless ``shims=False``, a library
of C shims generated from the operators' schemas (``opforge.export.shims``), so
that the compiled model calls each operator directly rather than through
AOTInductor's proxy executor. ``load(path)`` loads those libraries, then the
model, in any process; a C++ program does the same with ``dlopen`` and
``torch::inductor::AOTIModelPackageLoader`` (the files are ordinary members of
the archive: ``<name>/opforge/<file>.so``, listed in ``<name>/opforge/manifest.json``).

torch.export and Inductor are imported when these functions run, not with opforge.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import opforge
from opforge.builder.jit import cache_root
from opforge.builder.registrations import torch_library_registrations
from opforge.builder.toolchain import STATIC_FIX, choose, links_libstdcxx_statically
from opforge.export.shims import ShimLibrary, build_shim_library, plan

# Namespaces whose operators Inductor calls through its own C shims or kernels.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_quantized", "quantized", "higher_order", "profiler", "_c10d_functional"})
MANIFEST = "opforge/manifest.json"


@dataclass
class Packaged:
    """What ``package`` made: the file, the operators its graph calls, the libraries it carries,
    the operators that call a C shim and why each other one goes through the proxy."""

    path: Path
    ops: list[str]
    libraries: list[str]
    shims: list[str] = field(default_factory=list)
    proxied: dict[str, str] = field(default_factory=dict)


def custom_ops(gm: torch.fx.GraphModule) -> list[torch._ops.OpOverload]:
    """The custom operators (outside torch's own namespaces) a graph calls, in order, each once;
    a mutating one is found inside the ``auto_functionalized`` node that export wraps it in."""
    found: dict[torch._ops.OpOverload, None] = {}
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.HigherOrderOperator) and node.args and isinstance(node.args[0], torch._ops.OpOverload):
                target = node.args[0]
            if isinstance(target, torch._ops.OpOverload) and target.namespace not in _TORCH_NAMESPACES:
                found[target] = None
    return list(found)


def op_libraries(ops: Sequence[torch._ops.OpOverload]) -> list[Path]:
    """The loaded op libraries that register the namespaces of ``ops`` (read from each
    library's symbol table, as opforge's clash check reads it). A RuntimeError names an
    operator whose namespace no loaded library registers (a Python ``torch.library`` operator)."""
    loaded = {str(p) for p in torch.ops.loaded_libraries}
    if opforge.library is not None:
        loaded.add(str(opforge.library.path))
    registered = {p: torch_library_registrations(Path(p)) or {} for p in sorted(loaded)}
    found: list[Path] = []
    for op in ops:
        holders = [Path(p) for p, spaces in registered.items() if op.namespace in spaces]
        if not holders:
            raise RuntimeError(
                f"{op}: no loaded op library registers the namespace {op.namespace!r} "
                f"(looked in {', '.join(sorted(loaded)) or 'none'}); a package can carry only a C++ library's operators"
            )
        found += [h for h in holders if h not in found]
    return found


@contextlib.contextmanager
def _library_path(directory: Path) -> Iterator[None]:
    """The compiler's library search path with ``directory`` first: where ``-l:<file>`` finds a shim library."""
    old = os.environ.get("LIBRARY_PATH")
    os.environ["LIBRARY_PATH"] = os.pathsep.join([str(directory), *([old] if old else [])])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = old


def package(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...],
    path: str | os.PathLike[str],
    dynamic_shapes: Any = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    shims: bool = True,
    inductor_configs: Mapping[str, Any] | None = None,
) -> Packaged:
    """Exports ``model`` on ``args`` (an ExportedProgram is taken as it is), compiles it with
    AOTInductor into ``path`` (a ``.pt2``) and puts in it the op libraries it needs and, with
    ``shims``, the C shim library its compiled code calls."""
    # lazy: import time (torch._inductor, 1.1 s, only for AOTInductor packages)
    import torch._inductor
    import torch._inductor.config

    path = Path(path)
    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    else:
        with torch.no_grad():
            ep = torch.export.export(model, args, kwargs=dict(kwargs or {}), dynamic_shapes=dynamic_shapes)
    ops = custom_ops(ep.graph_module)
    libraries = op_libraries(ops)
    configs: dict[str, Any] = dict(inductor_configs or {})
    if "cpp.cxx" not in configs:
        # Inductor compiles the model's library with CXX as it was when torch._inductor was imported. A
        # devtoolset-style GCC (a GPU image's CXX=/opt/gcc/bin/g++) links its own copy of libstdc++ into
        # it, and that copy's std::regex crashes the process that loads the package (SIGSEGV in
        # parse_device_str on an H200 image): the same probe and fallback as opforge's own builds.
        compiler = choose(torch._inductor.config.cpp.cxx[1])
        if compiler.fell_back:
            configs["cpp.cxx"] = (None, compiler.use)
    shim_lib: ShimLibrary | None = None
    refused: dict[str, str] = {}
    if shims and ops:
        planned, refused = plan(ops)
        if planned:
            shim_lib = build_shim_library(planned)
            configs["aot_inductor.custom_ops_to_c_shims"] = shim_lib.c_shims_config()
            configs["aot_inductor.custom_op_libs"] = [shim_lib.link_name]
    elif ops:
        refused = {f"{op._schema.name}.{op._overloadname}": "shims=False" for op in ops}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with _library_path(shim_lib.path.parent) if shim_lib else contextlib.nullcontext():
        # The shim library must be loaded for Inductor to load the model it compiled (its DT_NEEDED entry).
        if shim_lib is not None:
            ctypes.CDLL(str(shim_lib.path))
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    try:
        _refuse_own_libstdcxx(path, "package: the compiled model")
    except RuntimeError:
        path.unlink()
        raise
    carried = [*libraries, *([shim_lib.path] if shim_lib else [])]
    _add_libraries(path, carried, ops, shim_lib)
    return Packaged(
        path=path,
        ops=[str(op) for op in ops],
        libraries=[p.name for p in carried],
        shims=[str(s.op) for s in shim_lib.shims] if shim_lib else [],
        proxied=refused,
    )


def _refuse_own_libstdcxx(path: Path, what: str) -> None:
    """A RuntimeError when a model library in the archive carries its own copy of libstdc++: loading
    it beside torch's shared one crashes the process instead of raising."""
    with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory(prefix="opforge-model-") as tmp:
        for name in z.namelist():
            if "/aotinductor/" not in name or not name.endswith(".so"):
                continue
            so = Path(tmp) / Path(name).name
            so.write_bytes(z.read(name))
            if links_libstdcxx_statically(so):
                raise RuntimeError(
                    f"{what} {path}: its model library {name} links libstdc++ statically (compiled with a "
                    "devtoolset-style C++ compiler), and loading it beside torch's shared libstdc++ crashes the "
                    f"process. Package it again with a compiler that links libstdc++ dynamically: {STATIC_FIX}, "
                    "or inductor_configs={'cpp.cxx': (None, 'g++')}."
                )


def _archive_root(names: Sequence[str]) -> str:
    """The folder every member of a PT2 archive sits in."""
    for name in names:
        if name.endswith("archive_format"):
            return name.rsplit("/", 1)[0] if "/" in name else ""
    return names[0].split("/", 1)[0]


def _add_libraries(path: Path, libraries: Sequence[Path], ops: Sequence[torch._ops.OpOverload], shim_lib: ShimLibrary | None) -> None:
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as z:
        root = _archive_root(z.namelist())
        entries = []
        for lib in libraries:
            role = "shims" if shim_lib is not None and lib == shim_lib.path else "ops"
            z.write(lib, f"{root}/opforge/{lib.name}")
            spaces = sorted({op.namespace for op in ops} & set(torch_library_registrations(lib) or {})) if role == "ops" else []
            entries.append({"file": lib.name, "role": role, "sha256": _sha256(lib), "namespaces": spaces})
        manifest = {"libraries": entries, "ops": [str(op) for op in ops], "torch": torch.__version__}
        z.writestr(f"{root}/{MANIFEST}", json.dumps(manifest, indent=1))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``package`` wrote into the archive: its libraries (file, role "ops" or "shims", sha256) and operators."""
    with zipfile.ZipFile(path) as z:
        root = _archive_root(z.namelist())
        try:
            return json.loads(z.read(f"{root}/{MANIFEST}"))
        except KeyError:
            raise RuntimeError(f"{path}: not made by opforge.export.package (no {root}/{MANIFEST} in it)") from None


def extract_libraries(path: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None) -> list[tuple[Path, str]]:
    """The package's libraries written out (into ``directory``, by default a folder of opforge's
    build cache named by their digest), each with its role, in the order to load them."""
    info = manifest(path)
    libs = info["libraries"]
    if directory is None:
        digest = hashlib.sha256("".join(e["sha256"] for e in libs).encode()).hexdigest()[:16]
        directory = cache_root() / f"packaged-{digest}"
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    with zipfile.ZipFile(path) as z:
        root = _archive_root(z.namelist())
        for e in libs:
            target = directory / e["file"]
            if not (target.is_file() and _sha256(target) == e["sha256"]):
                tmp = target.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(z.read(f"{root}/opforge/{e['file']}"))
                tmp.replace(target)
            out.append((target, e["role"]))
    return out


def _defined(op: str) -> bool:
    name, _, overload = op.partition(".")
    ns, _, short = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, ns), short)
        getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        return False
    return True


def load(path: str | os.PathLike[str], *, directory: str | os.PathLike[str] | None = None) -> Any:
    """The packaged model, ready to call: its op libraries loaded first (each one whose
    operators this process does not have yet), then its C shim library, then the model
    (``torch._inductor.aoti_load_package``)."""
    # lazy: import time (torch._inductor, 1.1 s, only for AOTInductor packages)
    import torch._inductor

    info = manifest(path)
    _refuse_own_libstdcxx(Path(path), "load:")
    spaces = {e["file"]: e.get("namespaces", []) for e in info["libraries"]}
    ops = _qualnames(info["ops"])
    for lib, role in extract_libraries(path, directory):
        if role == "shims":
            ctypes.CDLL(str(lib))
        # A library whose operators are here already (opforge's, imported) is not loaded twice: its
        # registrations would clash with the first copy's.
        elif any(not _defined(op) for op in ops if op.split("::")[0] in spaces[lib.name]):
            torch.ops.load_library(str(lib))
    missing = [op for op in _qualnames(info["ops"]) if not _defined(op)]
    if missing:
        raise RuntimeError(f"{path}: after loading its libraries, these operators are still missing: {', '.join(missing)}")
    return torch._inductor.aoti_load_package(str(path))


def _qualnames(ops: Sequence[str]) -> list[str]:
    """``opforge.add.default`` (an OpOverload's str) as ``opforge::add.default``."""
    return [op.replace(".", "::", 1) for op in ops]


__all__ = ["MANIFEST", "Packaged", "custom_ops", "extract_libraries", "load", "manifest", "op_libraries", "package"]
