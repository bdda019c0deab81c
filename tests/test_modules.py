"""The package's shape: modules that import alone, layers without cycles, no
reaching into another module's private helpers, no module past 500 lines.

Each test lists every violation it finds, not only the first, so that one run
says everything there is to fix.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "opforge"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# `python -m opforge` runs the command on import.
MODULES: dict[str, Path] = {
    _module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py" and "templates" not in p.parts
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str) -> str:
    """The package a module belongs to (a package belongs to itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


@dataclass
class Import:
    target: str  # a module of MODULES
    line: int
    local: bool  # inside a function: run on call, not on import
    names: list[str] = field(default_factory=list)  # `from target import ...` names that are not modules


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(module: str, tree: ast.AST, *, type_only: bool = False) -> list[Import]:
    """Every import of an opforge module, at module level or in a function;
    ``if TYPE_CHECKING:`` blocks (which never run) only with ``type_only``: a
    type-only import is still an arrow in the drawing, and a circle through one
    comes back as a real one the day the annotation is evaluated."""
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        if not type_only and isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child, local)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, local) for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            names = []
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    found.append(Import(f"{base}.{a.name}", node.lineno, local))
                else:
                    names.append(a.name)
            if names and base in MODULES:
                found.append(Import(base, node.lineno, local, names))
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


TREES: dict[str, ast.Module] = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
IMPORTS: dict[str, list[Import]] = {name: _walk_imports(name, tree) for name, tree in TREES.items()}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


# ------------------------------------------------------------- (a) imports


# Every opforge module dropped from sys.modules before the next is imported:
# each then imports as in a fresh interpreter (torch, already loaded, is not
# ours and changes nothing), without paying torch's import once per module.
_IMPORT_EACH = """
import importlib, json, sys, traceback
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "opforge" or m.startswith("opforge.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failures[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
print(json.dumps(failures))
"""


def test_every_module_imports_alone():
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(sorted(MODULES))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "modules that fail to import alone:\n" + "\n".join(f"  {m}: {e}" for m, e in sorted(failures.items()))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles():
    """No cycle among the modules' imports, counting those inside functions:
    an import moved into a function to dodge a cycle leaves the layers tangled."""
    edges = {m: {i.target for i in imports if i.target != m} for m, imports in IMPORTS.items()}
    report = []
    for component in _cycles(edges):
        members = set(component)
        report.append("cycle: " + ", ".join(component))
        for m in component:
            for i in IMPORTS[m]:
                if i.target in members and i.target != m:
                    report.append(f"  {_where(m, i.line)} imports {i.target}" + (" (inside a function)" if i.local else ""))
    assert not report, "\n".join(report)


def test_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(edges) == [["a", "b", "c"], ["e"]]


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement inside a function body (any import, not only opforge's)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, local: bool) -> None:
        if local and isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def unexplained_local_imports(source: str) -> list[int]:
    """The lines of imports inside functions that say not why: a ``# lazy: <reason>`` comment
    on the import's line or on the line directly above it, which may head a run of imports."""
    lines = source.splitlines()
    imports = sorted(_function_imports(ast.parse(source)), key=lambda n: n.lineno)
    ends = {n.end_lineno: n for n in imports}
    headed: set[int] = set()  # under a comment line: it and the imports right after it
    explained: set[int] = set()
    for node in imports:
        above = node.lineno - 1
        if (above and lines[above - 1].strip().startswith("# lazy:")) or (above in ends and ends[above].lineno in headed):
            headed.add(node.lineno)
        if node.lineno in headed or "# lazy:" in lines[node.lineno - 1]:
            explained.add(node.lineno)
    return [n.lineno for n in imports if n.lineno not in explained]


def test_every_import_inside_a_function_says_why():
    """An import inside a function hides a dependency from the module's top: it stays there
    only for import time, an optional dependency or a script's constraint, and says which."""
    sources = {**MODULES, "opforge_cli": PACKAGE.parent / "opforge_cli.py"}
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sources.values() for line in unexplained_local_imports(path.read_text())]
    assert not found, "imports inside functions without a `# lazy: <reason>` comment (or move them to the top):\n" + "\n".join(
        f"  {f}" for f in found
    )


def test_local_import_check_finds_an_unexplained_one(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(
        "import os\n"
        "def f():\n"
        "    import json\n"  # unexplained
        "    # lazy: import time (torch._dynamo, 1.6 s)\n"
        "    import torch._dynamo\n"
        "    from torch.distributed.tensor import (\n"
        "        Replicate,\n"
        "    )\n"
        "    x = 1\n"
        "    import shutil  # lazy: optional dependency\n"
        "    import re\n"  # a comment at the end of the line above covers that line only
        "    # lazy: optional dependency\n"
        "    x = 2\n"
        "    import glob\n"  # the comment is not directly above
        "    return lambda: __import__('sys')\n"
        "class C:\n"
        "    def m(self):\n"
        "        from pathlib import Path\n"  # unexplained, in a method
        "        return Path\n"
    )
    assert unexplained_local_imports(module.read_text()) == [3, 11, 14, 18]
    explained = tmp_path / "explained.py"
    explained.write_text("def f():\n    # lazy: optional dependency (matplotlib)\n    import matplotlib\n\n    return matplotlib\n")
    assert unexplained_local_imports(explained.read_text()) == []


# ------------------------------------------------------ (b) private names


def _bindings(module: str, tree: ast.Module) -> dict[str, str]:
    """Names bound to opforge modules anywhere in ``module`` (``import opforge.x as y``, ``from opforge import x``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "opforge" or a.name.startswith("opforge."):
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound[a.name.partition(".")[0]] = "opforge"
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
    return bound


def _dotted(node: ast.Attribute) -> tuple[str, list[str]] | None:
    parts = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    return (cur.id, parts[::-1]) if isinstance(cur, ast.Name) else None


def private_uses(module: str, tree: ast.Module) -> list[str]:
    """Where ``module`` imports or reads another opforge module's private
    name, or a private module of a package it is not in."""
    found: list[tuple[int, str]] = []
    package = _package_of(module)

    def module_path_ok(target: str, line: int) -> None:
        parts = target.split(".")
        for k, part in enumerate(parts):
            owner = ".".join(parts[:k])
            if _private(part) and not (package == owner or package.startswith(owner + ".")):
                found.append((line, f"imports {target}, a private module of {owner}"))
                return

    for imp in IMPORTS[module]:
        module_path_ok(imp.target, imp.line)
        if imp.target != module:
            found += [(imp.line, f"imports {imp.target}.{n}") for n in imp.names if _private(n)]

    bound = _bindings(module, tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = _dotted(node)
        if chain is None or chain[0] not in bound:
            continue
        target, attrs = bound[chain[0]], chain[1]
        # Walk down through submodules (opforge.builder.jit) to the first attribute that is not one.
        while len(attrs) > 1 and f"{target}.{attrs[0]}" in MODULES:
            target, attrs = f"{target}.{attrs[0]}", attrs[1:]
        if len(attrs) == 1 and target != module:
            found.append((node.lineno, f"uses {target}.{attrs[0]}"))
    return [f"{_where(module, line)} {text}" for line, text in sorted(found)]


def test_no_module_uses_another_modules_private_names():
    found = [use for module, tree in TREES.items() for use in private_uses(module, tree)]
    assert not found, "private names used outside their module:\n" + "\n".join(f"  {f}" for f in sorted(set(found)))


def test_private_use_scan_finds_each_form(tmp_path, monkeypatch):
    source = (
        "from opforge.builder.jit import _is_complete, module_name\n"
        "from opforge.builder import toolchain\n"
        "import opforge.builder.store as store\n"
        "import opforge\n"
        "from opforge.ops._elementwise import randn\n"
        "def f():\n"
        "    toolchain._version_tuple('1.2')\n"
        "    opforge.builder.jit._sha256(None)\n"
        "    store.__name__, toolchain.run, module_name\n"
        "    return store._CACHE\n"
    )
    path = PACKAGE / "probe_for_test.py"
    monkeypatch.setitem(MODULES, "opforge.probe_for_test", path)
    tree = ast.parse(source)
    monkeypatch.setitem(IMPORTS, "opforge.probe_for_test", _walk_imports("opforge.probe_for_test", tree))
    found = [f.split(" ", 1)[1] for f in private_uses("opforge.probe_for_test", tree)]
    assert found == [
        "imports opforge.builder.jit._is_complete",
        "imports opforge.ops._elementwise, a private module of opforge.ops",
        "uses opforge.builder.toolchain._version_tuple",
        "uses opforge.builder.jit._sha256",
        "uses opforge.builder.store._CACHE",
    ]


# ----------------------------------------------------------- (c) line counts


def test_no_module_is_over_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(
        f"  {MODULES[m].relative_to(ROOT)}: {n}" for m, n in sorted(long.items(), key=lambda kv: -kv[1])
    )


# ------------------------------------------------------------ (d) the house

#: The modules at the package's top: the runtime that ``import opforge`` needs and the few small
#: modules every floor shares. A toolkit command is a package of its own (check/, bench/, ...).
TOP_LEVEL = {
    "opforge": "the package: loads the op library, the public functions",
    "opforge.arguments": "the public functions' argument errors the dispatcher words poorly",
    "opforge.autograd": "the derivatives of the operators",
    "opforge.console": "stdout / stderr consoles every command prints through",
    "opforge.derive": "samples, cost and tolerances derived from a schema",
    "opforge.elf_symbols": "an ELF file's symbols, read without loading it",
    "opforge.export": "torch.export and AOTInductor packages that carry their op libraries",
    "opforge.fast": "the eager fast path",
    "opforge.public": "an operator's public function: the fast path, else the dispatcher",
    "opforge.nn": "torch.nn modules over the operators",
    "opforge.nvml": "the GPU's clocks and name, without CUDA",
    "opforge.opspec": "OpSpec, the one description of an operator (imports nothing of opforge)",
    "opforge.parallel": "the older import path of opforge.tensor_parallel",
    "opforge.project": "opforge new's packages and users' spec files",
    "opforge.quant": "W4A8 weight and activation quantisation",
    "opforge.registry": "the specs registered, each wired to its fake kernel, autograd, public function, sharding",
    "opforge.sharding_strategies": "DTensor sharding strategies from a spec",
    "opforge.spec_path": "the older import path opforge.spec (opforge.spec is the function)",
    "opforge.tensor_parallel": "tensor-parallel styles for the quantised linear",
}


def top_level_strays(modules: dict[str, Path]) -> list[str]:
    """Modules at ``opforge``'s top that are not among TOP_LEVEL."""
    return sorted(m for m, p in modules.items() if m.count(".") <= 1 and p.name != "__init__.py" and m not in TOP_LEVEL)


def cli_outside_cli(trees: dict[str, ast.Module]) -> list[str]:
    """Modules outside ``opforge.cli`` that define ``register_cli`` or parse a command line."""
    found = []
    for module, tree in trees.items():
        if module == "opforge.cli" or module.startswith("opforge.cli."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "register_cli":
                found.append(f"{module}:{node.lineno} defines register_cli")
            elif isinstance(node, ast.Attribute) and node.attr == "ArgumentParser":
                found.append(f"{module}:{node.lineno} builds an ArgumentParser")
    return found


def own_package_doors(imports: dict[str, list[Import]]) -> list[str]:
    """Submodules that take names from their own package's ``__init__`` (which only hands names on)."""
    found = []
    for module, imps in imports.items():
        package = module.rpartition(".")[0]
        if MODULES[module].name == "__init__.py" or package in ("", "opforge"):
            continue
        found += [f"{module}:{i.line} imports {', '.join(i.names)} from {package}" for i in imps if i.target == package and i.names]
    return found


def test_toolkit_modules_live_in_their_packages():
    strays = top_level_strays(MODULES)
    assert not strays, f"modules at opforge's top that belong in a package (or in TOP_LEVEL, with their role): {strays}"


def test_top_level_check_finds_a_stray():
    assert top_level_strays({**MODULES, "opforge.bench_extra": PACKAGE / "bench_extra.py"}) == ["opforge.bench_extra"]


def test_command_lines_are_parsed_in_cli_only():
    found = cli_outside_cli(TREES)
    assert not found, "argument parsing outside opforge.cli:\n" + "\n".join(f"  {f}" for f in found)


def test_cli_check_finds_a_register_cli_elsewhere():
    tree = ast.parse("import argparse\ndef register_cli(sub):\n    argparse.ArgumentParser()\n")
    assert cli_outside_cli({"opforge.bench.probe": tree}) == [
        "opforge.bench.probe:2 defines register_cli",
        "opforge.bench.probe:3 builds an ArgumentParser",
    ]


def test_no_submodule_imports_its_own_package_init():
    found = own_package_doors(IMPORTS)
    assert not found, "import these from the module that defines them:\n" + "\n".join(f"  {f}" for f in found)


def test_package_door_check_finds_one(monkeypatch):
    probe = "opforge.builder.probe_for_test"
    monkeypatch.setitem(MODULES, probe, PACKAGE / "builder" / "probe_for_test.py")
    tree = ast.parse("from opforge.builder import want_cuda, toolchain\n")
    imports = {probe: _walk_imports(probe, tree)}
    assert own_package_doors(imports) == [f"{probe}:1 imports want_cuda from opforge.builder"]


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages by name: a package missing there is missing from the wheel."""
    import re

    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(packages - listed)}"


# ----------------------------------------------------------- (e) the drawing

#: The engine: compile, link, cache, toolchain. Readers of users' folders live in ``opforge.folders``.
ENGINE = "opforge.builder"
ENGINE_MAX_MODULES = 20
#: ``opforge build``'s command module parses and prints; the folder package picks the route.
CLI_BUILD_MAX_LINES = 150


ALL_IMPORTS: dict[str, list[Import]] = {name: _walk_imports(name, tree, type_only=True) for name, tree in TREES.items()}


def room(module: str) -> str:
    """A module's room in the drawing: a top-level module is one, a package (with its sub-packages) is one."""
    parts = module.split(".")
    return ".".join(parts[:2])


def room_arrows(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {}
    for module, imps in imports.items():
        for i in imps:
            if room(i.target) != room(module):
                arrows.setdefault(room(module), set()).add(room(i.target))
    return arrows


def floors(arrows: dict[str, set[str]], rooms: set[str]) -> dict[str, int]:
    """Each room's floor: 1 for a room that imports no other, else one above the highest room it imports.
    Defined only without circles; an arrow then never runs back up."""
    floor: dict[str, int] = {}

    def of(r: str) -> int:
        if r not in floor:
            floor[r] = 1 + max((of(t) for t in arrows.get(r, ())), default=0)
        return floor[r]

    for r in sorted(rooms):
        of(r)
    return floor


def test_no_import_cycles_with_type_only_imports_counted():
    edges = {m: {i.target for i in imports if i.target != m} for m, imports in ALL_IMPORTS.items()}
    report = []
    for component in _cycles(edges):
        members = set(component)
        report.append("cycle: " + ", ".join(component))
        report += [
            f"  {_where(m, i.line)} imports {i.target}" for m in component for i in ALL_IMPORTS[m] if i.target in members and i.target != m
        ]
    assert not report, "\n".join(report)


def test_the_rooms_form_no_circle_so_no_arrow_runs_back_up():
    arrows = room_arrows(ALL_IMPORTS)
    circles = _cycles(arrows)
    assert not circles, f"rooms that import each other (the drawing has arrows running back up): {circles}"
    floor = floors(arrows, {room(m) for m in MODULES})
    up = [(a, b) for a, targets in arrows.items() for b in targets if floor[b] >= floor[a]]
    assert up == []


def test_the_drawing_finds_an_arrow_running_back_up():
    imports = {
        "opforge.opspec": [Import("opforge.registry", 1, False)],
        "opforge.registry": [Import("opforge.opspec", 1, False)],
        "opforge.check.run": [Import("opforge.registry", 1, False)],
    }
    arrows = room_arrows(imports)
    assert _cycles(arrows) == [["opforge.opspec", "opforge.registry"]]
    drawn = floors({"opforge.check": {"opforge.registry"}}, {"opforge.check", "opforge.registry"})
    assert drawn == {"opforge.registry": 1, "opforge.check": 2}


def test_the_description_imports_nothing_of_opforge():
    found = [f"{_where('opforge.opspec', i.line)} imports {i.target}" for i in ALL_IMPORTS["opforge.opspec"]]
    tree = TREES["opforge.opspec"]
    found += [
        f"{_where('opforge.opspec', n.lineno)} imports {n.module}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "opforge")
    ]
    assert not found, "opspec describes and imports nothing of opforge:\n" + "\n".join(sorted(set(found)))


def test_the_engine_is_at_most_20_modules_and_imports_no_reader_of_users_folders():
    engine = sorted(m for m in MODULES if m == ENGINE or m.startswith(ENGINE + "."))
    assert len(engine) <= ENGINE_MAX_MODULES, f"{len(engine)} modules in {ENGINE} (at most {ENGINE_MAX_MODULES}): {engine}"
    up = [
        f"{_where(m, i.line)} imports {i.target}"
        for m in engine
        for i in ALL_IMPORTS[m]
        if room(i.target) in ("opforge.folders", "opforge.cli", "opforge.check", "opforge.bench", "opforge.project")
    ]
    assert not up, "the engine imports what stands above it:\n" + "\n".join(up)


def test_opforge_build_command_parses_and_prints():
    lines = len(MODULES["opforge.cli.build"].read_text().splitlines())
    assert lines <= CLI_BUILD_MAX_LINES, f"cli/build.py is {lines} lines: its route logic belongs in opforge.folders"
    allowed = (".errors", ".archs")  # a build error to print, the architectures to name
    engine = [i.target for i in ALL_IMPORTS["opforge.cli.build"] if room(i.target) == ENGINE and not i.target.endswith(allowed)]
    assert not engine, f"cli/build.py drives the engine itself ({engine}): the folder package picks the route and calls the engine"


def test_type_only_imports_count_in_the_drawing():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from opforge.registry import wire\n")
    assert _walk_imports("opforge.opspec", tree) == []
    assert [i.target for i in _walk_imports("opforge.opspec", tree, type_only=True)] == ["opforge.registry"]
