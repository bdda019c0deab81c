"""``opforge new``: scaffold a package, then, with no edit, build it and its
wheel. Bad names are refused, clearly. The rest of a scaffold's life on the CPU
(``opforge check``, a bug planted in its kernel that check names, its own tests,
``opforge bench``) is the guide's first sections, which tests/test_docs.py runs
block by block: ``test_the_guide_walks_a_scaffold_through_check_tests_and_bench``
holds the guide to it. On a GPU the CUDA scaffold goes through all of it here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from opforge.builder import csrc_dir
from opforge.project import ProjectError, find_project, scaffold

from .conftest import SRC, cache_with_library

# One scaffolded package serves the module: under pytest-xdist its tests stay in one worker.
pytestmark = pytest.mark.xdist_group("new")
NAME = "opf_softsign"  # the package, the operator and (by default) its namespace


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # A build cache of the module's own; the opforge command's environment (its
    # console script sets OPFORGE_NO_AUTOLOAD: commands load what they need).
    # It holds this run's op library already: what the tests build is the package.
    cache = cache_with_library(tmp_path_factory.mktemp("cache"))
    # The tables at the width of a log, not at the COLUMNS of the test runner's environment.
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**base, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(cache), "OPFORGE_NO_AUTOLOAD": "1"}


def run(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def opforge_cli(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run(env, "-m", "opforge", *args, cwd=cwd)


@pytest.fixture(scope="module")
def package(tmp_path_factory, env) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """One scaffold (CPU kernel, with backward) in ./NAME, and its build, shared by the module."""
    where = tmp_path_factory.mktemp("work")
    new = opforge_cli(env, "new", NAME, "--no-cuda", "--backward", cwd=where)
    assert new.returncode == 0, new.stdout + new.stderr
    root = where / NAME
    build = opforge_cli(env, "build", str(root))
    return root, new, build


@pytest.mark.slow
def test_new_writes_a_package_with_its_marker(package):
    root, new, _ = package
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert {
        "pyproject.toml",
        "setup.py",
        "README.md",
        f"csrc/{NAME}/{NAME}.cpp",
        f"src/{NAME}/__init__.py",
        f"src/{NAME}/ops/{NAME}.py",
        f"tests/test_{NAME}.py",
    } <= files
    assert not any(f.endswith(".cu") for f in files)  # --no-cuda
    project = find_project(root)
    assert project is not None and project.namespace == NAME and project.sources == root / "csrc" / NAME
    assert f"TORCH_LIBRARY({NAME}, m)" in (root / "csrc" / NAME / f"{NAME}.cpp").read_text()
    assert f"opforge check ./{NAME}\n" in new.stdout  # the next steps, the package named as a path


@pytest.mark.slow
def test_build_builds_and_loads_it(package):
    _, _, build = package
    assert build.returncode == 0, build.stdout + build.stderr
    assert f"{NAME}::{NAME}" in build.stdout and "CUDA kernels: no" in build.stdout


@pytest.mark.slow
def test_build_takes_a_bare_folder_name_as_the_folder(package, env):
    # `opforge build NAME`, the guide's spelling: a folder, not an operator's name as check and bench
    # read a bare word. It builds (here: finds in the cache) and loads the package, and says where.
    root, _, _ = package
    res = opforge_cli(env, "build", NAME, cwd=root.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{NAME}: " in res.stdout and f"{NAME}.so (cached; CUDA kernels: no)" in res.stdout, res.stdout
    assert f"operators {NAME}::{NAME} loaded" in res.stdout


@pytest.mark.slow
def test_its_sources_folder_built_alone_is_the_packages_library(package, env):
    # `opforge build csrc/NAME` compiles with a precompiled header and the package's import without:
    # the same library, one cache entry, so the folder's build finds the package's.
    root, _, _ = package
    # With the header on (the suite turns it off), and CUDA off as in the --no-cuda package.
    res = opforge_cli({**env, "OPFORGE_PCH": "1", "OPFORGE_BUILD_CUDA": "0"}, "build", str(root / "csrc" / NAME))
    assert res.returncode == 0, res.stdout + res.stderr
    assert '  precompiled header: <cmath> "opforge/aten/common.h" for 1 of 1' in res.stdout, res.stdout
    assert f"{NAME}.so (cached; loaded into torch.ops)" in res.stdout, res.stdout


@pytest.mark.slow
def test_bench_times_the_package_through_the_eager_fast_path(package, env):
    # What `opforge bench DIR` does before loading the package (the CLI runs with
    # OPFORGE_NO_AUTOLOAD=1): without it, the package's functions would go through torch.ops.
    root, _, _ = package
    code = (
        "from opforge import cli; from opforge.project import load_project; "
        f"specs = load_project({str(root)!r}); print('before', specs[0].function._opforge_fast is not None)"
    )
    res = run(env, "-c", code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["before", "False"]  # the premise: no fast path without opforge's library
    code = code.replace("specs = load_project", "cli.fast_path_for_packages(); specs = load_project").replace("'before'", "'after'")
    res = run(env, "-c", code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["after", "True"]


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def test_the_guide_walks_a_scaffold_through_check_tests_and_bench():
    # What the CPU tests of this file leave to the guide's run: each command, run on the scaffold.
    text = GUIDE.read_text()
    for command in (
        "opforge new my_op --backward",
        "opforge check ./my_op --device cpu --seed 0",
        "sed -i 's|t / (acc_t(1) + std::abs(t))|t / (acc_t(1) + acc_t(1.01) * std::abs(t))|' my_op/csrc/my_op/my_op.cpp",
        'test "$status" -eq 1 && grep -q \'reference: my_op float32',
        "output 0: 59/59 elements off' report.txt",
        "python -m pytest -q -p no:cacheprovider my_op/tests",
        "opforge bench ./my_op --device cpu --dtype float32",
        'assert row["status"] == "ok"',
    ):
        assert command in text, command


@pytest.mark.slow
def test_wheel_has_the_library_prebuilt(package, env, tmp_path):
    root, _, _ = package
    copy = tmp_path / "src_copy"  # pip builds in the tree: keep the shared package clean
    shutil.copytree(root, copy)
    wheels = tmp_path / "wheels"
    res = run(env, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(wheels), str(copy))
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = wheels.glob(f"{NAME}-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith(f"{NAME}/_C.") and n.endswith(".so") for n in names), names
    assert f"{NAME}/_C.build.json" in names and f"{NAME}/_csrc/{NAME}/{NAME}.cpp" in names
    site = tmp_path / "site"
    res = run(env, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    assert res.returncode == 0, res.stdout + res.stderr
    code = f"import torch, {NAME} as p; x = torch.randn(9); print(p.library.route, bool(torch.equal(p.{NAME}(x), x / (1 + x.abs()))))"
    res = run({**env, "PYTHONPATH": os.pathsep.join([str(site), SRC])}, "-c", code, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["prebuilt", "True"]


@pytest.mark.slow
def test_profile_takes_the_package_and_says_what_is_missing(package, env):
    # The package is --no-cuda: on any machine (a GPU one too) profile loads it, then
    # says what it lacks, in one line, with the exit status of "cannot run here".
    root, _, _ = package
    res = opforge_cli(env, "profile", str(root))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "opforge profile: cannot run, missing: " in res.stderr
    assert ("a CUDA GPU" in res.stderr) or (f"the CUDA kernels of {root}'s op library" in res.stderr)


# --- the same path with the CUDA kernel, on a GPU ---

CUDA_NAME = "opf_softsign_cu"


@pytest.fixture(scope="module")
def cuda_package(tmp_path_factory, env) -> tuple[Path, subprocess.CompletedProcess]:
    where = tmp_path_factory.mktemp("work_cuda")
    new = opforge_cli(env, "new", CUDA_NAME, "--backward", cwd=where)
    assert new.returncode == 0, new.stdout + new.stderr
    root = where / CUDA_NAME
    return root, opforge_cli(env, "build", str(root))


@pytest.mark.slow
@pytest.mark.cuda
def test_cuda_package_builds_checks_benches_profiles_and_its_tests_pass(cuda_package, env, tmp_path):
    root, build = cuda_package
    assert build.returncode == 0, build.stdout + build.stderr
    assert "CUDA kernels: yes" in build.stdout
    res = opforge_cli(env, "check", str(root), "--device", "cuda", "--seed", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith("7 passed, 0 failed")
    res = run(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(root / "tests"), cwd=root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " passed" in res.stdout and "skipped" not in res.stdout  # the CUDA tests ran
    args = ("bench", str(root), "--device", "cuda", "--dtype", "float32", "--budget", "0.05", "--seed", "3", "--no-compile")
    res = opforge_cli(env, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"{CUDA_NAME} ") >= 4 and "refused" not in res.stdout  # 2^16 .. 2^26
    if shutil.which("ncu"):
        res = opforge_cli(env, "profile", str(root), "--case", "2^20")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"{CUDA_NAME}::{CUDA_NAME} float32 [2^20]" in res.stdout and "elementwise_kernel" in res.stdout


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not shutil.which("compute-sanitizer"), reason="compute-sanitizer is not on PATH")
@pytest.mark.xdist_group("new_sanitize")  # a worker of its own: four sanitizer runs take minutes
def test_cuda_package_passes_the_sanitizers(cuda_package, env):
    root, build = cuda_package
    assert build.returncode == 0, build.stdout + build.stderr
    res = opforge_cli(env, "profile", str(root), "--sanitize", "--seed", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 tools, all passed" in res.stdout


@pytest.mark.slow
@pytest.mark.cuda
def test_planted_bug_in_the_cuda_kernel_fails_check_on_the_gpu(cuda_package, env, tmp_path):
    root, _ = cuda_package
    buggy = tmp_path / CUDA_NAME
    shutil.copytree(root, buggy)
    cu = buggy / "csrc" / CUDA_NAME / f"{CUDA_NAME}_kernel.cu"
    right = "return x / (U(1) + fabs(x));"
    assert right in cu.read_text()
    cu.write_text(cu.read_text().replace(right, "return x / (U(1) + U(1.01) * fabs(x));"))
    res = opforge_cli(env, "check", str(buggy), "--device", "cuda", "--seed", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"reference: {CUDA_NAME} float32 [59] (seed 1): output 0: " in res.stdout
    assert "elements off" in res.stdout


def test_cuda_kernel_is_generated_and_compiles_with_plain_nvcc(tmp_path):
    root = scaffold("opf_cuda_op", tmp_path / "pkg", namespace="opf_ns", cuda=True)
    folder = root / "csrc" / "opf_cuda_op"
    cu, header = folder / "opf_cuda_op_kernel.cu", folder / "opf_cuda_op_kernel.h"
    assert cu.is_file() and header.is_file()
    for text in (cu.read_text(), header.read_text()):
        assert "#include <torch" not in text and "#include <ATen" not in text and "#include <c10" not in text
    cpp = (folder / "opf_cuda_op.cpp").read_text()
    assert "TORCH_LIBRARY(opf_ns, m)" in cpp and '#include "opf_cuda_op_kernel.h"' in cpp and "opf_cuda_op_cuda(" in cpp
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    cmd = [nvcc, "-std=c++17", "-c", "-arch=sm_80", f"-I{csrc_dir()}", f"-I{folder}", str(cu), "-o", str(tmp_path / "kernel.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("name", "namespace", "message"),
    [
        ("1op", None, "NAME '1op' is not a valid identifier"),
        ("my-op", None, "NAME 'my-op' is not a valid identifier"),
        ("my op", None, "NAME 'my op' is not a valid identifier"),
        ("_op", None, "NAME '_op' is not a valid identifier"),
        ("class", None, "NAME 'class' is a Python keyword"),
        ("lambda", None, "NAME 'lambda' is a Python keyword"),
        ("double", None, "NAME 'double' is a C++ keyword"),
        ("aten", None, "NAME 'aten' collides with an existing torch.ops namespace"),
        ("opforge", None, "NAME 'opforge' collides with an existing torch.ops namespace"),
        ("prims", None, "NAME 'prims' collides with an existing torch.ops namespace"),
        ("load_library", None, "NAME 'load_library' collides with an existing torch.ops namespace or attribute"),
        ("my_op", "aten", "namespace 'aten' collides with an existing torch.ops namespace"),
        ("my_op", "opforge", "namespace 'opforge' collides with an existing torch.ops namespace"),
        ("my_op", "my-ns", "namespace 'my-ns' is not a valid identifier"),
        ("json", None, "NAME 'json' is already an importable Python module"),
        ("a" * 250, None, "NAME 'aaaaaaaaaaaaaaaaaaaa'... is 250 characters long; at most 64"),
        ("my_op", "n" * 65, "namespace 'nnnnnnnnnnnnnnnnnnnn'... is 65 characters long; at most 64"),
    ],
)
def test_bad_names_are_refused(tmp_path, name, namespace, message):
    with pytest.raises(ProjectError, match="^" + re.escape(message)):
        scaffold(name, tmp_path / "pkg", namespace)
    assert not (tmp_path / "pkg").exists()  # nothing written


@pytest.mark.parametrize("exists", [False, True])
def test_a_write_that_fails_leaves_nothing_behind(tmp_path, monkeypatch, exists):
    target = tmp_path / "pkg"
    if exists:
        target.mkdir()
    real_write, written = Path.write_text, []

    def write_text(self, *args, **kwargs):
        if len(written) == 2:
            raise OSError(28, "No space left on device", str(self))
        written.append(self)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(ProjectError, match=f"^could not write the package into {re.escape(str(target))}: No space left on device"):
        scaffold("my_op", target)
    assert len(written) == 2
    assert (list(target.iterdir()) == []) if exists else not target.exists()


def test_a_non_empty_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(ProjectError, match=f"^{re.escape(str(tmp_path))} is not empty"):
        scaffold("my_op", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    scaffold("my_op", tmp_path / "empty_dir_is_fine")  # does not exist yet: created


def test_cli_reports_a_bad_name_and_a_folder_that_is_no_package(tmp_path, env):
    res = opforge_cli(env, "new", "9lives", cwd=tmp_path)
    assert res.returncode != 0 and "opforge new: NAME '9lives' is not a valid identifier" in res.stderr
    assert not any(tmp_path.iterdir())
    res = opforge_cli(env, "check", f"{tmp_path}{os.sep}", "--device", "cpu")
    assert res.returncode != 0 and f"is not an opforge package: no [tool.opforge] table in {tmp_path}" in res.stderr
