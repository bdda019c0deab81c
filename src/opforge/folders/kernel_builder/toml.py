"""The build.toml of a Hugging Face kernel-builder project, read and checked
before anything compiles (opforge.folders.kernel_builder builds it).

``read_project`` takes what kernel-builder's ``build.toml`` says: ``[general]``
(``name``, ``version``, ``license``, ``backends``, ``python-depends``,
``[general.cuda]`` ``minver``/``maxver``), ``[torch]`` (``src``, ``include``,
``pyext``, ``minver``/``maxver``, ``stable-abi``) and each ``[kernel.<name>]``
(``backend``, ``src``, ``include``, ``depends``, ``cuda-capabilities``,
``cuda-flags``, ``cxx-flags``, ``cuda-minver``); keys it does not use
(``edition``, ``[general.hub]``) are passed over. A missing or malformed entry,
a file it names that is not there, or a missing ``torch-ext/<name>/`` package is
a KernelBuilderError that names the file, the key and the value.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opforge.builder.sources import DiscoveryError
from opforge.builder.stable import parse_target

BUILD_TOML = "build.toml"
#: The backends opforge builds; the others a build.toml may name are skipped, and said.
BUILT_BACKENDS = ("cpu", "cuda")
#: Every backend kernel-builder knows: any other name in a build.toml is a mistake.
KNOWN_BACKENDS = ("cpu", "cuda", "metal", "rocm", "xpu", "neuron", "tpu", "cann")
# kernels' rule for a kernel's name (kernels._rust.KernelName); "_" is taken for "-", as
# older build.toml files spell it, since both give one Python name.
_NAME = re.compile(r"[a-z][a-z0-9_-]*[a-z0-9]")


class KernelBuilderError(DiscoveryError):
    """A build.toml that cannot be built as written: the message names the file, the key and the value."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One ``[kernel.<name>]`` section."""

    name: str
    backend: str
    src: tuple[Path, ...]
    include: tuple[Path, ...] = ()
    depends: tuple[str, ...] = ()
    cuda_capabilities: tuple[str, ...] = ()
    cuda_flags: tuple[str, ...] = ()
    cxx_flags: tuple[str, ...] = ()
    cuda_minver: str = ""


@dataclasses.dataclass(frozen=True)
class Project:
    """A build.toml, read and checked against the files it names."""

    root: Path
    name: str  # [general] name, "gated-silu"
    version: int | None
    license: str
    backends: tuple[str, ...]
    python_depends: tuple[str, ...]
    torch_src: tuple[Path, ...]
    torch_include: tuple[Path, ...]
    pyext: tuple[str, ...]
    minver: str
    maxver: str
    stable_abi: dict[str, str]  # backend -> the torch it targets ("2.11")
    cuda_minver: str
    cuda_maxver: str
    kernels: tuple[Kernel, ...]

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def torch_ext(self) -> Path:
        return self.root / "torch-ext"

    @property
    def package(self) -> Path:
        return self.torch_ext / self.python_name

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        # lazy: optional dependency (tomllib from Python 3.11, tomli before)
        import tomllib  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError:  # Python 3.10
        try:
            # lazy: optional dependency (tomli, for Python 3.10)
            import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]
        except ModuleNotFoundError:
            raise KernelBuilderError(f"{path}: reading it needs the tomli package on Python 3.10 (`pip install tomli`)") from None
    try:
        return tomllib.loads(path.read_text(errors="replace"))
    except tomllib.TOMLDecodeError as exc:
        raise KernelBuilderError(f"{path} is not valid TOML: {exc}") from None


def read_project(root: Path) -> Project:
    """The build.toml at ``root``, checked: a KernelBuilderError names the key
    and shows the value for a missing or malformed entry, a file it names that
    is not there, or a Python package ``torch-ext/<name>/`` that is missing."""
    root = Path(root).resolve()
    toml = root / BUILD_TOML
    data = _load_toml(toml)
    where = f"{toml}"

    def table(value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise KernelBuilderError(f"{where}: [{key}] must be a table, got {value!r}")
        return value

    def strings(section: dict[str, Any], key: str, label: str) -> tuple[str, ...]:
        value = section.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise KernelBuilderError(f"{where}: {label} {key} must be a list of strings, got {value!r}")
        return tuple(value)

    def text(section: dict[str, Any], key: str, label: str) -> str:
        value = section.get(key, "")
        if not isinstance(value, str):
            # A version written bare is a number: 2.10 is 2.1.
            raise KernelBuilderError(f'{where}: {label} {key} must be a string (a version in quotes, "2.10"), got {value!r}')
        return value

    def files(names: Sequence[str], label: str) -> tuple[Path, ...]:
        found = []
        for name in names:
            path = (root / name).resolve()
            if not path.is_file():
                raise KernelBuilderError(f"{where}: {label} src names {name}, which is not there ({path})")
            found.append(path)
        return tuple(found)

    def folders(names: Sequence[str], label: str) -> tuple[Path, ...]:
        found = []
        for name in names:
            path = (root / name).resolve()
            if not path.is_dir():
                raise KernelBuilderError(f"{where}: {label} include names {name}, which is not a folder ({path})")
            found.append(path)
        return tuple(found)

    general = table(data.get("general"), "general") if "general" in data else None
    if general is None:
        raise KernelBuilderError(f'{where}: no [general] section: kernel-builder needs at least [general] name = "<kernel name>"')
    name = general.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KernelBuilderError(
            f"{where}: [general] name must be lowercase letters, digits and dashes, starting with a letter "
            f"(kernels' rule for a kernel's name), got {name!r}"
        )
    if general.get("universal"):
        raise KernelBuilderError(
            f"{where}: [general] universal = true: a universal kernel is pure Python, with nothing to compile; "
            "opforge builds kernels with C++ or CUDA sources"
        )
    version = general.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise KernelBuilderError(f"{where}: [general] version must be a whole number, got {version!r}")
    cuda_general = table(general.get("cuda", {}), "general.cuda")

    kernels = []
    for kname, section in table(data.get("kernel", {}), "kernel").items():
        label = f"[kernel.{kname}]"
        section = table(section, f"kernel.{kname}")
        backend = text(section, "backend", label) or "cuda"  # kernel-builder's first format had CUDA kernels alone
        if backend not in KNOWN_BACKENDS:
            raise KernelBuilderError(f"{where}: {label} backend must be one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
        src = strings(section, "src", label)
        if not src:
            raise KernelBuilderError(f'{where}: {label} names no src: list its source files, src = ["..."]')
        kernels.append(
            Kernel(
                name=kname,
                backend=backend,
                # Another backend's files are not this machine's to check: they are not built here.
                src=files(src, label) if backend in BUILT_BACKENDS else tuple(root / s for s in src),
                include=folders(strings(section, "include", label), label) if backend in BUILT_BACKENDS else (),
                depends=strings(section, "depends", label),
                cuda_capabilities=strings(section, "cuda-capabilities", label),
                cuda_flags=strings(section, "cuda-flags", label),
                cxx_flags=strings(section, "cxx-flags", label),
                cuda_minver=text(section, "cuda-minver", label),
            )
        )

    backends = strings(general, "backends", "[general]")
    for b in backends:
        if b not in KNOWN_BACKENDS:
            raise KernelBuilderError(f"{where}: [general] backends must name only {', '.join(KNOWN_BACKENDS)}, got {b!r}")
    if not backends:  # older files: the backends of their kernels
        backends = tuple(b for b in KNOWN_BACKENDS if any(k.backend == b for k in kernels))
    if not backends:
        raise KernelBuilderError(f"{where}: no backend to build: [general] backends is empty and no [kernel.<name>] names one")

    if "torch" not in data:
        raise KernelBuilderError(f"{where}: no [torch] section: the torch extension's sources go in [torch] src = [...]")
    torch_section = table(data["torch"], "torch")
    stable = torch_section.get("stable-abi", {})
    if isinstance(stable, str):
        stable_abi = {b: stable for b in BUILT_BACKENDS}
    elif isinstance(stable, dict) and all(isinstance(v, str) for v in stable.values()):
        stable_abi = {str(b): v for b, v in stable.items()}
    else:
        raise KernelBuilderError(
            f'{where}: [torch] stable-abi must be a torch version in quotes ("2.11") or a table of one per backend, got {stable!r}'
        )
    for b, target in stable_abi.items():
        try:
            parse_target(target)
        except ValueError as exc:
            raise KernelBuilderError(f"{where}: [torch] stable-abi for {b}: {str(exc).removeprefix('opforge: ')}") from None
    project = Project(
        root=root,
        name=name,
        version=version,
        license=text(general, "license", "[general]"),
        backends=backends,
        python_depends=strings(general, "python-depends", "[general]"),
        torch_src=files(strings(torch_section, "src", "[torch]"), "[torch]"),
        torch_include=folders(strings(torch_section, "include", "[torch]"), "[torch]"),
        pyext=strings(torch_section, "pyext", "[torch]") or ("py", "pyi"),
        minver=text(torch_section, "minver", "[torch]"),
        maxver=text(torch_section, "maxver", "[torch]"),
        stable_abi=stable_abi,
        cuda_minver=text(cuda_general, "minver", "[general.cuda]"),
        cuda_maxver=text(cuda_general, "maxver", "[general.cuda]"),
        kernels=tuple(kernels),
    )
    init = project.package / "__init__.py"
    if not init.is_file():
        raise KernelBuilderError(
            f"{where}: the kernel {name!r} keeps its Python package in torch-ext/{project.python_name}/, "
            f"but {project.rel(init)} is not there"
        )
    return project


__all__ = ["BUILD_TOML", "BUILT_BACKENDS", "KNOWN_BACKENDS", "Kernel", "KernelBuilderError", "Project", "read_project"]
