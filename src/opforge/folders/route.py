"""Which route ``opforge build PATH`` takes, and the build by it: what the folder
holds is found (``opforge.folders.discover``) and said, then built by the route it
calls for or the one asked for (jit, inline, setuptools, pybind, package,
setup.py, CMake, kernel-builder) through the engine (``opforge.builder``), or
planned without building (``--dry-run``, ``opforge.folders.plan``). A package of
``opforge new``'s is built by its own import (``project_route``). What is said
goes through the caller's ``say`` (stdout) and ``warn`` (stderr): the command
line prints, this module decides."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from opforge import load_library as load_library_file
from opforge.builder.archs import all_archs_asked, cuda_archs
from opforge.builder.child import verify_load
from opforge.builder.config import folder_config, want_cuda
from opforge.builder.errors import BuildError, load_reason
from opforge.builder.inline import build_pybind_folder, folder_module_name, inline, pybind_instead_of_torch_library
from opforge.builder.jit import build_library, load_library
from opforge.builder.many import build_libraries
from opforge.builder.pch import plan, with_torch_pch
from opforge.builder.setuptools_ext import build_folder as build_with_setuptools
from opforge.builder.source_text import read_binding
from opforge.builder.sources import DiscoveryError, walk
from opforge.builder.symbols import registers_nothing, undefined_symbol_error
from opforge.folders import setup_py as setup_py_route
from opforge.folders.cmake import build_cmake
from opforge.folders.describe import cuda_unavailable, describe
from opforge.folders.discover import discover
from opforge.folders.kernel_builder.build import build_project
from opforge.folders.kernel_builder.check import check
from opforge.folders.kernel_builder.toml import KernelBuilderError
from opforge.folders.package import has_module_init, package_config, place_in_package, place_library, try_import
from opforge.folders.plan import plan_lines
from opforge.folders.setup_py import cuda_targets, extension_config, import_root, inplace_target
from opforge.project import find_project

Say = Callable[[str], None]


class RouteError(ValueError):
    """A build asked for what the folder cannot give (a route it has no file for,
    a CMake definition on another route): a usage error, the message names the path."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What ``opforge build PATH`` builds: ``folder`` by ``route``; ``project``: a
    package of ``opforge new``'s, built and loaded by its own import."""

    folder: Path
    route: str
    project: bool = False


def project_route(path: Path, route: str = "auto", *, dry_run: bool = False, defines: Sequence[str] = ()) -> Target:
    """The folder and route for ``path``: a package of ``opforge new``'s builds its
    sources folder (its import, on the jit route, where neither a plan nor CMake
    definitions are asked for); any other folder is built as it is. Raises
    ``opforge.project.ProjectError`` for a package whose table is malformed."""
    project = find_project(path) if path.is_dir() else None
    if project is None:
        return Target(path, route)
    if dry_run or defines:
        return Target(project.sources, "jit" if route == "auto" else route)
    if route in ("auto", "jit"):
        return Target(path, "jit", project=True)
    return Target(project.sources, route)


def build_folder(
    path: Path,
    route: str = "auto",
    *,
    say: Say,
    warn: Say,
    all_archs: bool = False,
    dry_run: bool = False,
    defines: Sequence[str] = (),
) -> int:
    """``_FolderBuild.build``: the exit status, what is found and built said through ``say`` and ``warn``."""
    return _FolderBuild(say, warn).build(path, route, all_archs=all_archs, dry_run=dry_run, defines=defines)


def verify_library(so: Path, folder: Path) -> None:
    """A library built from ``folder`` by a route of its own (setuptools, CMake)
    loaded in a new process first (``opforge.builder.child.verify_load``): a
    registration error, or a loader error, is a BuildError in one line."""
    tree = walk(folder)
    failure = verify_load(so, sources=tree.sources, root=tree.root)
    if failure is not None:
        raise BuildError(f"opforge build: {folder.name}: built {so}, but {failure}")


class _FolderBuild:
    """One build of a user's folder, saying what it does as it goes."""

    def __init__(self, say: Say, warn: Say) -> None:
        self.say = say
        self.warn = warn

    def build(self, path: Path, route: str = "auto", *, all_archs: bool = False, dry_run: bool = False, defines: Sequence[str] = ()) -> int:
        """A user's folder of sources, in whatever layout (opforge.folders.discover):
        what was found is printed, then it is built by the route it calls for, or
        by ``route``. TORCH_LIBRARY ops: jit (the cached ninja build), inline (its
        files handed to opforge.builder.inline as strings), setuptools (build_ext, as
        pip install would). A package importing _C: package (built in place). A
        pybind11 module: pybind. Its own CMakeLists.txt: cmake. ``all_archs``: a
        setup.py's every CUDA arch, not only this machine's GPUs' (``cuda_targets``).
        ``dry_run``: what was found and the plan (opforge.folders.plan), then
        stop; nothing compiles and no code of the folder runs. Otherwise the
        folder's code runs, as pip would run it (setup.py, an __init__.py, CMake,
        static initializers). ``defines``: CMake cache definitions (``-D``), for
        the cmake route only; on another route a usage error says so."""

        try:
            layout = discover(path)
        except DiscoveryError as exc:
            raise RouteError(f"opforge build: {exc}") from None
        route = layout.route if route == "auto" else route
        if defines and route != "cmake":
            how = "asked for with --route" if route != layout.route else layout.why
            cmake = "; --route cmake builds its CMakeLists.txt" if layout.cmakelists is not None else ""
            raise RouteError(
                f"opforge build: {path}: -D {defines[0]} is a CMake cache definition, but this build takes the {route} route "
                f"({how}), which runs no cmake{cmake}; a macro of the C++ sources is OPFORGE_CXXFLAGS=-D{defines[0]}"
            )
        if route == "kernel-builder" and not dry_run:
            return self._build_kernel_builder(layout.root)
        if route == "package" and layout.package is None:
            raise RouteError(f"opforge build: {path}: --route package, but no package here imports a compiled _C (`from . import _C`)")
        setup_py = layout.setup_py or (layout.root / "setup.py" if (layout.root / "setup.py").is_file() else None)
        if route == "setup.py" and setup_py is None:
            raise RouteError(f"opforge build: {path}: --route setup.py, but there is no setup.py in {layout.root}")
        try:
            reason = cuda_unavailable() if layout.tree.cuda else None
            archs = cuda_archs() if layout.tree.cuda and reason is None else ()
        except BuildError as exc:  # OPFORGE_BUILD_CUDA set to what it cannot do
            self.warn(str(exc))
            return 1
        for line in describe(layout, route=route, cuda_reason=reason, cuda_archs=archs):
            self.say(line)
        if dry_run:
            for line in plan_lines(layout, route, setup_py=setup_py, defines=defines):
                self.say(line)
            return 0
        folder = layout.root
        if route in ("jit", "inline", "setuptools") and (why := pybind_instead_of_torch_library(folder)):
            # Refused before compiling: the build would succeed and leave torch.ops without a single operator.
            self.warn(f"opforge build: {folder.name} would register no operator in torch.ops: {why}")
            return 1
        ops_before = set(torch._C._dispatch_get_all_op_names())
        try:
            if route == "jit":
                cfg = with_torch_pch(folder_config(folder))[0]
                try:
                    lib = load_library(cfg, verify=True)
                except OSError as exc:  # built, but it does not load: an undefined symbol is explained
                    left_out = () if cfg.with_cuda else layout.tree.cuda
                    raise undefined_symbol_error(cfg.name, exc, left_out, root=folder, sources=cfg.sources) or BuildError(
                        f"opforge: {cfg.name}: built, but loading it failed: {load_reason(exc)}"
                    ) from None
                if registers_nothing(lib.path, ops_before):
                    return self._registered_nothing(folder, lib.path)
                how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
                self.say(f"{folder.name}: {lib.path} ({how}; loaded into torch.ops)")
                if added := sorted(set(torch._C._dispatch_get_all_op_names()) - ops_before):
                    self.say(f"{folder.name}: operators {', '.join(added)}")
            elif route == "package":
                return self._build_package(layout)
            elif route == "setup.py":
                return self._build_setup_py(layout, setup_py, all_archs=all_archs or all_archs_asked())
            elif route == "inline":
                cfg = folder_config(folder)
                own = [s for s in cfg.sources if s.is_relative_to(folder)]
                text = {suffix: "\n".join(s.read_text() for s in own if s.suffix == suffix) for suffix in (".cpp", ".cu")}
                lib = inline(
                    cfg.name,
                    cpp=text[".cpp"],
                    cuda=text[".cu"],
                    extra_cflags=[f"-I{d}" for d in cfg.include_dirs] + ["-fopenmp"],
                    extra_cuda_cflags=[f"-I{d}" for d in cfg.include_dirs],
                    implicit_headers=False,
                )
                if registers_nothing(lib.path, ops_before):
                    return self._registered_nothing(folder, lib.path)
                self.say(f"{folder.name}: {lib.path} (inline; loaded into torch.ops)")
            elif route == "setuptools":
                so = build_with_setuptools(folder)
                verify_library(so, folder)
                load_library_file(so)
                if registers_nothing(so, ops_before):
                    return self._registered_nothing(folder, so)
                self.say(f"{folder.name}: {so} (setuptools; loaded into torch.ops)")
            elif route == "pybind":
                module = build_pybind_folder(folder, folder_module_name(folder))
                names = sorted(n for n in dir(module) if not n.startswith("_"))
                self.say(f"{folder.name}: module {module.__name__} from {module.__file__}: {', '.join(names)}")
            else:
                return self._build_cmake(folder, defines)
        except BuildError as exc:
            self.warn(str(exc))
            return 1
        return 0

    def _build_package(self, layout: Any) -> int:
        """A package whose __init__ imports _C: its sources built by the JIT engine
        into the cache, the library copied into the package as _C<EXT_SUFFIX> (as
        ``build_ext --inplace`` leaves it), then ``import <package>`` tried in a new
        process, as its user will run it."""

        package = layout.package
        lib = build_library(package_config(layout))
        try:
            target, changed = place_in_package(lib.path, package)
        except DiscoveryError as exc:
            self.warn(f"opforge build: {exc}")
            return 1
        how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        where = target.relative_to(layout.root) if target.is_relative_to(layout.root) else target
        self.say(
            f"{package.name}: {where} ({how}{'' if changed else ', already in place'}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})"
        )
        left_out = () if lib.with_cuda else layout.tree.cuda
        namespaces = layout.binding.operator_namespaces("_C")
        modules = [(f"{package.name}._C", target)]
        return self._imports(
            package.name, modules, [package.directory.parent], namespaces, left_out, layout.root, macro="OPFORGE_WITH_CUDA"
        )

    def _imports(
        self,
        name: str,
        modules: Sequence[tuple[str, Path]],
        where: Sequence[Path],
        namespaces: Sequence[str],
        left_out: Sequence[Path],
        root: Path,
        *,
        macro: str = "",
    ) -> int:
        """Every one of ``modules`` (name, library) imported in one new process from
        ``where``, once all are in place, as their users will (``import <name>``): said, with the
        operators they registered; an undefined symbol that a CUDA source left
        out (``left_out``) would define is said so (``macro``: what the build
        defines only with CUDA, "" where opforge defines none)."""

        sources = walk(root).sources
        ok, found = try_import(modules, where, namespaces, sources, root)
        shown = ", ".join(str(w) for w in dict.fromkeys(where))
        if not ok:
            assert isinstance(found, str)
            why = undefined_symbol_error(name, found, left_out, root=root, macro=macro, sources=sources)
            libraries = ", ".join(str(lib) for _, lib in modules)
            found += f"\n{why}" if why is not None else ""
            bare = [lib.name for m, lib in modules if not has_module_init(lib, m)]
            if bare and "module export function" in found:
                found += (
                    f"\n{', '.join(bare)} defines no PyInit_ function: it holds TORCH_LIBRARY operators, not a Python module, "
                    "and loads with torch.ops.load_library(path) (which worked here, before the import); load it that way, "
                    "or make it a module too with an empty PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}"
                )
            sep = "\n" if "\n" in found else " "  # a traceback below, a one-line reason after
            self.warn(f"opforge build: built {libraries}, but `import {name}` fails (in {shown}):{sep}{found}")
            return 1
        assert isinstance(found, dict)
        ops, names = found["ops"], {m: n for m, n in found["names"].items() if n}
        what = [f"operators {', '.join(ops)}" if ops else "no operator registered in " + (", ".join(namespaces) or "torch.ops")]
        if names and not namespaces:  # a pybind11 module: what it holds, not the operators it never registers
            what = [f"{m}: {', '.join(n)}" for m, n in names.items()]
        self.say(f"{name}: `import {name}` works (from {shown}, no install step): {'; '.join(what)}")
        return 0

    def _build_setup_py(self, layout: Any, setup_py: Path, *, all_archs: bool = False) -> int:
        """The extensions a setup.py declares (opforge.folders.setup_py), built by
        the JIT engine (several at once, opforge.builder.many) and each copied
        where ``build_ext --inplace`` puts it; then, all in place, imported in one
        new process, as their users will (a package whose __init__ imports every
        one of them needs all of them there)."""

        root = layout.root

        def rel(p: Path) -> str:
            return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)

        try:
            found = setup_py_route.read(setup_py)
        except DiscoveryError as exc:
            also = f" (or build it another way: {', '.join(layout.other_routes())})" if layout.other_routes() else ""
            self.warn(f"opforge build: {exc}{also}")
            return 1
        n = len(found.extensions)
        read = f"read in {found.seconds:.1f} s (its code ran, setup() replaced: nothing built by it)"
        self.say(f"  setup.py: {n} extension{'s' if n != 1 else ''}, {read}:")
        cuda = want_cuda()
        for ext in found.extensions:
            for line in ext.summary(root):
                self.say(line)
            guessed = (
                f" (from package_dir: setuptools could not say, {found.inplace_error})"
                if ext.inplace is None and found.inplace_error
                else ""
            )
            self.say(f"    goes to: {rel(inplace_target(ext, root, found.package_dir))}{guessed}")
            if ext.cuda and not cuda:
                self.say(f"    left out: {', '.join(rel(s) for s in ext.cuda)} ({cuda_unavailable()})")
            elif ext.cuda and (note := cuda_targets(ext, all_archs=all_archs)[2]):
                self.say(f"    archs: {note}")
            if ext.cpp:
                pch = plan(ext.cpp, ext.include_dirs)
                self.say(f"    precompiled header: {pch.summary(root, len(ext.cpp))}")
        try:
            libs = build_libraries([extension_config(ext, with_cuda=cuda, all_archs=all_archs) for ext in found.extensions])
        except BuildError as exc:
            self.warn(str(exc))
            return 1
        modules: list[tuple[str, Path]] = []
        for ext, lib in zip(found.extensions, libs, strict=True):
            try:
                target, changed = place_library(lib.path, inplace_target(ext, root, found.package_dir))
            except DiscoveryError as exc:
                self.warn(f"opforge build: {exc}")
                return 1
            how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
            how += "" if changed else ", already in place"
            self.say(f"{ext.name}: {rel(target)} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
            modules.append((ext.name, target))
        # TORCH_LIBRARY(TORCH_EXTENSION_NAME, m): the module's last part, as the build names it.
        named = [read_binding(ext.sources).operator_namespaces(ext.name.rsplit(".", 1)[-1]) for ext in found.extensions]
        namespaces = sorted({ns for found_ns in named for ns in found_ns})
        left_out = [s for ext in found.extensions if not cuda for s in ext.cuda]
        where = [import_root(ext, root, found.package_dir) for ext in found.extensions]
        return self._imports(", ".join(ext.name for ext in found.extensions), modules, where, namespaces, left_out, root)

    def _registered_nothing(self, folder: Path, so: Path) -> int:
        self.warn(
            f"opforge build: {folder.name}: built and loaded {so}, but it registers no operator (no TORCH_LIBRARY, "
            "TORCH_LIBRARY_FRAGMENT or TORCH_LIBRARY_IMPL in its sources ran), so torch.ops has nothing of it. Register the "
            "operators with TORCH_LIBRARY(<namespace>, m) { m.def(...); } and their kernels with TORCH_LIBRARY_IMPL; a pybind11 "
            "module, declared as PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), builds with --route pybind"
        )
        return 1

    def _build_cmake(self, folder: Path, defines: Sequence[str] = ()) -> int:
        """The CMake route (opforge.folders.cmake) with the cache definitions ``defines``, then every shared library it made loaded."""
        if not (folder / "CMakeLists.txt").is_file():
            raise RouteError(f"opforge build: {folder} has no CMakeLists.txt (--route cmake)")
        try:
            libs = build_cmake(folder, defines=defines, say=lambda line: self.warn(line))
        except BuildError as exc:
            self.warn(str(exc))
            return 1
        try:
            for so in libs:
                verify_library(so, folder)
        except BuildError as exc:
            self.warn(str(exc))
            return 1
        for so in libs:
            load_library_file(so)
            self.say(f"{folder.name}: {so} (cmake; loaded into torch.ops)")
        return 0

    def _build_kernel_builder(self, root: Path) -> int:
        """A Hugging Face kernel-builder project (opforge.folders.kernel_builder):
        each backend built and placed, then imported as its users import it."""

        try:
            result = build_project(root, say=self.say)
        except (BuildError, KernelBuilderError) as exc:
            self.warn(f"opforge build: {exc}" if isinstance(exc, KernelBuilderError) else str(exc))
            return 1
        for line in result.lines():
            self.say(line)
        verdict = check(result)
        for line in verdict.lines:
            self.say(line)
        for line in verdict.errors:
            self.warn(f"opforge build: {line}")
        return 0 if verdict.ok else 1
