"""Shared fixtures. CUDA tests carry the ``cuda`` marker and are skipped,
precisely, when there is no GPU or the op library has no CUDA kernels.

One op library serves the whole run: it is built (or found) here, once, in
the build cache (``OPFORGE_CACHE_DIR``, else the user's), and that cache is
exported so that every subprocess a test starts loads the same library instead
of building its own. A test that needs a cache of its own starts it with
``cache_with_library``: the library's entry copied in, no cold build. Only the
tests marked ``slow`` build the whole library from nothing (a wheel, CMake, a
compiler that links libstdc++ statically). Tests that build the same thing
for a pybind11 module share ``shared_cache``, the run's own, and through
``pch_cache`` one precompiled ``torch/extension.h``.

Under pytest-xdist every worker imports this file; the first to get the
cache's lock builds, the others wait and load it. Tests that share one
module-scoped setup (examples started together, a scaffolded package) carry an
``xdist_group`` mark, and ``--dist loadgroup`` is made the default so that
each group runs in one worker.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

# Every worker (one per core) and every process a test starts runs torch's OpenMP threads, one per
# core: more threads than cores. By default a thread that finishes its share spins, waiting for the
# next parallel region, on a core that another process needs. Passive threads sleep instead (the
# GEMM, QQQ and check tests on two cores: 47-54 s passive, 77 s by default; docs/development.md).
# Set before torch is imported, which starts OpenMP; the threads stay one per core, so the parallel
# paths still run.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

# The op library is loaded below, with the eager fast path's module (its first build runs in the
# background) attached before the operators register: out= operators then get its C++ autograd
# kernel, as under the opforge command, whether or not the cache had the module already; tests see
# what users' calls run. Processes that tests start load the library on import, as users' do.
_NO_AUTOLOAD = os.environ.get("OPFORGE_NO_AUTOLOAD")
os.environ["OPFORGE_NO_AUTOLOAD"] = "1"

import opforge  # noqa: E402 - with OPFORGE_NO_AUTOLOAD set, above
from opforge import cli  # noqa: E402
from opforge.builder import cache_root  # noqa: E402

LIBRARY = opforge.load(wait_fast=True)
FAST = opforge.fast.module()
if _NO_AUTOLOAD is None:
    del os.environ["OPFORGE_NO_AUTOLOAD"]
else:
    os.environ["OPFORGE_NO_AUTOLOAD"] = _NO_AUTOLOAD
os.environ["OPFORGE_CACHE_DIR"] = str(cache_root())
# Tests build users' folders in fresh caches; precompiling torch/extension.h for
# each (755 MB, 60-90 s on 2 cores) would dominate them. The tests of the
# precompiled header turn it back on, and so does ``pch_cache``, where one header
# serves every torch/extension.h build of the run.
os.environ.setdefault("OPFORGE_PCH", "0")

HAS_CUDA = torch.cuda.is_available() and LIBRARY.with_cuda
_NO_CUDA_REASON = (
    "no CUDA GPU visible" if not torch.cuda.is_available() else "op library built without CUDA kernels (no nvcc or OPFORGE_BUILD_CUDA=0)"
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def cache_with_library(root: Path, *, fast: bool = True) -> Path:
    """A build cache at ``root`` (made, mode 0700) that holds the op library
    already built for this run, and the fast path's module: their cache
    entries are copied in, so a process using this cache loads them at once
    instead of building them."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Every complete entry of both (a process with other compiler variables has a fast-path module of its
    # own key): else each process in that cache would build the module again, in the background.
    # (``fast=False``: the op library alone, for tests of the fast path's own first build.)
    entries = [*cache_root().glob("opforge_ops-*/COMPLETE.json"), *(cache_root().glob("opforge_fast-*/COMPLETE.json") if fast else ())]
    for marker in entries:
        entry = marker.parent
        if not (root / entry.name).exists():
            shutil.copytree(entry, root / entry.name)
    return root


@pytest.fixture(scope="module")  # the same folder for every module: seeding it again is a no-op
def shared_cache(tmp_path_factory) -> Path:
    """A build cache of this test run, with the op library in it, that every
    pytest-xdist worker sees: tests that build the same thing (torch/extension.h's
    precompiled header for a pybind11 module, 30 s of compiler time on two cores)
    build it once, the others wait on its lock and reuse it."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's temporary folder is one of the run's: their parent is the run's own.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-cache"
    with open(root.with_name("shared-cache.lock"), "w") as lock:  # two workers must not copy the library in at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cache_with_library(root)


@pytest.fixture
def pch_cache(shared_cache: Path, monkeypatch) -> Path:
    """``shared_cache`` as this test's cache, with precompiled headers on: the
    run's builds that begin with ``torch/extension.h`` (the examples, the add2
    and inline tests) precompile it once, about one compile's time, and each then
    compiles in about half the time it takes without (benchmarks/build_speed.py --byo)."""
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(shared_cache))
    monkeypatch.setenv("OPFORGE_PCH", "1")
    return shared_cache


@pytest.fixture
def opforge_here(capsys, monkeypatch):
    """`opforge ARGS` in this process, its checks too: (exit status, stdout, stderr). A process of
    its own would import torch again for each command; keep those for what only a real process
    shows (the entry point, a crash, the time limit). The tables at the width of a log, as a piped
    `opforge` prints them; ``cwd``: the folder the command runs from."""
    monkeypatch.setattr(cli.out, "width", 200)
    monkeypatch.setattr(cli.err, "width", 200)
    monkeypatch.setenv("OPFORGE_CHECK_IN_PROCESS", "1")

    def run(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as stop:
            if isinstance(stop.code, str):  # as Python does at a process's exit: the message on stderr, status 1
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else 1 if stop.code is not None else 0
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


SRC = str(Path(opforge.__file__).resolve().parent.parent)


def opforge_process(*args: str, cwd: Path | None = None, autoload: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m opforge ARGS` in a process of its own, as a shell starts it: for what only a real
    process shows (the entry point, its exit status, a crash, the time limit, an operator that must
    not register in the tests' own process); ``opforge_here`` for the rest. This checkout's opforge,
    the checks in a process of their own as the command runs them, the tables at a log's width.
    ``autoload=False``: opforge's own op library is not loaded (``OPFORGE_NO_AUTOLOAD=1``), as when
    the command checks a spec file's operators."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "OPFORGE_CHECK_IN_PROCESS")}
    env |= {"PYTHONPATH": SRC, "COLUMNS": "200", **({} if autoload else {"OPFORGE_NO_AUTOLOAD": "1"})}
    cmd = [sys.executable, "-m", "opforge", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def write(root: Path, files: dict[str, str]) -> Path:
    """Each of ``files`` (path relative to ``root``: text) written, folders made; ``root`` back."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (``scripts/``, ``benchmarks/``), not a package, imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def pytest_configure(config) -> None:
    # The xdist_group marks take effect under `--dist loadgroup` (pyproject's addopts: the workers
    # read the command line and the ini file, not options set here). pytest-xdist would otherwise
    # send the groups with the most tests first, ahead of the order set below: the longest single
    # tests (the guide, the wheel) started minutes late.
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


# The modules of the longest tests, longest first. CPU run of two pytest-xdist workers: the guide
# (3-5 min), the wheel in a venv (1-3 min), the examples (2-3 min), CMake (1 min). CUDA run of eight
# on an H200: the scaffolded CUDA packages (3-5 min each), the guide's parts and the examples (2-3 min).
LONGEST = ("test_docs", "test_prebuilt", "test_examples", "test_cmake")
LONGEST_CUDA = ("test_new", "test_new_stable", "test_docs", "test_examples", "test_profile")

# The tests selected for this run, for fixtures that start work for several of them at once.
SELECTED = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items) -> None:
    config.stash[SELECTED] = items

    # Modules with long tests (slow, or a group bound to one worker) first, the
    # longest of them (LONGEST) ahead, each module kept whole (its module-scoped
    # setup runs once): under pytest-xdist they start at once rather than
    # trailing the short tests, and the last to start are short.
    def long(item) -> bool:
        return any(m.name in ("slow", "xdist_group") for m in item.iter_markers())

    long_modules = {item.module for item in items if long(item)}

    longest = LONGEST_CUDA if HAS_CUDA else LONGEST

    def rank(item) -> int:
        name = Path(str(item.path)).stem
        return longest.index(name) if name in longest else len(longest) + (item.module not in long_modules)

    items.sort(key=rank)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=_NO_CUDA_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    # Fresh inputs every run (OPFORGE_TEST_SEED pins them to reproduce a failure).
    env = os.environ.get("OPFORGE_TEST_SEED")
    s = int(env) if env else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    print(f"seed {s} (reproduce with OPFORGE_TEST_SEED={s})")
    return s
