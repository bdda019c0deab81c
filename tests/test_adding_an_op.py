"""docs/adding-an-op.md, followed to the letter: its files written into a copy
of the repository, the library built from there and the new operator checked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-an-op.md"
_FILE_BLOCK = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```\w+\n(?P<code>.*?)```", re.S)


def _doc_files() -> dict[str, str]:
    return {m["path"]: m["code"] for m in _FILE_BLOCK.finditer(DOC.read_text())}


def test_the_page_gives_every_file_of_an_operator():
    files = _doc_files()
    assert set(files) == {
        "csrc/ops/cube/cube.cpp",
        "csrc/ops/cube/cube_kernel.h",
        "csrc/ops/cube/cube_kernel.cu",
        "src/opforge/ops/cube.py",
    }
    # The page's promise: nothing else lists an operator.
    for path in files:
        assert not (ROOT / path).exists(), f"{path} is the page's example, not a library operator"


def test_the_pages_kernel_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    folder = tmp_path / "csrc" / "ops" / "cube"
    folder.mkdir(parents=True)
    for path, code in _doc_files().items():
        if path.startswith("csrc/"):
            (tmp_path / path).write_text(code)
    cmd = [nvcc, "-std=c++17", "-arch=sm_80", "-I", str(ROOT / "csrc"), "-I", str(folder), "-c", str(folder / "cube_kernel.cu")]
    run = subprocess.run([*cmd, "-o", str(tmp_path / "cube.o")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
def test_an_operator_added_as_the_page_says_builds_and_passes_check(tmp_path):
    repo = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "csrc", repo / "csrc", ignore=ignore)
    shutil.copytree(ROOT / "src", repo / "src", ignore=ignore)
    for path, code in _doc_files().items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": str(repo / "src"),
        "OPFORGE_CACHE_DIR": str(tmp_path / "cache"),
        # The eager fast path's module is not what this page is about: built from this copy (another
        # key) it would compile for half a minute in the background, past the end of the test.
        "OPFORGE_FAST": "0",
    }
    script = (
        "import sys, torch, opforge\n"
        "x = torch.randn(37, 5, dtype=torch.float64, requires_grad=True)\n"
        "assert torch.equal(opforge.cube(x), x * x * x)\n"
        "assert torch.allclose(torch.autograd.grad(opforge.cube(x).sum(), x)[0], 3 * x * x)\n"
        "from opforge.cli import main\n"
        "sys.exit(main(['check', 'cube', '--device', 'cpu']))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert re.search(r"check cube: reference pass .*bad inputs pass", out), out[-2000:]
    assert re.search(r"\b\d+ passed, 0 failed", out), out[-2000:]
