"""Two calls of qqq_gemm at M = 1, K = N = 8192, per channel then per group 128: a
small target for ncu's source-level sections (`qqq_ncu.sh calls`), where
`opforge profile` prints only the summary.

    ncu -k regex:qqq_gemm_kernel --launch-skip 1 --launch-count 3 python benchmarks/experiments/qqq_once.py
"""

from __future__ import annotations

import torch

import opforge
from opforge.ops.qqq_gemm import make_args

dev = torch.device("cuda")
for gs in (-1, 128):
    args = make_args(1, 8192, 8192, gs, dev, None)
    for _ in range(2):
        opforge.qqq_gemm(*args)
torch.cuda.synchronize()
