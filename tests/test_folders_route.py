"""The route of `opforge build PATH`, picked by opforge.folders.route without the command
line: a package of `opforge new`'s, a plan that builds nothing, what is said through the
caller's say/warn, a route the folder cannot take; and the engine (opforge.builder), which
never imports the folders package that reads users' layouts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import opforge.builder
from opforge.folders.route import RouteError, Target, build_folder, project_route
from opforge.project import ProjectError

from .conftest import write

OPS = '#include <torch/library.h>\nTORCH_LIBRARY(mine, m) { m.def("twice(Tensor x) -> Tensor"); }\n'


def project(root: Path) -> Path:
    """A package of opforge new's layout: its pyproject's [tool.opforge] names its sources and package."""
    return write(
        root,
        {
            "pyproject.toml": '[tool.opforge]\nsources = "csrc/mine"\npackage = "mine"\nnamespace = "mine"\n',
            "csrc/mine/mine.cpp": OPS,
            "mine/__init__.py": "",
        },
    )


def test_a_package_of_opforge_new_builds_by_its_import_or_its_sources_by_the_route_asked(tmp_path):
    root = project(tmp_path / "proj")
    assert project_route(root) == Target(root, "jit", project=True)
    assert project_route(root, "jit") == Target(root, "jit", project=True)
    assert project_route(root, "cmake") == Target(root / "csrc/mine", "cmake")
    # A plan or CMake definitions are of its sources folder: its import builds neither.
    assert project_route(root, dry_run=True) == Target(root / "csrc/mine", "jit")
    assert project_route(root, "cmake", defines=["X=1"]) == Target(root / "csrc/mine", "cmake")


def test_a_folder_that_is_no_package_is_built_as_it_is(tmp_path):
    folder = write(tmp_path / "ops", {"ops.cpp": OPS})
    assert project_route(folder, "inline") == Target(folder, "inline")


def test_a_malformed_package_table_is_refused_naming_the_file(tmp_path):
    write(tmp_path, {"pyproject.toml": '[tool.opforge]\nsources = "csrc"\n'})
    with pytest.raises(ProjectError, match=r"pyproject.toml: \[tool.opforge\] lacks package, namespace"):
        project_route(tmp_path)


def test_a_plan_is_said_through_say_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = write(tmp_path / "ops", {"ops.cpp": OPS})
    said: list[str] = []
    warned: list[str] = []
    assert build_folder(folder, dry_run=True, say=said.append, warn=warned.append) == 0
    assert said[0] == f"opforge build: {folder}"
    assert any(line.startswith("  binding: TORCH_LIBRARY mine") for line in said), said
    assert warned == []
    assert list((tmp_path / "cache").rglob("*.so")) == []  # the plan names the cache entry; nothing compiled


@pytest.mark.parametrize(
    ("route", "defines", "says"),
    [
        ("setup.py", (), "--route setup.py, but there is no setup.py in"),
        ("package", (), "--route package, but no package here imports a compiled _C"),
        ("auto", ("X=1",), "-D X=1 is a CMake cache definition, but this build takes the jit route"),
    ],
)
def test_a_route_the_folder_cannot_take_is_a_route_error_naming_it(tmp_path, route, defines, says):
    folder = write(tmp_path / "ops", {"ops.cpp": OPS})
    with pytest.raises(RouteError, match="opforge build: ") as caught:
        build_folder(folder, route, defines=defines, say=print, warn=print)
    assert str(folder) in str(caught.value) and says in str(caught.value)


def test_a_path_with_nothing_to_build_is_a_route_error(tmp_path):
    with pytest.raises(RouteError, match=r"nothing to build"):
        build_folder(tmp_path, say=print, warn=print)


def engine_imports_of_folders(package: Path) -> list[str]:
    """Every import of opforge.folders or opforge.cli in ``package``'s modules, those in
    functions and under ``if TYPE_CHECKING:`` included."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.startswith(("opforge.folders", "opforge.cli"))]
    return found


def test_the_engine_never_imports_the_folders_package():
    assert engine_imports_of_folders(Path(opforge.builder.__file__).parent) == []


def test_the_engine_import_scan_finds_a_type_only_and_a_local_import(tmp_path):
    (tmp_path / "probe.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from opforge.folders.discover import Layout\n"
        "def f():\n    import opforge.cli.build\n"
    )
    assert engine_imports_of_folders(tmp_path) == [
        "probe.py:3 imports opforge.folders.discover",
        "probe.py:5 imports opforge.cli.build",
    ]
