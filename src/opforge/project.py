"""``opforge new``: a user's operator package, scaffolded from templates, and
loaded back so that ``opforge build|check|bench DIR`` work on it.

A scaffolded package is a directory whose ``pyproject.toml`` has a
``[tool.opforge]`` table (the marker)::

    [tool.opforge]
    sources = "csrc/my_op"      # one TORCH_LIBRARY library, built by opforge.builder.folder_config
    package = "my_op"           # importing it loads that library and registers the specs in my_op.ops
    package-dir = "src"         # where the package is, relative to the directory
    namespace = "my_op"         # the torch.ops namespace of its operators

The templates are files under ``opforge/templates/new``, rendered with jinja2.

``opforge check|bench FILE.py`` load a spec file instead: a few lines whose
``SPECS`` list ``opforge.spec(...)`` of operators the user already has in
``torch.ops`` (``load_spec_file``).
"""

from __future__ import annotations

import importlib
import importlib.util
import keyword
import os
import re
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import opforge
from opforge import __version__
from opforge.builder.errors import BuildError
from opforge.builder.jit import Library
from opforge.opspec import OpSpec
from opforge.registry import all_specs, register, replace_registered

TEMPLATES = Path(__file__).resolve().parent / "templates" / "new"

# (template under TEMPLATES, output path with {name} for the operator's name, CUDA kernel only)
_FILES: tuple[tuple[str, str, bool], ...] = (
    ("pyproject.toml.j2", "pyproject.toml", False),
    ("setup.py.j2", "setup.py", False),
    ("README.md.j2", "README.md", False),
    ("gitignore.j2", ".gitignore", False),
    ("csrc/op.cpp.j2", "csrc/{name}/{name}.cpp", False),
    ("csrc/op_kernel.h.j2", "csrc/{name}/{name}_kernel.h", True),
    ("csrc/op_kernel.cu.j2", "csrc/{name}/{name}_kernel.cu", True),
    ("package/__init__.py.j2", "src/{name}/__init__.py", False),
    ("package/ops/__init__.py.j2", "src/{name}/ops/__init__.py", False),
    ("package/ops/op.py.j2", "src/{name}/ops/{name}.py", False),
    ("tests/test_op.py.j2", "tests/test_{name}.py", False),
)
# opforge new --stable-abi: the C++ wrapper on PyTorch's stable ABI in place of the ATen one,
# and a minimal Python module init; the CUDA kernel (no torch header) is the same.
_STABLE_TEMPLATES = {"csrc/op.cpp.j2": "csrc/op_stable.cpp.j2"}
_STABLE_FILES: tuple[tuple[str, str, bool], ...] = (("csrc/op_module.cpp.j2", "csrc/{name}/{name}_module.cpp", False),)
#: The first torch whose stable ABI is versioned (TORCH_TARGET_VERSION, a shim that only grows).
STABLE_TORCH_MIN = (2, 10)

# Names the generated C++ and Python would clash with: torch.ops namespaces that
# exist without being loaded yet, and the C++ namespaces of torch and CUDA.
_RESERVED = frozenset({"opforge", "aten", "prim", "prims", "torch", "at", "c10", "caffe2", "std", "cuda", "cub", "thrust", "higher_order"})

_CPP_KEYWORDS = frozenset(
    (  # noqa: SIM905 - a list as words reads better than 97 strings
        "alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class compl "
        "concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype default delete "
        "do double dynamic_cast else enum explicit export extern false float for friend goto if inline int long mutable "
        "namespace new noexcept not not_eq nullptr operator or or_eq private protected public register reinterpret_cast "
        "requires return short signed sizeof static static_assert static_cast struct switch template this thread_local "
        "throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq"
    ).split()
)

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# File names (NAME_kernel.cu, NAME/ops.py) and C++ symbols are made from the
# name: 64 characters keeps every one far inside a file system's 255-byte limit.
MAX_NAME = 64


class ProjectError(ValueError):
    """A bad name or directory for ``opforge new``, or a directory that is not a scaffolded package."""


@dataclass(frozen=True)
class Project:
    """A scaffolded package, as its ``[tool.opforge]`` table describes it."""

    root: Path
    package: str
    namespace: str
    sources: Path
    package_dir: Path


# --- opforge new ---


def torch_namespaces() -> set[str]:
    """The torch.ops namespaces this process knows: every operator's, and torch.ops' own attributes."""
    names = {n.split("::", 1)[0] for n in torch._C._dispatch_get_all_op_names()}
    # dir() of the torch.ops module lists its loaded namespaces; its type's, its methods (load_library, ...).
    return names | {n for n in (*dir(torch.ops), *dir(type(torch.ops))) if not n.startswith("__")}


def check_identifier(value: str, what: str) -> None:
    """Raises ProjectError unless ``value`` can name a C++ function, a Python package and a torch.ops namespace."""
    if len(value) > MAX_NAME:
        raise ProjectError(
            f"{what} {value[:20]!r}... is {len(value)} characters long; at most {MAX_NAME}, since file names are made from it"
        )
    if not _IDENTIFIER.fullmatch(value):
        raise ProjectError(
            f"{what} {value!r} is not a valid identifier: it must start with a letter and contain only letters, digits and "
            "underscores (like my_op), as a C++ function, a Python package and a torch.ops namespace need"
        )
    if "__" in value:
        raise ProjectError(f"{what} {value!r} contains a double underscore, which C++ reserves for the implementation")
    if keyword.iskeyword(value):
        raise ProjectError(f"{what} {value!r} is a Python keyword; pick another name")
    if value in _CPP_KEYWORDS:
        raise ProjectError(f"{what} {value!r} is a C++ keyword; pick another name")


def _check_namespace_free(value: str, what: str) -> None:
    if value in _RESERVED or value in torch_namespaces():
        raise ProjectError(
            f"{what} {value!r} collides with an existing torch.ops namespace or attribute (torch.ops.{value}) "
            f"or a C++ namespace of torch; pick another {what.lower()}"
        )


def _check_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise ProjectError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()):
        raise ProjectError(f"{directory} is not empty; give a new or empty directory (--dir)")


def parse_torch_min(value: str) -> tuple[int, int]:
    """``--torch-min`` as (major, minor): at least 2.10 (the first versioned stable ABI), at
    most the installed torch (whose headers must know the version to target it)."""
    m = re.fullmatch(r"(\d+)\.(\d+)", value.strip())
    if m is None:
        raise ProjectError(f"--torch-min {value!r} is not a torch version such as 2.10 (major.minor)")
    wanted = (int(m.group(1)), int(m.group(2)))
    if wanted < STABLE_TORCH_MIN:
        raise ProjectError(f"--torch-min {value}: the stable ABI is versioned from torch 2.10 on; give 2.10 or later")
    here = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if here is not None and wanted > (int(here.group(1)), int(here.group(2))):
        raise ProjectError(
            f"--torch-min {value} is newer than this torch ({torch.__version__}): its headers cannot target it; "
            "scaffold with that torch installed, or give an older version"
        )
    return wanted


def scaffold(
    name: str,
    directory: str | Path | None = None,
    namespace: str | None = None,
    cuda: bool = True,
    backward: bool = False,
    stable_abi: bool = False,
    torch_min: str = "2.10",
) -> Path:
    """Writes an operator package for ``name`` into ``directory`` (default ``./name``)
    and returns it. The operator is ``torch.ops.<namespace>.<name>`` (namespace
    default: ``name``); the Python package is ``name``. ``stable_abi``: the C++ on
    PyTorch's stable ABI, so that one build loads in every torch from ``torch_min`` on."""
    # lazy: import time (jinja2, 13 ms, only for opforge new)
    import jinja2

    namespace = name if namespace is None else namespace
    target = parse_torch_min(torch_min) if stable_abi else STABLE_TORCH_MIN
    check_identifier(name, "NAME")
    if namespace != name:
        check_identifier(namespace, "namespace")
    _check_namespace_free(name, "NAME")
    if namespace != name:
        _check_namespace_free(namespace, "namespace")
    found = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
    if found is not None and found.origin is not None:  # a namespace package (an empty directory on sys.path) is no clash
        raise ProjectError(
            f"NAME {name!r} is already an importable Python module ({found.origin}); pick a name the package cannot clash with"
        )
    root = Path(directory if directory is not None else name)
    _check_directory(root)

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    context = {"name": name, "namespace": namespace, "cuda": cuda, "backward": backward, "opforge_version": __version__}
    if stable_abi:
        context |= {"stable_abi": True, "torch_min": f"{target[0]}.{target[1]}", "torch_major": target[0], "torch_minor": target[1]}
    else:
        context["stable_abi"] = False
    # Render everything before writing anything: a template error leaves no half-written package.
    chosen = (*_FILES, *_STABLE_FILES) if stable_abi else _FILES
    files = [
        (_STABLE_TEMPLATES.get(template, template) if stable_abi else template, out.format(name=name))
        for template, out, cuda_only in chosen
        if cuda or not cuda_only
    ]
    rendered = {out: env.get_template(template).render(context) for template, out in files}
    existed = root.exists()
    try:
        for rel, text in rendered.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except OSError as exc:
        # A full disk, a read-only folder, a path too long: no half-written package stays behind.
        if existed:
            for child in root.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        else:
            shutil.rmtree(root, ignore_errors=True)
        raise ProjectError(f"could not write the package into {root}: {exc.strerror or exc} ({exc.filename or root})") from None
    return root


# --- reading a scaffolded package back ---


def _read_toml(path: Path) -> dict:
    try:
        # lazy: optional dependency (tomllib from Python 3.11, tomli before)
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            # lazy: optional dependency (tomli, for Python 3.10)
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ProjectError(f"reading {path} needs Python 3.11 or the tomli package (pip install tomli)") from None
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProjectError(f"{path}: not valid TOML: {exc}") from None


def find_project(path: str | Path) -> Project | None:
    """The package at ``path`` when its pyproject.toml has the ``[tool.opforge]`` marker, else None."""
    root = Path(path).resolve()
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return None
    table = _read_toml(pyproject).get("tool", {}).get("opforge")
    if table is None:
        return None
    missing = [k for k in ("sources", "package", "namespace") if not isinstance(table.get(k), str)]
    if missing:
        raise ProjectError(f"{pyproject}: [tool.opforge] lacks {', '.join(missing)} (strings)")
    project = Project(
        root=root,
        package=table["package"],
        namespace=table["namespace"],
        sources=root / table["sources"],
        package_dir=root / str(table.get("package-dir", ".")),
    )
    if not project.sources.is_dir():
        raise ProjectError(f"{pyproject}: [tool.opforge] sources = {table['sources']!r}, but {project.sources} is not a directory")
    if not (project.package_dir / project.package / "__init__.py").is_file():
        where = project.package_dir / project.package
        raise ProjectError(f"{pyproject}: [tool.opforge] package = {project.package!r}, but {where} has no __init__.py")
    return project


def _import(project: Project):  # noqa: ANN202 - a module
    """Imports the project's package from its directory (not an installed copy):
    its ``__init__`` builds and loads the op library and registers the specs."""
    here = (project.package_dir / project.package).resolve()
    module = sys.modules.get(project.package)
    if module is not None:
        where = Path(module.__file__ or "").resolve().parent
        if where != here:
            raise ProjectError(f"{project.package} is already imported from {where}, not from {here}; load {project.root} in a new process")
        return module
    sys.path.insert(0, str(project.package_dir.resolve()))
    return importlib.import_module(project.package)


def names_a_path(argument: str) -> bool:
    """Whether a command-line argument names a package directory rather than
    an operator: a path (``./add``, ``add/``, ``/abs/add``, ``.``, ``..``) or a
    ``.py`` file. A bare name is always an operator's, even where a folder of
    that name is in the current directory."""
    return "/" in argument or os.sep in argument or argument in (".", "..") or argument.endswith(".py")


def not_a_project(path: str | Path) -> str:
    return f"{path} is not an opforge package: no [tool.opforge] table in {Path(path) / 'pyproject.toml'} (opforge new makes one)"


class TargetNotFound(ProjectError):
    """A command's operand names no spec file or opforge package (a usage error)."""


class NotASpecFile(TargetNotFound):
    """A Python file given as a spec file that lists no SPECS (a usage error)."""


def resolve_target(target: str) -> tuple[Path | None, list[OpSpec]]:
    """One operand of ``opforge check/bench/profile``, the same for every command:
    an operator's name gives (None, []); a spec file (``FILE.py``) is run and a
    package directory (``opforge new``'s) is loaded, giving its path and specs.
    A name that misses raises TargetNotFound; a failed load, ProjectError or BuildError."""
    if not names_a_path(target):  # an operator's name, even where a folder of that name is here
        return None, []
    path = Path(target)
    if target.endswith(".py"):
        if not path.is_file():
            raise TargetNotFound(f"{target}: {'not a file' if path.exists() else 'no such file'}")
        return path.resolve(), load_spec_file(path)
    if not path.is_dir():
        raise TargetNotFound(f"{target}: {'not a directory' if path.exists() else 'no such directory'}")
    if find_project(path) is None:
        raise TargetNotFound(not_a_project(target))
    return path.resolve(), load_project(path)


def load_project(path: str | Path) -> list[OpSpec]:
    """Builds (JIT, or the prebuilt library ``pip install`` left in the package when
    it fits), loads a scaffolded package's operators and registers their specs;
    returns them. Build failures raise ``opforge.builder.BuildError``."""
    project = find_project(path)
    if project is None:
        raise ProjectError(not_a_project(path))
    _import(project)
    specs = [s for s in all_specs() if s.namespace == project.namespace]
    if not specs:
        raise ProjectError(
            f"{project.root}: importing {project.package} registered no operator spec in namespace {project.namespace!r} "
            f"(each module of {project.package}.ops lists its OpSpecs in SPECS)"
        )
    return specs


# What names an operator of opforge's own library in a spec file.
_OWN_OPERATORS = re.compile(r"torch\.ops\.opforge\.|[\"']opforge::")


# Spec files loaded in this process, by resolved path: loading one again returns its specs.
_SPEC_FILES: dict[Path, list[OpSpec]] = {}


def load_spec_file(path: str | Path) -> list[OpSpec]:
    """Runs a user's spec file (``FILE.py`` whose ``SPECS`` lists OpSpecs, as
    ``opforge.spec(torch.ops.my_ns.my_op.default, reference=...)`` makes them)
    with its own folder first on sys.path, so that it imports the package beside
    it; registers the specs and returns them. Build failures of what it imports
    raise ``opforge.builder.BuildError``; anything else wrong, ProjectError with
    the file's line."""
    file = Path(path).resolve()
    if file in _SPEC_FILES:
        return _SPEC_FILES[file]
    if not file.is_file():
        raise ProjectError(f"{path}: {'not a file' if file.exists() else 'no such file'}")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # A name of its own: the file's stem could be a module that exists (specs, ops, torch).
    name = f"_opforge_spec_file_{len(_SPEC_FILES)}_{re.sub(r'[^0-9A-Za-z_]', '_', file.stem)}"
    found = importlib.util.spec_from_file_location(name, file)
    if found is None or found.loader is None:
        raise ProjectError(f"{path}: not a Python file Python can load")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    if _OWN_OPERATORS.search(file.read_text(errors="replace")):
        # A spec over opforge's own operators: they are in torch.ops once its op library is loaded
        # (the opforge command defers that load to the commands that need it).
        opforge.load()
    try:
        found.loader.exec_module(module)
    except BuildError:
        raise
    except SystemExit as exc:  # sys.exit() in the file would end opforge with the file's own exit code
        del sys.modules[name]
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == file]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ProjectError(f"{where}: the spec file called sys.exit({exc.code!r}) while it was loaded; a spec file lists SPECS") from None
    except Exception as exc:  # the user's code: say where in the file, whatever it raised
        del sys.modules[name]
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == file]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ProjectError(f"{where}: {type(exc).__name__}: {exc}") from exc
    specs = getattr(module, "SPECS", None)
    example = "SPECS = [opforge.spec(torch.ops.my_ns.my_op.default, reference=lambda x: ...)]"
    if specs is None:
        raise NotASpecFile(f"{path} defines no SPECS: list the operators to check or time in it, as {example}")
    if isinstance(specs, (list, tuple)) and not specs:
        raise NotASpecFile(f"{path}: SPECS is empty: list the operators to check or time in it, as {example}")
    if not isinstance(specs, (list, tuple)):
        raise ProjectError(f"{path}: SPECS must be a non-empty list of OpSpecs, as {example}; got {specs!r:.80}")
    for i, s in enumerate(specs):
        if not isinstance(s, OpSpec):
            raise ProjectError(f"{path}: SPECS[{i}] is a {type(s).__name__} ({s!r:.60}), not an OpSpec (opforge.spec(...) makes one)")
    registered = []
    for s in specs:
        try:
            own = {o.qualname for o in all_specs() if o.namespace == "opforge"}
            registered.append(replace_registered(s) if s.qualname in own else register(s))
        except (ValueError, RuntimeError) as exc:
            raise ProjectError(f"{path}: {s.qualname}: {exc}") from None
    _SPEC_FILES[file] = registered
    return registered


def project_library(path: str | Path) -> Library | None:
    """The op library of a loaded project (its package's ``library``), or None."""
    project = find_project(path)
    module = sys.modules.get(project.package) if project else None
    lib = getattr(module, "library", None)
    return lib if isinstance(lib, Library) else None


__all__ = [
    "STABLE_TORCH_MIN",
    "TEMPLATES",
    "Project",
    "ProjectError",
    "TargetNotFound",
    "check_identifier",
    "find_project",
    "load_project",
    "load_spec_file",
    "names_a_path",
    "not_a_project",
    "parse_torch_min",
    "project_library",
    "resolve_target",
    "scaffold",
    "torch_namespaces",
]
