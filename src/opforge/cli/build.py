"""``opforge build``: opforge's own op library, a package of ``opforge new``'s,
or a user's folder of sources by any route (jit, inline, setuptools, pybind,
package, setup.py, CMake)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from opforge import load_library as load_library_file
from opforge.builder.archs import all_archs_asked, cuda_archs
from opforge.builder.child import verify_load
from opforge.builder.config import folder_config, want_cuda
from opforge.builder.errors import BuildError, load_reason
from opforge.builder.jit import build_library, load_library
from opforge.builder.many import build_libraries
from opforge.builder.pch import plan, with_torch_pch
from opforge.builder.source_text import read_binding
from opforge.builder.sources import DiscoveryError, walk
from opforge.builder.symbols import registers_nothing, undefined_symbol_error
from opforge.cli.args import usage_error
from opforge.cli.render import err, out
from opforge.cli.targets import library, resolve_targets
from opforge.folders.cmake import build_cmake, parse_definition
from opforge.folders.describe import cuda_unavailable, describe
from opforge.folders.discover import discover
from opforge.folders.kernel_builder.check import check
from opforge.project import ProjectError, find_project, project_library


def cmake_definition(text: str) -> str:
    """-D: a CMake cache definition, NAME=VALUE (opforge.folders.cmake.parse_definition)."""
    try:
        return parse_definition(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_build(args: argparse.Namespace) -> int:
    dry_run = getattr(args, "dry_run", False)
    defines: list[str] = getattr(args, "defines", None) or []
    if args.path is None:
        if dry_run:
            usage_error("opforge build: --dry-run needs the folder to plan (opforge build PATH --dry-run)")
        if defines:
            usage_error(f"opforge build: -D {defines[0]} is a CMake definition: give the folder (opforge build PATH -D NAME=VALUE)")
        return print_library()
    try:
        project = find_project(args.path) if args.path.is_dir() else None
    except ProjectError as exc:
        raise SystemExit(f"opforge build: {exc}") from None
    if project is not None and (dry_run or defines):
        return build_folder(project.sources, "jit" if args.route == "auto" else args.route, dry_run=dry_run, defines=defines)
    if project is not None:  # a package of opforge new's: its import builds (JIT) and loads it
        return build_project(args.path) if args.route in ("auto", "jit") else build_folder(project.sources, args.route)
    return build_folder(args.path, args.route, all_archs=args.all_archs, dry_run=dry_run, defines=defines)


def build_project(path: Path) -> int:
    # Resolved: `opforge build NAME` names a folder, where check and bench read a bare word as an operator.
    names, _, _ = resolve_targets([str(path.resolve())])
    lib = project_library(path)
    if lib is not None:
        how = "prebuilt" if lib.route == "prebuilt" else f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        out.print(f"{path}: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    out.print(f"{path}: operators {', '.join(names)} loaded into torch.ops, specs registered")
    return 0


def print_library(*, wait_fast: bool = True) -> int:
    lib = library(wait_fast=wait_fast)
    how = "named by OPFORGE_LIBRARY" if lib.route == "file" else f"built now in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
    out.print(f"op library: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    return 0


def build_folder(path: Path, route: str = "auto", *, all_archs: bool = False, dry_run: bool = False, defines: Sequence[str] = ()) -> int:
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
    # lazy: import time (opforge.builder.inline, 4 ms): every opforge command loads this module
    from opforge.builder.inline import build_pybind_folder, folder_module_name, inline, pybind_instead_of_torch_library

    try:
        layout = discover(path)
    except DiscoveryError as exc:
        usage_error(f"opforge build: {exc}")
    route = layout.route if route == "auto" else route
    if defines and route != "cmake":
        how = "asked for with --route" if route != layout.route else layout.why
        cmake = "; --route cmake builds its CMakeLists.txt" if layout.cmakelists is not None else ""
        usage_error(
            f"opforge build: {path}: -D {defines[0]} is a CMake cache definition, but this build takes the {route} route "
            f"({how}), which runs no cmake{cmake}; a macro of the C++ sources is OPFORGE_CXXFLAGS=-D{defines[0]}"
        )
    if route == "kernel-builder" and not dry_run:
        return _build_kernel_builder(layout.root)
    if route == "package" and layout.package is None:
        usage_error(f"opforge build: {path}: --route package, but no package here imports a compiled _C (`from . import _C`)")
    setup_py = layout.setup_py or (layout.root / "setup.py" if (layout.root / "setup.py").is_file() else None)
    if route == "setup.py" and setup_py is None:
        usage_error(f"opforge build: {path}: --route setup.py, but there is no setup.py in {layout.root}")
    try:
        reason = cuda_unavailable() if layout.tree.cuda else None
        archs = cuda_archs() if layout.tree.cuda and reason is None else ()
    except BuildError as exc:  # OPFORGE_BUILD_CUDA set to what it cannot do
        err.print(str(exc), highlight=False, markup=False)
        return 1
    for line in describe(layout, route=route, cuda_reason=reason, cuda_archs=archs):
        out.print(line, highlight=False, markup=False)
    if dry_run:
        # lazy: import time (opforge.folders.plan, 5 ms): every opforge command loads this module
        from opforge.folders.plan import plan_lines

        for line in plan_lines(layout, route, setup_py=setup_py, defines=defines):
            out.print(line, highlight=False, markup=False)
        return 0
    folder = layout.root
    if route in ("jit", "inline", "setuptools") and (why := pybind_instead_of_torch_library(folder)):
        # Refused before compiling: the build would succeed and leave torch.ops without a single operator.
        err.print(f"opforge build: {folder.name} would register no operator in torch.ops: {why}", highlight=False, markup=False)
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
                return _registered_nothing(folder, lib.path)
            how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
            out.print(f"{folder.name}: {lib.path} ({how}; loaded into torch.ops)")
            if added := sorted(set(torch._C._dispatch_get_all_op_names()) - ops_before):
                out.print(f"{folder.name}: operators {', '.join(added)}", highlight=False, markup=False)
        elif route == "package":
            return _build_package(layout)
        elif route == "setup.py":
            return _build_setup_py(layout, setup_py, all_archs=all_archs or all_archs_asked())
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
                return _registered_nothing(folder, lib.path)
            out.print(f"{folder.name}: {lib.path} (inline; loaded into torch.ops)")
        elif route == "setuptools":
            # lazy: import time (opforge.builder.setuptools_ext, 42 ms, setuptools): every opforge command loads this module
            from opforge.builder.setuptools_ext import build_folder as build_with_setuptools

            so = build_with_setuptools(folder)
            verify_library(so, folder)
            load_library_file(so)
            if registers_nothing(so, ops_before):
                return _registered_nothing(folder, so)
            out.print(f"{folder.name}: {so} (setuptools; loaded into torch.ops)")
        elif route == "pybind":
            module = build_pybind_folder(folder, folder_module_name(folder))
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            out.print(f"{folder.name}: module {module.__name__} from {module.__file__}: {', '.join(names)}")
        else:
            return _build_cmake(folder, defines)
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 1
    return 0


def _build_package(layout: Any) -> int:
    """A package whose __init__ imports _C: its sources built by the JIT engine
    into the cache, the library copied into the package as _C<EXT_SUFFIX> (as
    ``build_ext --inplace`` leaves it), then ``import <package>`` tried in a new
    process, as its user will run it."""
    # lazy: import time (opforge.folders.package, 3 ms): every opforge command loads this module
    from opforge.folders.package import package_config, place_in_package

    package = layout.package
    lib = build_library(package_config(layout))
    try:
        target, changed = place_in_package(lib.path, package)
    except DiscoveryError as exc:
        err.print(f"opforge build: {exc}", highlight=False, markup=False)
        return 1
    how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
    where = target.relative_to(layout.root) if target.is_relative_to(layout.root) else target
    out.print(f"{package.name}: {where} ({how}{'' if changed else ', already in place'}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    left_out = () if lib.with_cuda else layout.tree.cuda
    namespaces = layout.binding.operator_namespaces("_C")
    modules = [(f"{package.name}._C", target)]
    return _imports(package.name, modules, [package.directory.parent], namespaces, left_out, layout.root, macro="OPFORGE_WITH_CUDA")


def _imports(
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
    # lazy: import time (opforge.folders.package, 3 ms): every opforge command loads this module
    from opforge.folders.package import has_module_init, try_import

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
        err.print(f"opforge build: built {libraries}, but `import {name}` fails (in {shown}):{sep}{found}", highlight=False, markup=False)
        return 1
    assert isinstance(found, dict)
    ops, names = found["ops"], {m: n for m, n in found["names"].items() if n}
    what = [f"operators {', '.join(ops)}" if ops else "no operator registered in " + (", ".join(namespaces) or "torch.ops")]
    if names and not namespaces:  # a pybind11 module: what it holds, not the operators it never registers
        what = [f"{m}: {', '.join(n)}" for m, n in names.items()]
    out.print(f"{name}: `import {name}` works (from {shown}, no install step): {'; '.join(what)}", highlight=False, markup=False)
    return 0


def _build_setup_py(layout: Any, setup_py: Path, *, all_archs: bool = False) -> int:
    """The extensions a setup.py declares (opforge.folders.setup_py), built by
    the JIT engine (several at once, opforge.builder.many) and each copied
    where ``build_ext --inplace`` puts it; then, all in place, imported in one
    new process, as their users will (a package whose __init__ imports every
    one of them needs all of them there)."""
    # lazy: import time (opforge.folders.package, 3 ms; opforge.folders.setup_py, 6 ms): every opforge command loads this module
    from opforge.folders.package import place_library
    from opforge.folders.setup_py import cuda_targets, extension_config, import_root, inplace_target, read

    root = layout.root

    def rel(p: Path) -> str:
        return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)

    try:
        found = read(setup_py)
    except DiscoveryError as exc:
        also = f" (or build it another way: {', '.join(layout.other_routes())})" if layout.other_routes() else ""
        err.print(f"opforge build: {exc}{also}", highlight=False, markup=False)
        return 1
    n = len(found.extensions)
    read = f"read in {found.seconds:.1f} s (its code ran, setup() replaced: nothing built by it)"
    out.print(f"  setup.py: {n} extension{'s' if n != 1 else ''}, {read}:", highlight=False)
    cuda = want_cuda()
    for ext in found.extensions:
        for line in ext.summary(root):
            out.print(line, highlight=False, markup=False)
        guessed = (
            f" (from package_dir: setuptools could not say, {found.inplace_error})" if ext.inplace is None and found.inplace_error else ""
        )
        out.print(f"    goes to: {rel(inplace_target(ext, root, found.package_dir))}{guessed}", highlight=False, markup=False)
        if ext.cuda and not cuda:
            out.print(f"    left out: {', '.join(rel(s) for s in ext.cuda)} ({cuda_unavailable()})", highlight=False, markup=False)
        elif ext.cuda and (note := cuda_targets(ext, all_archs=all_archs)[2]):
            out.print(f"    archs: {note}", highlight=False, markup=False)
        if ext.cpp:
            pch = plan(ext.cpp, ext.include_dirs)
            out.print(f"    precompiled header: {pch.summary(root, len(ext.cpp))}", highlight=False, markup=False)
    try:
        libs = build_libraries([extension_config(ext, with_cuda=cuda, all_archs=all_archs) for ext in found.extensions])
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 1
    modules: list[tuple[str, Path]] = []
    for ext, lib in zip(found.extensions, libs, strict=True):
        try:
            target, changed = place_library(lib.path, inplace_target(ext, root, found.package_dir))
        except DiscoveryError as exc:
            err.print(f"opforge build: {exc}", highlight=False, markup=False)
            return 1
        how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        how += "" if changed else ", already in place"
        out.print(f"{ext.name}: {rel(target)} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
        modules.append((ext.name, target))
    # TORCH_LIBRARY(TORCH_EXTENSION_NAME, m): the module's last part, as the build names it.
    named = [read_binding(ext.sources).operator_namespaces(ext.name.rsplit(".", 1)[-1]) for ext in found.extensions]
    namespaces = sorted({ns for found_ns in named for ns in found_ns})
    left_out = [s for ext in found.extensions if not cuda for s in ext.cuda]
    where = [import_root(ext, root, found.package_dir) for ext in found.extensions]
    return _imports(", ".join(ext.name for ext in found.extensions), modules, where, namespaces, left_out, root)


def verify_library(so: Path, folder: Path) -> None:
    """A library built from ``folder`` by a route of its own (setuptools, CMake)
    loaded in a new process first (``opforge.builder.child.verify_load``): a
    registration error, or a loader error, is a BuildError in one line."""
    tree = walk(folder)
    failure = verify_load(so, sources=tree.sources, root=tree.root)
    if failure is not None:
        raise BuildError(f"opforge build: {folder.name}: built {so}, but {failure}")


def _registered_nothing(folder: Path, so: Path) -> int:
    err.print(
        f"opforge build: {folder.name}: built and loaded {so}, but it registers no operator (no TORCH_LIBRARY, "
        "TORCH_LIBRARY_FRAGMENT or TORCH_LIBRARY_IMPL in its sources ran), so torch.ops has nothing of it. Register the "
        "operators with TORCH_LIBRARY(<namespace>, m) { m.def(...); } and their kernels with TORCH_LIBRARY_IMPL; a pybind11 "
        "module, declared as PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), builds with --route pybind",
        highlight=False,
        markup=False,
    )
    return 1


def _build_cmake(folder: Path, defines: Sequence[str] = ()) -> int:
    """The CMake route (opforge.folders.cmake) with the cache definitions ``defines``, then every shared library it made loaded."""
    if not (folder / "CMakeLists.txt").is_file():
        usage_error(f"opforge build: {folder} has no CMakeLists.txt (--route cmake)")
    try:
        libs = build_cmake(folder, defines=defines, say=lambda line: err.print(line, highlight=False))
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 1
    try:
        for so in libs:
            verify_library(so, folder)
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 1
    for so in libs:
        load_library_file(so)
        out.print(f"{folder.name}: {so} (cmake; loaded into torch.ops)")
    return 0


def _build_kernel_builder(root: Path) -> int:
    """A Hugging Face kernel-builder project (opforge.folders.kernel_builder):
    each backend built and placed, then imported as its users import it."""
    # lazy: import time (opforge.folders.kernel_builder, 14 ms): every opforge command loads this module
    from opforge.folders.kernel_builder.build import build_project
    from opforge.folders.kernel_builder.toml import KernelBuilderError

    def say(line: str) -> None:
        out.print(line, highlight=False, markup=False)

    try:
        result = build_project(root, say=say)
    except (BuildError, KernelBuilderError) as exc:
        err.print(f"opforge build: {exc}" if isinstance(exc, KernelBuilderError) else str(exc), highlight=False, markup=False)
        return 1
    for line in result.lines():
        say(line)
    verdict = check(result)
    for line in verdict.lines:
        say(line)
    for line in verdict.errors:
        err.print(f"opforge build: {line}", highlight=False, markup=False)
    return 0 if verdict.ok else 1
