"""What ``opforge build PATH --dry-run`` prints: the build it would run (route,
extensions, sources, flags, where the library goes) and the folder's code that
a real build runs, worked out without running any of it. A setup.py is parsed,
not run: what it declares by literal arguments is shown, what its code computes
is said to be computed; a CMakeLists.txt is not configured."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opforge.builder.config import folder_config
from opforge.builder.errors import BuildError
from opforge.builder.inline import folder_module_name, pybind_folder_config
from opforge.builder.jit import cache_root, module_name
from opforge.builder.sources import shown_path
from opforge.folders.cmake import definitions
from opforge.folders.discover import Layout

# What a real build of each route runs of the folder's own code, as pip or cmake would.
RUNS = {
    "setup.py": "setup.py's top-level code (setuptools.setup replaced, so nothing after a caught setup() builds, but it runs), "
    "then `import` of each extension in a new process (its package's __init__.py runs), and the library's C++ static initializers",
    "package": "the package's __init__.py, when it is imported in a new process after the build, and the library's C++ static initializers",
    "cmake": "CMakeLists.txt, configured and built by cmake (execute_process, add_custom_command and the like run), "
    "and the C++ static initializers of each library it makes, when it is loaded",
    "kernel-builder": "the library's C++ static initializers, and torch-ext/<name>/__init__.py when the package is "
    "imported in a new process",
}
_LOADS = "the library's C++ static initializers (TORCH_LIBRARY blocks among them), when it is loaded: in a new process first, then here"


def plan_lines(layout: Layout, route: str, *, setup_py: Path | None = None, defines: Sequence[str] = ()) -> list[str]:
    """The plan, one line each, from the files as they are; nothing is run or compiled.
    ``defines``: the cmake route's cache definitions (``-D``)."""
    root = layout.root
    lines = [f"  plan (--dry-run: nothing is compiled, and no code of {shown_path(root.name)} runs):"]
    if route in ("jit", "inline", "setuptools", "pybind"):
        lines += _engine_plan(root, route)
    elif route == "package" and layout.package is not None:
        p = layout.package
        lines.append(f"    sources: {', '.join(layout.tree.rel(s) for s in layout.tree.sources)}")
        lines.append(f"    output: {layout.tree.rel(p.target())} (built in the cache, then copied into the package)")
    elif route == "setup.py" and setup_py is not None:
        lines += setup_py_plan(setup_py, root)
    elif route == "cmake":
        build = f"<cache>/cmake-{shown_path(root.name)}-<hash>"
        given = "".join(f" -D{d}" for d in definitions(defines))
        lines.append(f"    cmake -S {shown_path(root)} -B {build}{given}, then cmake --build; each .so it makes is loaded")
    elif route == "kernel-builder":
        lines.append("    build.toml's backends, one library each, placed in torch-ext/ and build/<variant>/")
    lines.append(f"  a build runs code of this folder: {RUNS.get(route, _LOADS)}")
    return lines


def _engine_plan(folder: Path, route: str) -> list[str]:
    try:
        cfg = pybind_folder_config(folder, folder_module_name(folder)) if route == "pybind" else folder_config(folder)
    except (BuildError, ValueError) as exc:
        return [f"    cannot be built: {exc}"]

    def rel(p: Path) -> str:
        return shown_path(p.relative_to(folder).as_posix()) if p.is_relative_to(folder) else shown_path(p)

    n = len(cfg.sources)
    lines = [f"    library: {cfg.name} ({n} source{'s' if n != 1 else ''}): {', '.join(rel(s) for s in cfg.sources)}"]
    lines.append(f"    include: {', '.join(rel(d) for d in cfg.include_dirs)}")
    lines.append(f"    cxx flags: {' '.join(cfg.cflags) or '(none)'}")
    if cfg.cuda_cflags:
        lines.append(f"    nvcc flags: {' '.join(cfg.cuda_cflags)}")
    if cfg.ldflags:
        lines.append(f"    link flags: {' '.join(cfg.ldflags)}")
    key = cfg.key()[:16]
    if route == "setuptools":
        out = cache_root(write=False) / f"setuptools-{cfg.name}-{key}" / f"{cfg.name}.<EXT_SUFFIX>"
        lines.append(f"    output: {out} (setuptools' build_ext with opforge's own setup script; the folder's setup.py is not used)")
    else:
        lines.append(f"    output: {cache_root(write=False) / f'{cfg.name}-{key}' / f'{module_name(cfg)}.so'}")
    return lines


def setup_py_plan(setup_py: Path, root: Path) -> list[str]:
    """What ``setup_py`` declares where its code says it in literals (``CppExtension("pkg._C",
    ["a.cpp"])``), read from its syntax tree, never run; what its code computes is said to be."""
    try:
        tree = ast.parse(setup_py.read_bytes(), filename=str(setup_py))
    except (SyntaxError, ValueError) as exc:
        return [f"    setup.py does not parse ({exc}): a build would fail on it"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node.func).endswith("Extension") and _callee(node.func) != "BuildExtension":
            found.append(node)
    if not found:
        return ["    setup.py: no Extension call written out; what it declares is computed by its code, read only when a build runs it"]
    lines = [f"    setup.py (parsed, not run): {len(found)} extension{'s' if len(found) != 1 else ''} written out:"]
    for call in found:
        args = {i: a for i, a in enumerate(call.args)}
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        name = _literal(kw.get("name", args.get(0)))
        sources = _literal(kw.get("sources", args.get(1)))
        shown_name = name if isinstance(name, str) else "<computed by its code>"
        lines.append(f"      {shown_name} ({_callee(call.func)}), line {call.lineno}")
        if isinstance(sources, list) and all(isinstance(s, str) for s in sources):
            lines.append(f"        sources: {', '.join(sources)}")
        else:
            lines.append("        sources: computed by its code")
        for flag in ("include_dirs", "define_macros", "extra_compile_args", "libraries", "extra_link_args"):
            if flag in kw:
                value = _literal(kw[flag])
                lines.append(f"        {flag}: {value if value is not _COMPUTED else 'computed by its code'}")
    lines.append(f"    output: each extension where build_ext --inplace puts it, below {shown_path(root)}")
    return lines


_COMPUTED = object()


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return _COMPUTED
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _COMPUTED


def _callee(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


__all__ = ["RUNS", "plan_lines", "setup_py_plan"]
