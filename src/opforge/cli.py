"""The ``opforge`` command: build, list, check and benchmark operators."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Tables are wide: when output is piped (CI logs), rich would assume 80 columns.
_WIDTH = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
out = Console(width=_WIDTH, soft_wrap=True)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, soft_wrap=True)


def usage_error(message: str) -> NoReturn:
    """A command line that asks for what is not there (an unknown operator,
    check, case or path) or a value out of range: exit status 2, as argparse
    gives its own usage errors, so that a script tells it from a failed check (1)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def _library():  # noqa: ANN202
    """The op library, built and loaded; a build failure is a message, not a traceback."""
    import opforge
    from opforge.build import BuildError

    try:
        return opforge.load()
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        raise SystemExit(1) from None


def _device(name: str, projects_cuda: dict[str, bool] | None = None, *, own_library: bool = True):  # noqa: ANN202 - torch imported lazily
    """``projects_cuda``: whether each package directory's library has CUDA kernels (auto picks the CPU if one has not);
    ``own_library``: opforge's op library is in play (not when every operator asked for is a package's)."""
    import torch

    if own_library:
        _library()
    without = sorted(d for d, cuda in (projects_cuda or {}).items() if not cuda)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and not without else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("opforge: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
        if own_library and not _library().with_cuda:
            raise SystemExit("opforge: --device cuda but the op library was built without CUDA kernels (no nvcc, or OPFORGE_BUILD_CUDA=0)")
        if without:
            what = ", ".join(without)
            raise SystemExit(f"opforge: --device cuda but {what} has no CUDA kernels (--no-cuda, no nvcc, or OPFORGE_BUILD_CUDA=0)")
    return torch.device(name)


def _projects(names: Sequence[str]) -> tuple[list[str], dict[str, bool], bool]:
    """``names`` with each package directory (``opforge new``'s, a ``[tool.opforge]``
    table in its pyproject.toml) and each spec file (``FILE.py``, its ``SPECS``)
    loaded and replaced by its operators' qualified names; per directory or file,
    whether its operators have CUDA kernels; and whether opforge's own op library
    is needed (no names, or a name that is neither)."""
    from opforge.build import BuildError
    from opforge.project import ProjectError, find_project, load_project, names_a_path, not_a_project, project_library

    expanded: list[str] = []
    cuda: dict[str, bool] = {}
    for n in names:
        if not names_a_path(n):  # an operator's name, even where a folder of that name is here
            expanded.append(n)
            continue
        path = Path(n)
        if n.endswith(".py"):
            expanded += _spec_file(n)
            cuda[n] = _spec_file_has_cuda(n)
            continue
        if not path.is_dir():
            usage_error(f"opforge: {n}: {'not a directory' if path.exists() else 'no such directory'}")
        try:
            if find_project(path) is None:
                usage_error(f"opforge: {not_a_project(n)}")
            expanded += [s.qualname for s in load_project(path)]
        except ProjectError as exc:
            raise SystemExit(f"opforge: {exc}") from None
        except BuildError as exc:
            err.print(str(exc), highlight=False, markup=False)
            raise SystemExit(1) from None
        lib = project_library(path)
        cuda[n] = bool(lib and lib.with_cuda)
    return expanded, cuda, not names or len(cuda) < len(names)


def _spec_file(name: str) -> list[str]:
    """Loads a spec file and registers its specs (opforge.project.load_spec_file);
    says, per operator, what was derived from its schema. The qualified names."""
    from opforge.build import BuildError
    from opforge.derive import describe
    from opforge.project import ProjectError, load_spec_file

    path = Path(name)
    if not path.is_file():
        usage_error(f"opforge: {name}: {'not a file' if path.exists() else 'no such file'}")
    try:
        specs = load_spec_file(path)
    except ProjectError as exc:
        raise SystemExit(f"opforge: {exc}") from None
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        raise SystemExit(1) from None
    for spec in specs:
        if note := describe(spec):
            out.print(f"{spec.qualname} ({name}): {note}", highlight=False, markup=False)
    return [s.qualname for s in specs]


def _spec_file_has_cuda(name: str) -> bool:
    """Whether every operator of a loaded spec file has a CUDA kernel (or one for every device)."""
    from opforge.derive import has_kernel_for
    from opforge.project import load_spec_file

    return all(has_kernel_for(s.overload, "cuda") for s in load_spec_file(name))


def _specs(names: Sequence[str], *, own_library: bool = True):  # noqa: ANN202
    from opforge.project import names_a_path
    from opforge.spec import get_specs

    if own_library:
        _library()
    try:
        return get_specs(names)
    except KeyError as exc:
        message = exc.args[0]
        # `opforge check my_op` beside a folder my_op/ means the operator; say how to name the folder.
        folders = [n for n in names if not names_a_path(n) and f"{n!r}" in message and Path(n).is_dir()]
        usage_error(f"opforge: {message}" + "".join(f" ({n}/ is a folder here: write ./{n} for the package in it)" for n in folders))


#: The dtypes the operators take, and the other names people type for them.
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64"}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp64": "float64", "double": "float64"}  # fmt: skip


def _dtype_list(text: str) -> str:
    """--dtype: comma-separated floating dtypes, aliases spelled out ("fp16" -> "float16")."""
    names = [n.strip().removeprefix("torch.") for n in text.split(",")]
    if not text.strip() or not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes ({', '.join(_DTYPES)}), got {text!r}")
    out = []
    for n in names:
        canonical = _DTYPES.get(n) or _DTYPE_ALIASES.get(n)
        if canonical is None:
            raise argparse.ArgumentTypeError(
                f"{n!r} is not a dtype the operators take; use {', '.join(_DTYPES)} (or fp32, fp16, bf16, fp64)"
            )
        out.append(canonical)
    return ",".join(dict.fromkeys(out))


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _existing_file(text: str) -> Path:
    """A file to read later (--compare): checked before anything is measured."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def _version() -> str:
    from opforge import __version__

    return __version__


def _seed(seed: int | None) -> int:
    return random.SystemRandom().randrange(2**31) if seed is None else seed


def cmd_build(args: argparse.Namespace) -> int:
    if args.path is None:
        return print_library()
    from opforge.project import ProjectError, find_project

    try:
        project = find_project(args.path) if args.path.is_dir() else None
    except ProjectError as exc:
        raise SystemExit(f"opforge build: {exc}") from None
    if project is not None:  # a package of opforge new's: its import builds (JIT) and loads it
        return build_project(args.path) if args.route in ("auto", "jit") else build_folder(project.sources, args.route)
    return build_folder(args.path, args.route)


def build_project(path: Path) -> int:
    from opforge.project import project_library

    names, _, _ = _projects([str(path)])
    lib = project_library(path)
    if lib is not None:
        how = "prebuilt" if lib.route == "prebuilt" else f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        out.print(f"{path}: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    out.print(f"{path}: operators {', '.join(names)} loaded into torch.ops, specs registered")
    return 0


def print_library() -> int:
    lib = _library()
    how = "named by OPFORGE_LIBRARY" if lib.route == "file" else f"built now in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
    out.print(f"op library: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    return 0


def build_folder(path: Path, route: str = "auto") -> int:
    """A user's folder of sources, in whatever layout (opforge.build.discover):
    what was found is printed, then it is built by the route it calls for, or
    by ``route``. TORCH_LIBRARY ops: jit (the cached ninja build), inline (its
    files handed to opforge.build.inline as strings), setuptools (build_ext, as
    pip install would). A package importing _C: package (built in place). A
    pybind11 module: pybind. Its own CMakeLists.txt: cmake."""
    import torch

    from opforge import load_library as load_library_file
    from opforge.build import BuildError, cuda_archs, folder_config, load_library
    from opforge.build.describe import cuda_unavailable, describe
    from opforge.build.discover import DiscoveryError, discover
    from opforge.build.inline import build_pybind_folder, inline, pybind_instead_of_torch_library
    from opforge.build.registrations import registers_nothing
    from opforge.build.user_pch import with_torch_pch

    try:
        layout = discover(path)
    except DiscoveryError as exc:
        usage_error(f"opforge build: {exc}")
    route = layout.route if route == "auto" else route
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
    folder = layout.root
    if route in ("jit", "inline", "setuptools") and (why := pybind_instead_of_torch_library(folder)):
        # Refused before compiling: the build would succeed and leave torch.ops without a single operator.
        err.print(f"opforge build: {folder.name} would register no operator in torch.ops: {why}", highlight=False, markup=False)
        return 1
    ops_before = set(torch._C._dispatch_get_all_op_names())
    try:
        if route == "jit":
            lib = load_library(with_torch_pch(folder_config(folder))[0])
            if registers_nothing(lib.path, ops_before):
                return _registered_nothing(folder, lib.path)
            how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
            out.print(f"{folder.name}: {lib.path} ({how}; loaded into torch.ops)")
            if added := sorted(set(torch._C._dispatch_get_all_op_names()) - ops_before):
                out.print(f"{folder.name}: operators {', '.join(added)}", highlight=False, markup=False)
        elif route == "package":
            return _build_package(layout)
        elif route == "setup.py":
            return _build_setup_py(layout, setup_py)
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
            from opforge.build.setuptools_ext import build_folder as build_with_setuptools

            so = build_with_setuptools(folder)
            load_library_file(so)
            if registers_nothing(so, ops_before):
                return _registered_nothing(folder, so)
            out.print(f"{folder.name}: {so} (setuptools; loaded into torch.ops)")
        elif route == "pybind":
            module = build_pybind_folder(folder)
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            out.print(f"{folder.name}: module {module.__name__} from {module.__file__}: {', '.join(names)}")
        else:
            return _build_cmake(folder)
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 1
    return 0


def _build_package(layout: Any) -> int:
    """A package whose __init__ imports _C: its sources built by the JIT engine
    into the cache, the library copied into the package as _C<EXT_SUFFIX> (as
    ``build_ext --inplace`` leaves it), then ``import <package>`` tried in a new
    process, as its user will run it."""
    from opforge.build import build_library
    from opforge.build.discover import DiscoveryError
    from opforge.build.package import package_config, place_in_package

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
    namespaces = sorted({*layout.binding.namespaces, *layout.binding.impls})
    return _imports(package.name, f"{package.name}._C", package.directory.parent, target, namespaces)


def _imports(name: str, module: str, where: Path, library: Path, namespaces: Sequence[str]) -> int:
    """``import <module>`` in a new process from ``where``, as its user will: said, with the operators it registered."""
    from opforge.build.package import try_import

    ok, found = try_import(module, where, library, namespaces)
    if not ok:
        err.print(f"opforge build: built {library}, but `import {name}` fails (in {where}):\n{found}", highlight=False, markup=False)
        return 1
    what = f"operators {', '.join(found)}" if found else "no operator registered in " + (", ".join(namespaces) or "torch.ops")
    out.print(f"{name}: `import {name}` works (from {where}, no install step): {what}", highlight=False, markup=False)
    return 0


def _build_setup_py(layout: Any, setup_py: Path) -> int:
    """The extensions a setup.py declares (opforge.build.setup_py), each built
    by the JIT engine and copied where ``build_ext --inplace`` puts it; then
    each imported in a new process, as its user will."""
    from opforge.build import build_library, want_cuda
    from opforge.build.describe import cuda_unavailable
    from opforge.build.discover import DiscoveryError, read_binding
    from opforge.build.package import place_library
    from opforge.build.setup_py import extension_config, import_root, inplace_target, read
    from opforge.build.user_pch import plan

    root = layout.root
    try:
        found = read(setup_py)
    except DiscoveryError as exc:
        also = f" (or build it another way: {', '.join(layout.other_routes())})" if layout.other_routes() else ""
        err.print(f"opforge build: {exc}{also}", highlight=False, markup=False)
        return 1
    n = len(found.extensions)
    out.print(f"  setup.py: {n} extension{'s' if n != 1 else ''}, read in {found.seconds:.1f} s (setup() not run):", highlight=False)
    cuda = want_cuda()
    for ext in found.extensions:
        for line in ext.summary(root):
            out.print(line, highlight=False, markup=False)
        target = inplace_target(ext, root, found.package_dir)
        out.print(f"    goes to: {target.relative_to(root) if target.is_relative_to(root) else target}", highlight=False, markup=False)
        if ext.cuda and not cuda:
            left = ", ".join(s.relative_to(root).as_posix() if s.is_relative_to(root) else str(s) for s in ext.cuda)
            out.print(f"    left out: {left} ({cuda_unavailable()})", highlight=False, markup=False)
        if ext.cpp:
            pch = plan(ext.cpp, ext.include_dirs)
            out.print(f"    precompiled header: {pch.summary(root, len(ext.cpp))}", highlight=False, markup=False)
    status = 0
    for ext in found.extensions:
        target = inplace_target(ext, root, found.package_dir)
        lib = build_library(extension_config(ext, with_cuda=cuda))
        try:
            target, changed = place_library(lib.path, target)
        except DiscoveryError as exc:
            err.print(f"opforge build: {exc}", highlight=False, markup=False)
            return 1
        how = f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        where = target.relative_to(root) if target.is_relative_to(root) else target
        out.print(f"{ext.name}: {where} ({how}{'' if changed else ', already in place'}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
        binding = read_binding(ext.sources)
        namespaces = sorted({*binding.namespaces, *binding.impls})
        status = max(status, _imports(ext.name, ext.name, import_root(ext, root, found.package_dir), target, namespaces))
    return status


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


def _build_cmake(folder: Path) -> int:
    """cmake configure + build of the folder's CMakeLists.txt into the cache,
    with torch's CMake package found, then every shared library it made loaded."""
    import hashlib
    import subprocess

    import torch

    from opforge import load_library
    from opforge.build import cache_root, toolchain

    if not (folder / "CMakeLists.txt").is_file():
        usage_error(f"opforge build: {folder} has no CMakeLists.txt (--route cmake)")
    if shutil.which("cmake") is None:
        raise SystemExit("opforge build: cmake is not on PATH (apt-get install cmake, or pip install cmake)")
    build = cache_root() / f"cmake-{folder.name}-{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}"
    # A compiler that links libstdc++ statically is replaced as on the JIT route.
    # CUDA sources may live outside the folder (add_library over ../csrc): a CUDA torch means nvcc may run.
    tc = toolchain.resolve(with_cuda=torch.version.cuda is not None)
    compilers = []
    # The environment too: CMake's CUDA detection reads CUDAHOSTCXX and adds
    # that compiler's library folders to every link (a libstdc++.a found there
    # first is linked in, whatever compiler links).
    env = dict(os.environ)
    for note in tc.notes():
        err.print(note, highlight=False)
    if tc.cxx.fell_back:
        compilers.append(f"-DCMAKE_CXX_COMPILER={tc.cxx.use}")
        env["CXX"] = tc.cxx.use
        cc = Path(tc.cxx.use).with_name(Path(tc.cxx.use).name.replace("g++", "gcc"))
        if env.get("CC") and cc.is_file():
            env["CC"] = str(cc)
    if tc.cuda_host is not None and tc.cuda_host.fell_back:
        compilers.append(f"-DCMAKE_CUDA_HOST_COMPILER={tc.cuda_host.use}")
        env["CUDAHOSTCXX"] = tc.cuda_host.use
    for cmd in (
        [
            "cmake",
            "-S",
            str(folder),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            # The interpreter whose torch that is: left to FindPython, an
            # activated virtualenv or PATH can name another one (seen in CI
            # run from inside a second venv).
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            *compilers,
        ],
        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)],
    ):
        err.print(f"opforge build: {' '.join(cmd[:2])} ...", highlight=False)
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            err.print(res.stdout[-4000:] + res.stderr[-4000:], highlight=False, markup=False)
            return 1
    libs = sorted(p for p in build.glob("*.so") if p.is_file())
    for so in libs:
        if toolchain.links_libstdcxx_statically(so):
            # Loading it would abort the process at the first C++ exception.
            raise SystemExit(
                f"opforge build: {so.name} carries its own copy of libstdc++ (linked statically): torch's exceptions would "
                f"abort the process. Its link command is in {build}; look for -static-libstdc++ or a -L folder holding "
                "only libstdc++.a, and build with a compiler that links libstdc++ dynamically (CXX=g++ CUDAHOSTCXX=g++)"
            )
        load_library(so)
        out.print(f"{folder.name}: {so} (cmake; loaded into torch.ops)")
    if not libs:
        raise SystemExit(f"opforge build: cmake built no shared library in {build}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="opforge operators")
    table.add_column("operator")
    table.add_column("schema")
    table.add_column("autograd")
    for spec in _specs([]):
        table.add_row(spec.qualname, str(spec.schema), "yes" if spec.differentiable else "")
    out.print(table)
    return 0


def check_ops(
    specs: Sequence[Any], device: Any, seed: int, checks: Sequence[str], seeds: int = 1, reference_on: str = "device"
) -> dict[str, list[Any]]:
    """Every check of every operator, a line per operator as each finishes;
    the results by qualified name."""
    from opforge.check import check_op
    from opforge.report import Steps, check_cell

    results: dict[str, list[Any]] = {}
    steps = Steps(err, len(specs), "checking")
    with steps.running():
        for spec in specs:
            steps.doing(spec.name)
            start = time.perf_counter()
            results[spec.qualname] = check_op(spec, device, seed, checks, seeds, reference_device="cpu" if reference_on == "cpu" else None)
            cells = ", ".join(f"{r.check} {check_cell(r)}" for r in results[spec.qualname])
            steps.line(f"check {spec.name}: {cells} ({time.perf_counter() - start:.1f} s)")
    return results


def check_failures(results: dict[str, list[Any]]) -> list[str]:
    """The failures' messages, the first five per operator and check."""
    failures: list[str] = []
    for rs in results.values():
        for r in rs:
            failures += [f"{r.check}: {f}" for f in r.failures[:5]]
            if len(r.failures) > 5:
                failures.append(f"{r.check}: ... {len(r.failures) - 5} more")
    return failures


def run_check(
    names: Sequence[str],
    device_name: str,
    seed: int | None,
    checks: Sequence[str],
    seeds: int = 1,
    report: bool = False,
    reference_on: str = "device",
) -> bool:
    from opforge.report import check_table, worst_table

    names, projects_cuda, own_library = _projects(names)
    device = _device(device_name, projects_cuda, own_library=own_library)
    seed = _seed(seed)
    specs = _specs(names, own_library=own_library)
    err.print(f"opforge check on {device}, seed {seed}{f' (+{seeds - 1} more)' if seeds > 1 else ''} (rerun with --seed {seed})")
    results = check_ops(specs, device, seed, checks, seeds, reference_on)
    out.print(check_table(f"opforge check ({device}, seed {seed}{f', {seeds} seeds' if seeds > 1 else ''})", checks, results))
    worst_rows = [(spec.name, case, e) for spec in specs for r in results[spec.qualname] for case, e in r.worst.items()]
    if worst_rows:
        out.print(worst_table(worst_rows, per_case=report))
    for f in check_failures(results):
        out.print(f"[red]x[/] {escape(f)}", highlight=False)
    n_pass = sum(r.status == "pass" for rs in results.values() for r in rs)
    n_fail = sum(r.status == "fail" for rs in results.values() for r in rs)
    out.print(f"{n_pass} passed, {n_fail} failed")
    return n_fail == 0


def cmd_check(args: argparse.Namespace) -> int:
    checks = args.checks.split(",") if args.checks else None
    from opforge.check import CHECKS

    for c in checks or ():
        if c not in CHECKS:
            usage_error(f"opforge: unknown check {c!r}; choose from {', '.join(CHECKS)}")
    if args.seeds < 1:
        usage_error(f"opforge: --seeds must be at least 1, got {args.seeds}")
    return 0 if run_check(args.ops, args.device, args.seed, checks or CHECKS, args.seeds, args.report, args.reference_on) else 1


@dataclass
class BenchOptions:
    """What ``bench`` and ``run`` time. ``dtypes`` None: each op's own
    (opforge.bench.default_dtypes); ``largest``: only each op's largest case;
    ``compile`` None: the torch.compile baseline on a GPU, not on the CPU."""

    dtypes: Sequence[str] | None = ("float32", "float16", "bfloat16")
    budget: float = 0.3
    graph: bool = False
    compile: bool | None = True
    sweep: bool = False
    cases: Sequence[str] | None = None
    largest: bool = False
    remeasure: bool = False
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    compare_path: Path | None = None


def bench_table(report) -> Any:  # noqa: ANN001
    from opforge.report import bench_table as table

    return table(report)


def _fast_path_for_packages() -> None:
    """A package's public functions take the eager fast path, as they do in a
    user's process (where importing the package imports opforge, which loads its
    library): the fast path's module lives in opforge's op library, so it is
    loaded before the packages are. Without it they are timed through torch.ops."""
    import opforge
    from opforge.build import BuildError

    try:
        opforge.load()
    except BuildError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err.print(f"opforge bench: opforge's op library did not build ({first}); package operators are timed without the eager fast path",
                  highlight=False, markup=False, soft_wrap=True)  # fmt: skip


def _case_key(name: str) -> tuple[int, str]:
    """Cases named 2^N sort by N; others after them, by name."""
    return (int(name[2:]), "") if name.startswith("2^") and name[2:].isdigit() else (1 << 30, name)


def _targets(names: Sequence[str], device_name: str) -> tuple[Any, list[Any]]:
    """The device and the specs of ``names`` (package directories loaded)."""
    from opforge.project import names_a_path

    if any(names_a_path(n) and Path(n).is_dir() for n in names):
        _fast_path_for_packages()
    names, projects_cuda, own_library = _projects(names)
    device = _device(device_name, projects_cuda, own_library=own_library)
    return device, _specs(names, own_library=own_library)


def bench_ops(specs: Sequence[Any], device: Any, seed: int, opts: BenchOptions, *, verified: Sequence[str] = ()) -> Any:
    """The report of every op's cases, a line per case as each is timed.
    ``verified``: qualified names whose reference and bad-input checks have just passed (not run again)."""
    import torch

    from opforge import bench, ceilings
    from opforge.report import COMPILE_NOT_ON_CPU, Steps, row_line

    name = bench._device_name(device)
    if opts.remeasure or not ceilings.cache_path(name).is_file():
        err.print(f"measuring the machine's ceilings (once per machine; cached in {ceilings.cache_path(name)})", highlight=False)
    ceil = ceilings.load_or_measure(device, name, remeasure=opts.remeasure)
    report = bench.new_report(device, graph=opts.graph, ceilings=ceil)
    for warning in report.warnings:
        err.print(f"[yellow]warning: {escape(warning)}[/]", highlight=False)
    if opts.cases:
        known = {n for s in specs for n in bench.case_names(s, device, sweep=opts.sweep)}
        unknown = [c for c in opts.cases if c not in known]
        if unknown:
            what = "sweep cases" if opts.sweep else "cases"
            usage_error(f"opforge bench: no {what} named {', '.join(unknown)}; they are: {', '.join(sorted(known, key=_case_key))}")
    compile_ = opts.compile if opts.compile is not None else device.type != "cpu"
    compile_note = "not asked (--no-compile)" if opts.compile is not None else COMPILE_NOT_ON_CPU
    plan = []
    for spec in specs:
        dtypes = [getattr(torch, d) for d in opts.dtypes] if opts.dtypes else bench.default_dtypes(spec, device)
        plan.append((spec, dtypes, bench.count_cases(spec, device, dtypes, sweep=opts.sweep, only=opts.cases, largest=opts.largest)))
    steps = Steps(err, sum(p[2] for p in plan), "benchmarking")
    with steps.running():
        for spec, dtypes, _ in plan:
            started = [time.perf_counter()]

            def on_row(row: Any, started: list[float] = started) -> None:
                steps.line(row_line(row, time.perf_counter() - started[0]))
                started[0] = time.perf_counter()

            report.rows += bench.bench_op(
                spec, device, seed=seed, dtypes=dtypes, budget_s=opts.budget, graph=opts.graph, compile=compile_, sweep=opts.sweep,
                only=opts.cases, largest=opts.largest, ceilings=ceil, progress=steps.doing, verify=spec.qualname not in verified,
                compile_note=compile_note, on_row=on_row,
            )  # fmt: skip
    return report


def write_outputs(report: Any, opts: BenchOptions) -> bool:
    """The files asked for (JSON, CSV, plot) and the comparison with an earlier
    run; False if that comparison found a regression."""
    from opforge import bench, ceilings

    for path, writer in ((opts.json_path, bench.write_json), (opts.csv_path, bench.write_csv)):
        if path:
            writer(report, path)
            out.print(f"wrote {path}")
    plot_path = opts.plot_path or (Path(f"opforge-bench-{ceilings._slug(report.device_name)}.png") if opts.sweep else None)
    if plot_path:
        bench.plot(report, plot_path)
        out.print(f"wrote {plot_path}")
    if opts.compare_path:
        return print_comparison(bench.read_json(opts.compare_path), report)
    return True


def _print_notes(report: Any) -> None:
    """Why a baseline has no timing, once per op, where it is not simply left out; then
    the report's warnings (a busy CPU)."""
    from opforge.report import COMPILE_NOT_ON_CPU

    notes = {(r.op, impl, note) for r in report.rows for impl, note in r.notes.items() if note != COMPILE_NOT_ON_CPU}
    for op, impl, note in sorted(notes):
        out.print(f"[yellow]{op}: no {impl} timing: {escape(note)}[/]", highlight=False)
    for warning in report.warnings:
        out.print(f"[yellow]warning: {escape(warning)}[/]", highlight=False)


def run_bench(names: Sequence[str], device_name: str, seed: int | None, opts: BenchOptions) -> bool:
    device, specs = _targets(names, device_name)
    seed = _seed(seed)
    err.print(f"opforge bench on {device}, seed {seed}")
    report = bench_ops(specs, device, seed, opts)
    out.print(bench_table(report))
    out.print(
        "medians per call, ± the inter-quartile range (~: stopped by --budget before it fell under 1 %); "
        "GB/s and TFLOP/s (opforge / eager, for ops of more than one FLOP per byte) from the op's cost model; "
        "% of limit = roofline floor (measured copy and matmul ceilings) / time"
    )
    _print_notes(report)
    ok = all(r.status == "ok" for r in report.rows)
    return write_outputs(report, opts) and ok


def print_comparison(old, new) -> bool:  # noqa: ANN001
    """Ratio per case against an earlier run; False if anything regressed beyond the spread."""
    from opforge.bench import compare

    rows = compare(old, new)
    table = Table(title=f"against {old.device_name}, {old.date} (commit {(old.git_commit or '?')[:10]})")
    for col in ("operator", "dtype", "size", "old us", "new us", "new/old", "verdict"):
        table.add_column(col, justify="left" if col in ("operator", "dtype", "size", "verdict") else "right")
    colours = {"regression": "bold red", "faster": "green", "same": "dim"}
    for c in rows:
        table.add_row(
            c.op, c.dtype, c.case, f"{c.old_us:,.1f}", f"{c.new_us:,.1f}", f"{c.ratio:.3f}", f"[{colours[c.verdict]}]{c.verdict}[/]"
        )
    out.print(table)
    n_reg = sum(c.verdict == "regression" for c in rows)
    out.print(f"{len(rows)} compared, {n_reg} regressed, {sum(c.verdict == 'faster' for c in rows)} faster (beyond the measured spread)")
    return n_reg == 0


def _bench_options(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        dtypes=args.dtype.split(","), budget=args.budget, graph=args.graph, compile=not args.no_compile, sweep=args.sweep,
        cases=args.case.split(",") if args.case else None,
        remeasure=args.remeasure, json_path=args.json, csv_path=args.csv, plot_path=args.plot, compare_path=args.compare,
    )  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    return 0 if run_bench(args.ops, args.device, args.seed, _bench_options(args)) else 1


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_cache_list(args: argparse.Namespace) -> int:
    import datetime

    from opforge.build import BuildError, cache, cache_root

    try:
        found = cache.entries()
    except BuildError as exc:
        raise SystemExit(str(exc)) from None
    table = Table(title=f"opforge build cache: {cache_root(write=False)}")
    for col in ("entry", "state", "size", "built in", "last used"):
        table.add_column(col, justify="right" if col in ("size", "built in") else "left")
    for e in found:
        if e.objects:
            state = "objects (for incremental rebuilds)"
        elif e.complete:
            state = "complete"
        else:
            state = "[yellow]incomplete[/] (a failed or killed build; the next build wipes it)"
        built = f"{e.build_seconds:.1f} s" if e.build_seconds is not None else "-"
        when = datetime.datetime.fromtimestamp(e.last_used).isoformat(sep=" ", timespec="seconds")
        table.add_row(e.path.name, state, _mib(e.size), built, when)
    out.print(table)
    out.print(f"{len(found)} entries, {_mib(sum(e.size for e in found))}")
    return 0


def cmd_cache_clean(args: argparse.Namespace) -> int:
    from opforge.build import BuildError, cache

    if args.older_than is not None and args.older_than < 0:
        usage_error(f"opforge: --older-than must be a number of days >= 0, got {args.older_than}")
    try:
        removed, busy = cache.clean(args.older_than)
    except BuildError as exc:
        raise SystemExit(str(exc)) from None
    for e in removed:
        out.print(f"removed {e.path.name} ({_mib(e.size)})")
    for e in busy:
        out.print(f"[yellow]kept {e.path.name}: a build holds its lock[/]")
    out.print(f"removed {len(removed)} entries, freed {_mib(sum(e.size for e in removed))}")
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    from opforge.project import ProjectError, names_a_path, scaffold

    try:
        if args.torch_min is not None and not args.stable_abi:
            print("opforge new: --torch-min goes with --stable-abi", file=sys.stderr)
            return 2
        root = scaffold(
            args.name,
            args.dir,
            args.namespace,
            cuda=not args.no_cuda,
            backward=args.backward,
            stable_abi=args.stable_abi,
            torch_min=args.torch_min or "2.10",
        )
    except ProjectError as exc:
        raise SystemExit(f"opforge new: {exc}") from None
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    out.print(f"wrote {root}/: {', '.join(files)}", highlight=False)
    op = f"torch.ops.{args.namespace or args.name}.{args.name}"
    out.print(f"the operator: {op}, softsign for a start; {root}/README.md says how to make it yours", highlight=False)
    out.print("next:", highlight=False)
    # check and bench take a bare name for an operator's: the package is named as a path.
    where = str(root) if names_a_path(str(root)) else f"./{root}"
    for cmd in (f"opforge build {root}", f"opforge check {where}", f"opforge bench {where}", f"python -m pytest {root}/tests",
                f"pip install --no-build-isolation {root}"):  # fmt: skip
        out.print(f"  {cmd}", highlight=False)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _run_options(args: argparse.Namespace) -> BenchOptions:
    """The main job's cases: by default each op's largest case in the dtypes
    that matter on the device, torch.compile on a GPU only; ``--full``: every
    case of the sweeps, every dtype, torch.compile everywhere."""
    from opforge.bench import BENCH_DTYPES

    full = args.full
    dtypes = args.dtype.split(",") if args.dtype else [str(d).removeprefix("torch.") for d in BENCH_DTYPES] if full else None
    return BenchOptions(
        dtypes=dtypes, budget=args.budget, graph=args.graph, compile=False if args.no_compile else True if full else None,
        sweep=args.sweep or full, cases=args.case.split(",") if args.case else None, largest=not (full or args.case or args.sweep),
        remeasure=args.remeasure, json_path=args.json, csv_path=args.csv, plot_path=args.plot, compare_path=args.compare,
    )  # fmt: skip


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: build, check, benchmark; one summary table at the end."""
    from opforge.check import CHECKS
    from opforge.report import SummaryOp, summary_table

    start = time.perf_counter()
    device, specs = _targets(args.ops, args.device)
    print_library()
    seed = _seed(args.seed)
    opts = _run_options(args)
    err.print(
        f"opforge run on {device}, seed {seed} (rerun with --seed {seed}): check {len(specs)} operators, then time them", highlight=False
    )
    checked = check_ops(specs, device, seed, CHECKS)
    verified = [q for q, rs in checked.items() if all(r.ok for r in rs if r.check in ("reference", "bad inputs"))]
    report = bench_ops(specs, device, seed, opts, verified=verified)
    by_op = {s.qualname: [r for r in report.rows if r.op == s.name] for s in specs}
    out.print(summary_table(report, [SummaryOp(q, checked[q], by_op[q]) for q in checked]))
    failures = check_failures(checked)
    for f in failures:
        out.print(f"[red]x[/] {escape(f)}", highlight=False)
    _print_notes(report)
    written_ok = write_outputs(report, opts)
    n_fail = sum(any(not r.ok for r in rs) for rs in checked.values())
    n_refused = sum(r.status != "ok" for r in report.rows)
    ok = written_ok and not n_fail and not n_refused
    n_timed = len(report.rows) - n_refused
    out.print(
        f"{_count(len(specs), 'operator')}: {len(specs) - n_fail} passed every check, {n_fail} failed; "
        f"{_count(n_timed, 'case')} timed, {n_refused} refused ({time.perf_counter() - start:.0f} s)"
        + ("" if args.full else "; --full: every case and dtype, torch.compile everywhere")
    )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opforge", description="Build, check and benchmark custom PyTorch operators.")
    p.add_argument("--version", action="version", version=f"opforge {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("ops", nargs="*",
                        help="operators, package directories of opforge new's given as paths (./my_op, my_op/: their "
                             "operators), or spec files (my_specs.py: the operators its SPECS list, opforge.spec(...) of "
                             "operators already in torch.ops); default: all")  # fmt: skip
        sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if a GPU is visible, else cpu")
        sp.add_argument("--seed", type=int, default=None, help="random seed (default: fresh, printed)")

    sp = sub.add_parser("build", help="build (or find in the cache) the op library, or a folder of yours, and say where it is")
    sp.add_argument("path", nargs="?", type=Path, default=None,
                    help="a folder of your sources, in any layout: sources and headers in any subfolder, a package "
                         "importing _C, a pybind11 module, a setup.py or a CMakeLists.txt; what it finds is printed "
                         "first (default: opforge's own op library)")  # fmt: skip
    sp.add_argument("--route", choices=["auto", "setup.py", "jit", "inline", "setuptools", "pybind", "cmake", "package"], default="auto",
                    help="auto (default): the one the folder calls for; setup.py: the extensions its setup.py declares, read "
                         "from it (setup() is not run) and built in place as build_ext --inplace would; TORCH_LIBRARY ops "
                         "by jit (cached ninja build), inline (the files as strings) or setuptools (build_ext, as pip "
                         "install); pybind: a "
                         "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) module; cmake: its CMakeLists.txt; package: a "
                         "package importing _C, its library built in place as <package>/_C<EXT_SUFFIX>")  # fmt: skip
    sp.set_defaults(fn=cmd_build)
    sp = sub.add_parser("new", help="scaffold an operator package: C++/CUDA kernels, schema, spec, tests, pyproject.toml")
    sp.add_argument("name", help="the operator's name, also the Python package's (an identifier such as my_op)")
    sp.add_argument("--dir", type=Path, default=None, help="where to write it (default: ./NAME); must not exist or be empty")
    sp.add_argument("--namespace", default=None, help="its torch.ops namespace (default: NAME)")
    sp.add_argument("--no-cuda", action="store_true", help="a CPU kernel only, no CUDA kernel")
    sp.add_argument("--backward", action="store_true", help="with an autograd formula (backward), checked by gradcheck")
    sp.add_argument(
        "--stable-abi", action="store_true", help="C++ on PyTorch's stable ABI: one build loads in every torch from --torch-min on"
    )
    sp.add_argument("--torch-min", default=None, metavar="X.Y", help="with --stable-abi: the oldest torch to target (default 2.10)")
    sp.set_defaults(fn=cmd_new)
    sp = sub.add_parser("list", help="list the operators and their schemas")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser("check", help="verify operators: reference, opcheck, gradcheck, gradgradcheck, torch.compile, bad inputs")
    common(sp)
    sp.add_argument(
        "--checks", default=None, help="comma-separated subset of: reference,opcheck,gradcheck,gradgradcheck,compile,bad inputs"
    )
    sp.add_argument("--seeds", type=int, default=1, help="K fresh seeds per sample for the reference check (default 1)")
    sp.add_argument("--report", action="store_true", help="the worst error per case, not per dtype")
    sp.add_argument(
        "--reference-on",
        choices=("device", "cpu"),
        default="device",
        help="where the float64 reference runs (default: the checked device; profile --sanitize uses cpu)",
    )
    sp.set_defaults(fn=cmd_check)
    for name, helptext, fn in [
        ("bench", "time operators against their PyTorch reference", cmd_bench),
        ("run", "the main job: build, check every operator, time each in its largest case; one summary table", cmd_run),
    ]:
        sp = sub.add_parser(name, help=helptext)
        common(sp)
        run = name == "run"
        if run:
            sp.add_argument("--full", action="store_true",
                            help="every case of the sweeps (and their plot, as --sweep), every dtype, the torch.compile "
                                 "baseline on the CPU too (tens of minutes there)")  # fmt: skip
            sp.add_argument("--dtype", default=None, type=_dtype_list,
                            help="comma-separated dtypes (default: float32 on the CPU; on a GPU each op's first dtype "
                                 "and bfloat16)")  # fmt: skip
        else:
            sp.add_argument("--dtype", default="float32,float16,bfloat16", type=_dtype_list, help="comma-separated dtypes")
        sp.add_argument("--budget", type=_positive_seconds, default=0.3,
                        help="at most this many seconds of timing per case and side (default 0.3)")  # fmt: skip
        sp.add_argument("--graph", action="store_true", help="replay each call from a CUDA graph (no launch overhead)")
        sp.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile baseline" + (" (run by default on a GPU only)" if run else ""))  # fmt: skip
        sp.add_argument("--sweep", action="store_true", help="every size the specs declare for sweeps, and a plot")
        sp.add_argument("--case", default=None,
                        help="comma-separated case names to run (e.g. 2^26,2^28 with --sweep); default: "
                        + ("each op's largest" if run else "all"))  # fmt: skip
        sp.add_argument("--remeasure", action="store_true", help="measure the machine's ceilings again")
        sp.add_argument("--json", type=Path, default=None, help="write every figure, with device and versions, to this file")
        sp.add_argument("--csv", type=Path, default=None, help="the same as CSV, one line per case and implementation")
        sp.add_argument(
            "--plot",
            type=Path,
            default=None,
            help="PNG of bandwidth against size, or TFLOP/s per case for compute-bound ops such as gemm "
            "(default with --sweep: opforge-bench-<device>.png)",
        )
        sp.add_argument("--compare", type=_existing_file, default=None,
                        help="an earlier --json: ratio per case, regressions flagged (exit 1)")  # fmt: skip
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("cache", help="list or clean the build cache")
    cache_sub = sp.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="entries, sizes, last use").set_defaults(fn=cmd_cache_list)
    sp = cache_sub.add_parser("clean", help="remove entries (all, or unused for --older-than days); builds in progress are kept")
    sp.add_argument("--older-than", type=float, default=None, metavar="DAYS", help="only entries not used for this many days")
    sp.set_defaults(fn=cmd_cache_clean)

    from opforge import abi, doctor, profile

    abi.register_cli(sub)
    doctor.register_cli(sub)
    profile.register_cli(sub)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
