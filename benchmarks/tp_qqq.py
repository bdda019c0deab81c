"""The W4A8 MLP on two GPUs (tensor parallel) against one GPU, at decode and prefill sizes.

    PYTHONPATH=src torchrun --standalone --nproc_per_node=2 benchmarks/tp_qqq.py [--out benchmarks/results]

The MLP: QQQLinear d -> h, opforge.sigmoid, QQQLinear h -> d (d = 4096, h = 11008 by default,
per-channel or group_size 128), input [M, d] float16. One GPU: the MLP as it is, on rank 0 (the
other rank waits). TP-2: the first layer column-parallel and the second row-parallel
(opforge.tensor_parallel), the input replicated, the output all-reduced (one all-reduce of [M, d] per
MLP; the row-parallel layer's per-token scales take one small all-reduce of [M] more). Both
checked against each other before timing (TP-2 within a float16 rounding of one GPU).

Timing: CUDA events around each call on the current stream, ranks aligned by a barrier before
each, median of ``--reps`` calls after ``--warmup``; each rank times the call, the slowest rank's
time is reported (the call is done when every rank is). The same for float16 nn.Linear MLPs
(one GPU and ColwiseParallel/RowwiseParallel TP-2), for comparison. Rank 0 writes
``tp-qqq_<gpu>-x<ranks>_<date>.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import opforge
from opforge.nn import QQQLinear

DECODE_M = (1, 2, 4, 8, 16)
PREFILL_M = (2048,)


class MLP(nn.Module):
    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(opforge.sigmoid(self.up(x)))


def fp16_mlp(d: int, h: int, device: torch.device) -> MLP:
    torch.manual_seed(0)
    return MLP(nn.Linear(d, h), nn.Linear(h, d)).to(device, torch.float16)


def w4a8_mlp(fp16: MLP, group_size: int) -> MLP:
    return MLP(
        QQQLinear.from_linear(fp16.up, group_size=group_size, out_dtype=torch.float16),
        QQQLinear.from_linear(fp16.down, group_size=group_size, out_dtype=torch.float16),
    )


def time_call(fn, x: torch.Tensor, warmup: int, reps: int, group) -> float:  # noqa: ANN001
    """Median microseconds per call, the slowest rank's (every rank of ``group`` calls it).
    CUDA events on a GPU; on the CPU (--device cpu: a smoke run over gloo) perf_counter."""
    cuda = x.is_cuda
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        for _ in range(warmup):
            fn(x)
        if cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            if group is not None:
                dist.barrier(group=group)
            if cuda:
                start.record()
                fn(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn(x)
                times.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor([statistics.median(times)], device=x.device)
    if group is not None:
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return float(med.item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=11008)
    p.add_argument("--group-size", type=int, nargs="+", default=[-1, 128])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--decode-m", type=int, nargs="+", default=list(DECODE_M))
    p.add_argument("--prefill-m", type=int, nargs="+", default=list(PREFILL_M))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run over gloo (tests), not a benchmark")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module

    from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,))
    solo = dist.new_group([0])  # rank 0 alone: the one-GPU runs

    fp16 = fp16_mlp(args.dim, args.hidden, device)
    fp16_tp = parallelize_module(copy.deepcopy(fp16), mesh, {"up": TorchColwise(), "down": TorchRowwise()})
    rows = []
    for group_size in args.group_size:
        one = w4a8_mlp(fp16, group_size)
        tp = parallelize_module(copy.deepcopy(one), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for M in (*args.decode_m, *args.prefill_m):
            torch.manual_seed(M)
            x = torch.randn(M, args.dim, device=device, dtype=torch.float16)
            with torch.no_grad():
                want, got = one(x), tp(x)
            # The same W4A8 MLP: TP-2 within a float16 rounding of one GPU (tests/test_distributed.py).
            torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-10)
            row = {"M": M, "phase": "decode" if M in args.decode_m else "prefill", "group_size": group_size}
            row["w4a8_tp_us"] = time_call(tp, x, args.warmup, args.reps, dist.group.WORLD)
            row["fp16_tp_us"] = time_call(fp16_tp, x, args.warmup, args.reps, dist.group.WORLD)
            if rank == 0:
                row["w4a8_1gpu_us"] = time_call(one, x, args.warmup, args.reps, solo)
                row["fp16_1gpu_us"] = time_call(fp16, x, args.warmup, args.reps, solo)
                row["tp_speedup"] = row["w4a8_1gpu_us"] / row["w4a8_tp_us"]
                rows.append(row)
            dist.barrier()
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
        slug = name.lower().replace("nvidia ", "").replace(" ", "-")
        date = datetime.date.today().isoformat()
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            commit = ""
        report = {
            "what": "W4A8 MLP (QQQLinear d->h, opforge.sigmoid, QQQLinear h->d), TP over NCCL vs one GPU; float16 nn.Linear MLP beside",
            "device": name,
            "gpus": world,
            "d": args.dim,
            "hidden": args.hidden,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            "python": platform.python_version(),
            "git_commit": commit,
            "date": date,
            "timing": (
                f"{'CUDA events' if device.type == 'cuda' else 'perf_counter'}, median of {args.reps} calls after "
                f"{args.warmup}, ranks aligned by a barrier, slowest rank"
            ),
            "rows": rows,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"tp-qqq_{slug}-x{world}_{date}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"{name} x{world}, d={args.dim}, hidden={args.hidden}, torch {torch.__version__}")
        head = ("phase", "M", "group", "W4A8 1 GPU us", "W4A8 TP us", "TP speedup", "fp16 1 GPU us", "fp16 TP us")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 5, 6, 14, 11, 10, 14, 11), strict=True)))
        for r in rows:
            print(
                f"{r['phase']:8} {r['M']:>5} {r['group_size']:>6} {r['w4a8_1gpu_us']:>14.1f} {r['w4a8_tp_us']:>11.1f} "
                f"{r['tp_speedup']:>10.2f} {r['fp16_1gpu_us']:>14.1f} {r['fp16_tp_us']:>11.1f}"
            )
        print(f"written to {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
