"""The check after a kernel-builder project's build: its package imported
from ``torch-ext/`` as its users import it, and each variant loaded by the
``kernels`` package's own loader, each in a new process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import torch

from opforge.builder.child import kill_group, popen

if TYPE_CHECKING:
    from opforge.folders.kernel_builder.build import Result


# Run as `python -c _CHECK SPEC` in new processes, one to import the torch-ext
# package as its users import it, one to load each variant through kernels' own
# loader (where kernels is installed): a build's namespace can be registered once
# a process, and the package and the variant of one backend share it. One JSON
# line of what was found.
_CHECK = """
import importlib, json, sys, traceback
from pathlib import Path
spec = json.loads(sys.argv[1])
import torch
def ops_of(ns):
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.split("::")[0] == ns)
found = {}
if spec["what"] == "import":
    sys.path.insert(0, spec["torch_ext"])
    try:
        importlib.import_module(spec["package"])
        found["ops"] = ops_of(spec["namespace"])
    except BaseException:
        found["error"] = traceback.format_exc()
else:
    try:
        import kernels
    except ImportError:
        kernels = None
    found["kernels"] = kernels and kernels.__version__
    for v in spec["variants"] if kernels else ():
        try:
            module = kernels.get_local_kernel(Path(spec["root"]), backend=v["backend"])
            folder = Path(module.__file__).resolve().parent
            variant = folder.name if (folder / "metadata.json").is_file() else folder.parent.name
            found[v["name"]] = {"loaded": variant, "ops": ops_of(v["namespace"])}
        except BaseException:
            found[v["name"]] = {"error": traceback.format_exc()}
print("OPFORGE_KB " + json.dumps(found))
"""


@dataclasses.dataclass(frozen=True)
class Check:
    ok: bool
    lines: tuple[str, ...]  # what works, one line each
    errors: tuple[str, ...]  # what does not, with the end of its traceback


def loadable_backends() -> set[str]:
    """The backends kernels' loader takes on this machine: cpu, and cuda where torch has CUDA."""
    return {"cpu", *(("cuda",) if torch.version.cuda is not None else ())}


def _tail(trace: str, most: int = 12) -> str:
    """A traceback's header and its last ``most`` lines, the import machinery's frames
    left out: what is left is the package's own code and its error."""
    machinery = ('  File "<frozen ', '  File "' + os.path.dirname(os.__file__) + "/importlib/")
    kept: list[str] = []
    skipping = False
    for line in trace.strip().splitlines():
        if line.startswith('  File "'):
            skipping = line.startswith(machinery)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    head = kept[:1] if kept and kept[0].startswith("Traceback") else []
    return "\n".join(head + kept[len(head) :][-most:])


def check(result: Result, *, timeout: float = 300.0) -> Check:
    """``import <name>`` from ``torch-ext`` in a new process, as its users will
    (the operators it registered listed), and, where ``kernels`` is installed,
    ``kernels.get_local_kernel(root, backend=...)`` in another for each built
    backend this torch can load: it must pick and load the variant written."""
    project = result.plan.project
    pkg = project.python_name
    loadable = [b.variant for b in result.built if b.variant.backend in loadable_backends()]
    base = {"root": str(project.root), "torch_ext": str(project.torch_ext), "package": pkg}
    specs = {
        "import": {**base, "what": "import", "namespace": result.in_torch_ext.ops_name},
        "kernels": {
            **base,
            "what": "kernels",
            "variants": [{"name": v.name, "backend": v.backend, "namespace": v.ops_name} for v in loadable],
        },
    }
    # HF_HUB_OFFLINE: the loader resolves the local folder and fetches nothing.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = {
        what: popen(
            [sys.executable, "-c", _CHECK, json.dumps(spec)],
            cwd=project.root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for what, spec in specs.items()
    }  # fmt: skip
    found: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for what, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            errors.append(f"{pkg}: the check ({what}) did not finish within {timeout:.0f} s")
            continue
        line = next((ln for ln in stdout.splitlines() if ln.startswith("OPFORGE_KB ")), None)
        if line is None:
            errors.append(f"{pkg}: the check ({what}) crashed (exit {proc.returncode}):\n{_tail(stderr)}")
            continue
        found[what] = json.loads(line.removeprefix("OPFORGE_KB "))
    lines = []
    imported = found.get("import", {})
    if "error" in imported:
        errors.append(f"{pkg}: `import {pkg}` fails from {project.rel(project.torch_ext)}/:\n{_tail(imported['error'])}")
    elif "ops" in imported:
        ops = ", ".join(imported["ops"]) or f"no operator registered in {result.in_torch_ext.ops_name}"
        lines.append(f"{pkg}: `import {pkg}` works (from {project.rel(project.torch_ext)}/, no install step): {ops}")
    loaded = found.get("kernels", {})
    version = loaded.get("kernels")
    if "kernels" in found and version is None:
        lines.append(f"{pkg}: kernels is not installed here: `pip install kernels` to load build/<variant>/ with kernels.get_local_kernel")
    for b in result.built:
        v = b.variant
        if v not in loadable:
            takes = ", ".join(sorted(loadable_backends()))
            lines.append(f"{pkg}: build/{v.name}/ is for another torch: this one's kernels loader takes {takes}")
            continue
        got = loaded.get(v.name)
        if version is None or got is None:
            continue
        call = f"kernels.get_local_kernel({project.root}, backend={v.backend!r})"
        if "error" in got:
            errors.append(f"{pkg}: {call} fails:\n{_tail(got['error'])}")
        elif got["loaded"] != v.name:
            errors.append(f"{pkg}: {call} loaded build/{got['loaded']}/, not build/{v.name}/: it prefers that one; remove it")
        else:
            ops = ", ".join(got["ops"]) or f"no operator registered in {v.ops_name}"
            lines.append(f"{pkg}: kernels {version}: get_local_kernel(backend={v.backend!r}) loads build/{v.name}/: {ops}")
    return Check(not errors, tuple(lines), tuple(errors))


__all__ = ["Check", "check", "loadable_backends"]
