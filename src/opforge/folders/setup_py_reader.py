"""The script that reads a user's ``setup.py`` (``opforge.folders.setup_py.read``
runs it in a subprocess), and what its record of a failure says.

The script runs the setup.py with ``setuptools.setup`` replaced by a function
that records its arguments and stops, and torch's ``CppExtension`` and
``CUDAExtension`` replaced by ones that record what the author passed. It writes
a JSON record: the extensions, the package folders and where ``build_ext
--inplace`` puts each library (asked of setuptools itself: setup.cfg and
pyproject.toml applied, the setup.py's own ``build_ext`` naming the file); or,
where the setup.py failed by itself before ``setup()``, its line and the
exception's last line, which ``own_failure`` says in one line.
"""

from __future__ import annotations

from pathlib import Path

# Run in the setup.py's folder as `python -c READER SETUP_PY OUT_JSON`.
READER = r'''
import json, os, runpy, sys, traceback

setup_py, out = sys.argv[1], sys.argv[2]
import setuptools


class _Read(BaseException):
    """Raised by the replaced setup(): what follows it in setup.py would act on a build."""


def _declared(kind):
    def make(name, sources, *args, **kwargs):
        dlink = {k: kwargs.pop(k) for k in ("dlink", "dlink_libraries") if k in kwargs}
        ext = setuptools.Extension(name, list(sources), *args, **kwargs)
        ext._opforge_kind, ext._opforge_dlink = kind, bool(dlink.get("dlink"))
        return ext
    return make


class _Declared:
    """Replaces torch's two helpers once torch.utils.cpp_extension loads: a
    setup.py that does not import torch does not wait for it."""

    def find_spec(self, name, path, target=None):
        if name != "torch.utils.cpp_extension":
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_replace(module):
            exec_module(module)
            module.CppExtension = _declared("CppExtension")
            module.CUDAExtension = _declared("CUDAExtension")

        spec.loader.exec_module = exec_and_replace
        return spec


sys.meta_path.insert(0, _Declared())
seen = {}


def setup(*args, **kwargs):
    seen["kwargs"] = kwargs
    # As the setup.py left it: some set the archs they build for themselves.
    seen["arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    raise _Read


setuptools.setup = setup
try:
    import distutils.core
    distutils.core.setup = setup
except ImportError:
    pass

def _flags(value):
    if isinstance(value, dict):
        return {str(k): [str(f) for f in v] for k, v in value.items()}
    return {"cxx": [str(f) for f in value or []]}


def _failed(exc):
    """The setup.py's own failure, with its innermost line in the setup.py: said by
    opforge as the project's, not as a build error (the traceback goes to stderr too)."""
    here = os.path.realpath(setup_py)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == here]
    if isinstance(exc, SystemExit):
        error = f"it exits with status {exc.code}" if isinstance(exc.code, int) else f"it exits with: {exc.code}"
    else:
        error = traceback.format_exception_only(type(exc), exc)[-1].strip()
    where = frames[-1] if frames else None
    record = {"failed": True, "error": error, "exit": isinstance(exc, SystemExit) and isinstance(exc.code, int),
              "line": where.lineno if where else None, "code": (where.line or "").strip() if where else ""}
    json.dump(record, open(out, "w"))
    traceback.print_exception(exc)
    sys.exit(1)


def _inplace(kwargs, extensions):
    """Where `build_ext --inplace` puts each extension and the package folders it
    reads, found as setuptools finds them: setup()'s arguments with setup.cfg and
    pyproject.toml applied (package_dir, [tool.setuptools.package-dir]), and the
    setup.py's own build_ext (torch's BuildExtension: no_python_abi_suffix)."""
    from setuptools.dist import Distribution

    names = ("name", "ext_modules", "cmdclass", "package_dir", "packages", "py_modules", "options")
    dist = (kwargs.get("distclass") or Distribution)({k: kwargs[k] for k in names if k in kwargs})
    dist.parse_config_files(ignore_option_errors=True)
    build_ext = dist.get_command_obj("build_ext")
    build_ext.inplace = 1
    build_ext.ensure_finalized()
    build_py = build_ext.get_finalized_command("build_py")
    targets = {}
    for ext in extensions:
        # As setuptools' build_ext copies a library into the source tree.
        fullname = build_ext.get_ext_fullname(ext.name)
        filename = build_ext.get_ext_filename(fullname)
        folder = build_py.get_package_dir(fullname.rpartition(".")[0])
        targets[ext.name] = os.path.abspath(os.path.join(folder, os.path.basename(filename)))
    return targets, {str(k): str(v) for k, v in (dist.package_dir or {}).items()}


sys.argv = [setup_py, "build_ext", "--inplace"]
sys.path.insert(0, os.path.dirname(setup_py))
try:
    runpy.run_path(setup_py, run_name="__main__")
except _Read:
    pass
except SystemExit as exc:
    if exc.code not in (None, 0):
        _failed(exc)
except Exception as exc:
    _failed(exc)
if "kwargs" not in seen:
    json.dump({"setup_called": False}, open(out, "w"))
    sys.exit(0)
kwargs = seen["kwargs"]
found = []
for ext in kwargs.get("ext_modules") or []:
    found.append({
        "name": ext.name,
        "kind": getattr(ext, "_opforge_kind", "Extension"),
        "dlink": getattr(ext, "_opforge_dlink", False),
        "sources": [str(s) for s in ext.sources],
        "include_dirs": [str(d) for d in ext.include_dirs or []],
        "define_macros": [[str(n), None if v is None else str(v)] for n, v in ext.define_macros or []],
        "undef_macros": [str(m) for m in ext.undef_macros or []],
        "extra_compile_args": _flags(ext.extra_compile_args),
        "extra_link_args": [str(f) for f in ext.extra_link_args or []],
        "libraries": [str(lib) for lib in ext.libraries or []],
        "library_dirs": [str(d) for d in ext.library_dirs or []],
        "runtime_library_dirs": [str(d) for d in ext.runtime_library_dirs or []],
        "extra_objects": [str(o) for o in ext.extra_objects or []],
        "py_limited_api": bool(getattr(ext, "py_limited_api", False)),
    })
package_dir = {str(k): str(v) for k, v in (kwargs.get("package_dir") or {}).items()}
targets, where = {}, ""
try:
    targets, package_dir = _inplace(kwargs, kwargs.get("ext_modules") or [])
except Exception as exc:  # opforge then follows setup()'s package_dir itself, and says so
    where = traceback.format_exception_only(type(exc), exc)[-1].strip()
for ext in found:
    ext["inplace"] = targets.get(ext["name"])
json.dump({"setup_called": True, "extensions": found, "package_dir": package_dir, "arch_list": seen["arch_list"],
           "inplace_error": where}, open(out, "w"))
'''


def own_failure(setup_py: Path, failure: dict, stderr: str) -> str:
    """One line for a setup.py that failed by itself while read: its line, what
    failed there (the exception's last line), and whose failure it is."""
    where = f"{setup_py}:{failure['line']}" if failure.get("line") else str(setup_py)
    code = f" at `{failure['code']}`" if failure.get("code") else ""
    error = failure["error"].rstrip(".")
    if failure.get("exit"):  # sys.exit(N): what it printed before is its reason
        said = [ln.strip() for ln in stderr.split("Traceback (most recent call last):")[0].splitlines() if ln.strip()]
        error += f" after printing: {said[-1]}" if said else ""
    hint = ""
    if error.startswith("ModuleNotFoundError"):
        hint = "; it imports a module this Python does not have: install it here and build again"
    elif "CalledProcessError" in error and "'git'" in error:
        hint = "; it runs git, which fails outside a git checkout (a source distribution, a copy): build from its checkout"
    return (
        f"{where}: the project's setup.py fails by itself{code}: {error} (not a build error: opforge only runs it, "
        f"with setuptools.setup replaced, to read its extensions; nothing was compiled){hint}"
    )


__all__ = ["READER", "own_failure"]
