"""Shared fixtures. CUDA tests carry the ``cuda`` marker and are skipped,
precisely, when there is no GPU or the op library has no CUDA kernels.

One op library serves the whole run: it is built (or found) here, once, in
the build cache (``OPFORGE_CACHE_DIR``, else the user's), and that cache is
exported so that every subprocess a test starts loads the same library instead
of building its own. A test that needs a cache of its own starts it with
``cache_with_library``: the library's entry copied in, no cold build. Only the
tests marked ``slow`` build the whole library from nothing (a killed build, a
wheel, CMake).

Under pytest-xdist every worker imports this file; the first to get the
cache's lock builds, the others wait and load it. Tests that share one
module-scoped setup (examples started together, a scaffolded package) carry an
``xdist_group`` mark, and ``--dist loadgroup`` is made the default so that
each group runs in one worker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import opforge
from opforge.build import cache_root

LIBRARY = opforge.load()
os.environ["OPFORGE_CACHE_DIR"] = str(cache_root())

HAS_CUDA = torch.cuda.is_available() and LIBRARY.with_cuda
_NO_CUDA_REASON = (
    "no CUDA GPU visible" if not torch.cuda.is_available() else "op library built without CUDA kernels (no nvcc or OPFORGE_BUILD_CUDA=0)"
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def cache_with_library(root: Path) -> Path:
    """A build cache at ``root`` (made, mode 0700) that holds the op library
    already built for this run: its cache entry is copied in, so a process
    using this cache loads the library at once instead of building it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = LIBRARY.path.parent
    if LIBRARY.route == "jit" and entry.parent == cache_root() and not (root / entry.name).exists():
        shutil.copytree(entry, root / entry.name)
    return root


def pytest_configure(config) -> None:
    # `-n N` alone distributes test by test; the xdist_group marks need loadgroup.
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


# The tests selected for this run, for fixtures that start work for several of them at once.
SELECTED = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items) -> None:
    config.stash[SELECTED] = items

    # Modules with long tests (slow, or a group bound to one worker) first,
    # each module kept whole (its module-scoped setup runs once): under
    # pytest-xdist they start at once rather than trailing the short tests.
    def long(item) -> bool:
        return any(m.name in ("slow", "xdist_group") for m in item.iter_markers())

    long_modules = {item.module for item in items if long(item)}
    items.sort(key=lambda item: item.module not in long_modules)
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
