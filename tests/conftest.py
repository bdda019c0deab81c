"""Shared fixtures. CUDA tests carry the ``cuda`` marker and are skipped,
precisely, when there is no GPU or the op library has no CUDA kernels."""

from __future__ import annotations

import os

import pytest
import torch

import opforge

HAS_CUDA = torch.cuda.is_available() and opforge.load().with_cuda
_NO_CUDA_REASON = (
    "no CUDA GPU visible" if not torch.cuda.is_available() else "op library built without CUDA kernels (no nvcc or OPFORGE_BUILD_CUDA=0)"
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(config, items) -> None:
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
