"""A spec file runs a user's code as it loads: ``opforge.spec`` calls each
operator once, and the file's own code may call it too. ``opforge check FILE``
loads it in a process of its own first: a kernel that kills that process or
never returns is a verdict naming the operator and the cause, within the time
limit, and the command lives on to say it."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from .conftest import opforge_process

# The operator's kernel, by what it does to its process on its first call.
KERNELS = {
    "segfault": "ctypes.string_at(0)",
    "sigsegv": "os.kill(os.getpid(), signal.SIGSEGV)",
    "abort": "os.abort()",
    "hang": "while True:\n        time.sleep(0.1)",
}
SAYS = {
    "segfault": "killed the process with SIGSEGV (Segmentation fault)",
    "sigsegv": "killed the process with SIGSEGV (Segmentation fault)",
    "abort": "killed the process with SIGABRT (Aborted)",
    "hang": "was still running after 4 s (--time-limit): killed",
}


def _spec_file(folder: Path, kind: str, *, at_import: bool = False) -> Path:
    """A spec file of one operator (namespace hostile_load_KIND) whose CPU kernel does ``KERNELS[kind]``;
    ``at_import``: the file's own code calls it too, before opforge.spec does."""
    ns = f"hostile_load_{kind}"
    file = folder / f"{kind}_spec.py"
    body = textwrap.indent(KERNELS[kind], "    ")
    file.write_text(
        "import ctypes, os, signal, time\n"
        "import torch\n"
        "import opforge\n\n"
        f'torch.library.define("{ns}::op", "(Tensor x) -> Tensor")\n\n\n'
        f'@torch.library.impl("{ns}::op", "CPU")\n'
        "def _kernel(x):\n"
        f"{body}\n"
        "    return x.clone()\n\n\n"
        + (f"torch.ops.{ns}.op(torch.ones(2))\n" if at_import else "")
        + f"SPECS = [opforge.spec(torch.ops.{ns}.op.default, reference=lambda x: x.clone())]\n"
    )
    return file


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_a_kernel_that_crashes_or_hangs_as_its_spec_file_loads_is_a_verdict(tmp_path, kind):
    file = _spec_file(tmp_path, kind)
    started = time.monotonic()
    res = opforge_process("check", str(file), "--time-limit", "4", autoload=False, timeout=240)
    took = time.monotonic() - started
    text = res.stdout + res.stderr
    assert res.returncode == 1, f"rc {res.returncode}: {text[-3000:]}"
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(f"x load {file}")), None)
    assert line is not None, text[-3000:]
    assert f"hostile_load_{kind}::op: its first call (opforge.spec calls the operator once" in line, line
    assert SAYS[kind] in line, line
    assert "0 passed, 1 failed" in res.stdout, res.stdout
    assert "Traceback" not in text, text[-3000:]
    assert took < 120, f"{took:.0f} s"


def test_a_crash_in_the_spec_files_own_code_names_the_file(tmp_path):
    file = _spec_file(tmp_path, "abort", at_import=True)
    res = opforge_process("check", str(file), autoload=False, timeout=240)
    assert res.returncode == 1, f"rc {res.returncode}: {res.stderr[-3000:]}"
    assert f"x load {file} (SIGABRT): loading it killed the process with SIGABRT (Aborted)" in res.stdout, res.stdout


def test_a_crashing_spec_file_leaves_the_others_checked(tmp_path):
    crashing = _spec_file(tmp_path, "segfault")
    good = tmp_path / "good_spec.py"
    good.write_text(
        "import torch\nimport opforge\n\n"
        'torch.library.define("hostile_load_good::op", "(Tensor x) -> Tensor")\n\n\n'
        '@torch.library.impl("hostile_load_good::op", "CPU")\n'
        "def _kernel(x):\n    return x * 2\n\n\n"
        "SPECS = [opforge.spec(torch.ops.hostile_load_good.op.default, reference=lambda x: x * 2)]\n"
    )
    res = opforge_process("check", str(crashing), str(good), "--checks", "reference", autoload=False, timeout=240)
    assert res.returncode == 1, f"rc {res.returncode}: {res.stderr[-3000:]}"
    assert f"x load {crashing} (SIGSEGV)" in res.stdout, res.stdout
    assert "1 passed, 1 failed" in res.stdout, res.stdout
