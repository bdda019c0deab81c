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

A package runs code, as a wheel does, so ``load`` checks it before it loads anything of it: no
member or library may land outside the extraction folder, every library must match the sha256 its
manifest records and be whole, and operators this process already has must come from the packaged
build; anything else is a ``PackageError``. The checks stop damage and tampering in transit, not a
malicious author (who writes the manifest too).

torch.export and Inductor are imported when these functions run, not with opforge.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import tempfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import opforge
from opforge.builder.jit import cache_root
from opforge.builder.symbols import torch_library_registrations
from opforge.builder.toolchain import STATIC_FIX, choose, links_libstdcxx_statically
from opforge.elf_symbols import ElfError, check_complete
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


def _known_libraries() -> set[str]:
    """The op libraries loaded by ``torch.ops.load_library`` and opforge's own."""
    loaded = {str(p) for p in torch.ops.loaded_libraries}
    if opforge.library is not None:
        loaded.add(str(opforge.library.path))
    return loaded


def op_libraries(ops: Sequence[torch._ops.OpOverload]) -> list[Path]:
    """The loaded op libraries that register the namespaces of ``ops`` (read from each
    library's symbol table, as opforge's clash check reads it). A RuntimeError names an
    operator whose namespace no loaded library registers (a Python ``torch.library`` operator)."""
    loaded = _known_libraries()
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
    own = _own_libstdcxx(path)
    if own is not None:
        path.unlink()
        raise RuntimeError(f"package: the compiled model {own}")
    carried = [*libraries, *([shim_lib.path] if shim_lib else [])]
    _add_libraries(path, carried, ops, shim_lib)
    return Packaged(
        path=path,
        ops=[str(op) for op in ops],
        libraries=[p.name for p in carried],
        shims=[str(s.op) for s in shim_lib.shims] if shim_lib else [],
        proxied=refused,
    )


def _own_libstdcxx(path: Any) -> str | None:
    """Why the archive's model library cannot be loaded beside torch, when it carries its own copy
    of libstdc++: that copy's std::regex crashes the loading process instead of raising."""
    with _open(path) as z, tempfile.TemporaryDirectory(prefix="opforge-model-") as tmp:
        for name in z.namelist():
            if "/aotinductor/" not in name or not name.endswith(".so"):
                continue
            so = Path(tmp) / "model.so"
            so.write_bytes(_read_member(z, name, path, "model library"))
            if links_libstdcxx_statically(so):
                return (
                    f"{path}: its model library {name} links libstdc++ statically (compiled with a devtoolset-style C++ "
                    "compiler), and loading it beside torch's shared libstdc++ crashes the process. Package it again "
                    f"with a compiler that links libstdc++ dynamically: {STATIC_FIX}, or inductor_configs={{'cpp.cxx': (None, 'g++')}}."
                )
    return None


def _add_libraries(path: Path, libraries: Sequence[Path], ops: Sequence[torch._ops.OpOverload], shim_lib: ShimLibrary | None) -> None:
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as z:
        root = _archive_root(z, path)
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


class PackageError(ValueError):
    """A package that opforge.export cannot read or will not load: the message names the
    package and what is wrong with it (its archive, its manifest, or a library it carries)."""


_SHA256 = re.compile(r"[0-9a-f]{64}")
# An operator as an OpOverload's str writes it: namespace.name.overload.
_OP = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*\.\w+")
_S_IFMT, _S_IFLNK, _S_IFREG = 0o170000, 0o120000, 0o100000


def _open(path: Any) -> zipfile.ZipFile:
    if not isinstance(path, (str, os.PathLike)):
        raise PackageError(f"opforge.export: a package is the path of a .pt2 file, got {path!r} (a {type(path).__name__})")
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise PackageError(f"{path}: no such package file") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise PackageError(f"{path}: not an AOTInductor package, which is a zip archive ({exc})") from None


def _archive_root(z: zipfile.ZipFile, path: Any) -> str:
    """The folder every member of a PT2 archive sits in, after refusing any member that would
    be written outside the folder the archive is extracted into (an absolute name, one that
    climbs with ``..``) or that is not a plain file (a symbolic link, a device)."""
    infos = z.infolist()
    if not infos:
        raise PackageError(f"{path}: the archive is empty, not an AOTInductor package")
    for info in infos:
        name = info.filename
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in parts or "\0" in name:
            raise PackageError(
                f"{path}: refusing the package: its archive member {name!r} would be written outside the folder it is "
                "extracted into (an absolute path, or one that climbs with '..')"
            )
        kind = (info.external_attr >> 16) & _S_IFMT
        if kind == _S_IFLNK:
            raise PackageError(f"{path}: refusing the package: its archive member {name!r} is a symbolic link, not a file")
        if kind not in (0, _S_IFREG) and not info.is_dir():
            raise PackageError(f"{path}: refusing the package: its archive member {name!r} is not a plain file (mode {kind:o})")
    names = [i.filename for i in infos]
    for name in names:
        if name.endswith("archive_format"):
            return name.rsplit("/", 1)[0] if "/" in name else ""
    return names[0].split("/", 1)[0]


def _read_member(z: zipfile.ZipFile, member: str, path: Any, what: str) -> bytes:
    try:
        return z.read(member)
    except KeyError:
        raise PackageError(f"{path}: {what} {member!r} is not in the archive") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise PackageError(f"{path}: {what} {member!r} cannot be read from the archive: {exc}") from None


def _checked_manifest(data: bytes, path: Any, where: str) -> dict[str, Any]:
    """The manifest's JSON, after checking every field ``load`` reads: a PackageError names the first wrong one."""

    def bad(what: str) -> PackageError:
        return PackageError(f"{path}: its manifest {where} {what}")

    try:
        info = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad(f"is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})") from None
    except json.JSONDecodeError as exc:
        raise bad(f"is not JSON: {exc}") from None
    if not isinstance(info, dict):
        raise bad(f"is a JSON {type(info).__name__}, not an object")
    for key in ("libraries", "ops"):
        if not isinstance(info.get(key), list):
            raise bad(f"has no {key!r} list" if key not in info else f"has {key!r} = {info[key]!r}, not a list")
    files: set[str] = set()
    for i, e in enumerate(info["libraries"]):
        at = f"libraries[{i}]"
        if not isinstance(e, dict):
            raise bad(f"has {at} = {e!r}, not an object")
        for key in ("file", "role", "sha256"):
            if not isinstance(e.get(key), str):
                raise bad(f"has no {at}[{key!r}] string" if key not in e else f"has {at}[{key!r}] = {e[key]!r}, not a string")
        file = e["file"]
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise bad(
                f"names the library {file!r} ({at}['file']): a packaged library is named by a plain file name, "
                "written inside the folder the package is extracted into, never a path"
            )
        if file in files:
            raise bad(f"names the library {file!r} twice")
        files.add(file)
        if e["role"] not in ("ops", "shims"):
            raise bad(f"has {at}['role'] = {e['role']!r}, not 'ops' or 'shims'")
        if not _SHA256.fullmatch(e["sha256"]):
            raise bad(f"has {at}['sha256'] = {e['sha256']!r}, not a sha256 (64 lowercase hex digits)")
        spaces = e.get("namespaces", [])
        if not (isinstance(spaces, list) and all(isinstance(n, str) and n.isidentifier() for n in spaces)):
            raise bad(f"has {at}['namespaces'] = {spaces!r}, not a list of operator namespaces")
    for op in info["ops"]:
        if not (isinstance(op, str) and _OP.fullmatch(op)):
            raise bad(f"lists the operator {op!r}, not one as namespace.name.overload")
    return info


def _read_manifest(z: zipfile.ZipFile, path: Any) -> tuple[str, dict[str, Any]]:
    root = _archive_root(z, path)
    member = f"{root}/{MANIFEST}"
    if member not in z.NameToInfo:
        raise PackageError(f"{path}: not made by opforge.export.package (no {member} in it)")
    return root, _checked_manifest(_read_member(z, member, path, "the manifest"), path, member)


def manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``package`` wrote into the archive: its libraries (file, role "ops" or "shims", sha256)
    and operators. A PackageError names a file that is no package, or a manifest field that is wrong."""
    with _open(path) as z:
        return _read_manifest(z, path)[1]


def extract_libraries(path: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None) -> list[tuple[Path, str]]:
    """The package's libraries written out (into ``directory``, by default a folder of opforge's
    build cache named by their digest), each with its role, in the order to load them. Each
    library is checked against the sha256 its manifest records before it is written; a
    PackageError names a library that differs, and a package whose manifest or archive would
    put a file anywhere but directly inside ``directory``."""
    with _open(path) as z:
        root, info = _read_manifest(z, path)
        libs = info["libraries"]
        if directory is None:
            digest = hashlib.sha256("".join(e["sha256"] for e in libs).encode()).hexdigest()[:16]
            directory = cache_root() / f"packaged-{digest}"
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        out = []
        for e in libs:
            data = _read_member(z, f"{root}/opforge/{e['file']}", path, "the library")
            got = hashlib.sha256(data).hexdigest()
            if got != e["sha256"]:
                raise PackageError(
                    f"{path}: refusing the library {e['file']}: its sha256 is {got}, the package's manifest says "
                    f"{e['sha256']}; the file was damaged or changed after it was packaged"
                )
            target = directory / e["file"]
            if target.is_symlink() or not (target.is_file() and _sha256(target) == e["sha256"]):
                fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{e['file']}.")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
            try:
                # A library its author packaged cut short would be mapped and kill the process (SIGBUS) when touched.
                check_complete(target)
            except ElfError as exc:
                raise PackageError(f"{path}: refusing the library {e['file']}: {exc}") from None
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


def _has_namespace(ns: str) -> bool:
    return any(name.startswith(f"{ns}::") for name in torch._C._dispatch_get_all_op_names())


def _mapped_libraries() -> set[str]:
    """The shared libraries this process has mapped (Python extension modules among them), torch's own left out."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    own = str(Path(torch.__file__).parent) + os.sep
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and ".so" in fields[5] and fields[5].startswith("/") and not fields[5].startswith(own):
            found.add(fields[5])
    return found


def _holders(ns: str) -> list[Path]:
    """The loaded libraries that define operators of ``ns``: those opforge and torch.ops loaded, or else any mapped."""
    known = _known_libraries()
    for candidates in (known, _mapped_libraries() - known):
        found = [Path(p) for p in sorted(candidates) if (torch_library_registrations(Path(p)) or {}).get(ns, set()) & {"def", "fragment"}]
        if found:
            return found
    return []


def _same_build_loaded(path: Any, lib: Path, sha256: str, spaces: Sequence[str]) -> None:
    """Returns when the operators of ``spaces`` this process has come from a library with the
    packaged one's sha256; else raises a PackageError naming both files. The compiled model would
    otherwise call the other build's kernels, which it was not compiled or checked with."""
    for ns in spaces:
        holders = _holders(ns)
        if any(p.is_file() and _sha256(p) == sha256 for p in holders):
            continue
        if holders:
            other = ", ".join(f"{p} (sha256 {_sha256(p) if p.is_file() else 'unreadable'})" for p in holders)
            raise PackageError(
                f"{path}: refusing to run it with another build of its operators: this process has the operators of "
                f"namespace {ns!r} from {other}, and the package carries {lib} (sha256 {sha256}). Load the package in a "
                "process that has not loaded the other build"
            )
        raise PackageError(
            f"{path}: refusing to run it with other operators of namespace {ns!r}: this process defines them already, "
            f"not from a library file that can be compared with the packaged {lib} (sha256 {sha256}): defined from "
            "Python, or by a library stripped of its symbol table. "
            "Load the package in a process that has not defined them"
        )


def load(path: str | os.PathLike[str], *, directory: str | os.PathLike[str] | None = None) -> Any:
    """The packaged model, ready to call: its libraries extracted and each checked against its
    manifest's sha256, its op libraries loaded (each whose operator namespaces this process does
    not have yet; a namespace it has must come from the same build, byte for byte), then its C
    shim library, then the model (``torch._inductor.aoti_load_package``). A PackageError names
    the package and what was refused, before anything of it is loaded."""
    # lazy: import time (torch._inductor, 1.1 s, only for AOTInductor packages)
    import torch._inductor

    info = manifest(path)
    own = _own_libstdcxx(path)
    if own is not None:
        raise PackageError(f"refusing the package: {own}")
    entries = {e["file"]: e for e in info["libraries"]}
    extracted = extract_libraries(path, directory)
    # Every comparison first, then every load: nothing of a refused package is loaded.
    todo = []
    for lib, role in extracted:
        spaces = entries[lib.name].get("namespaces", [])
        held = [ns for ns in spaces if _has_namespace(ns)]
        if role == "ops" and held:
            # A library whose operators are here already (opforge's, imported) is not loaded twice: its
            # registrations would clash with the first copy's.
            _same_build_loaded(path, lib, entries[lib.name]["sha256"], held)
        else:
            todo.append((lib, role))
    for lib, role in todo:
        if role == "shims":
            ctypes.CDLL(str(lib))
        else:
            torch.ops.load_library(str(lib))
    missing = [op for op in _qualnames(info["ops"]) if not _defined(op)]
    if missing:
        raise PackageError(f"{path}: after loading its libraries, these operators are still missing: {', '.join(missing)}")
    return torch._inductor.aoti_load_package(str(path))


def _qualnames(ops: Sequence[str]) -> list[str]:
    """``opforge.add.default`` (an OpOverload's str) as ``opforge::add.default``."""
    return [op.replace(".", "::", 1) for op in ops]


__all__ = ["MANIFEST", "PackageError", "Packaged", "custom_ops", "extract_libraries", "load", "manifest", "op_libraries", "package"]
