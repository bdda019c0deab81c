"""opforge's operators in real distributed training, one process per rank, started by torchrun:
gloo on the CPU (tests/test_distributed.py, CI) or NCCL on GPUs (the ``multigpu`` tests).

    torchrun --standalone --nproc_per_node=2 tests/dist_scenarios.py --device cpu --out DIR [SCENARIO ...]

Each scenario compares the distributed run with one device computing the same thing from the
same seed (every rank computes that reference too). Rank 0 writes ``DIR/results.json``:
scenario -> "ok" or what differed; every rank writes its own failures to stderr.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import opforge
from opforge.nn import LLTM, QQQLinear

SCENARIOS: dict[str, Callable[[torch.device], None]] = {}


def scenario(fn: Callable[[torch.device], None]) -> Callable[[torch.device], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def close(got: torch.Tensor, want: torch.Tensor, what: str, *, rtol: float, atol: float) -> None:
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    try:
        torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {str(exc).splitlines()[0]} {' '.join(str(exc).splitlines()[1:4])}") from None


def dtype_for(device: torch.device) -> torch.dtype:
    # float64 on the CPU: the distributed run differs from one device only in the order of sums;
    # float32 on GPUs, where matmuls of that order differ by float32 rounding.
    return torch.float64 if device.type == "cpu" else torch.float32


def tol(device: torch.device) -> dict[str, float]:
    return {"rtol": 1e-10, "atol": 1e-12} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-5}


# --- data parallel: DDP and FSDP2 need nothing special from an operator ---


def _lltm_batch(device: torch.device, world: int) -> tuple[LLTM, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    dt = dtype_for(device)
    model = LLTM(32, 48).to(device, dt)
    B = 6 * world + 1  # a batch that does not split evenly: rank shares differ
    x, h, c = (torch.randn(B, n, device=device, dtype=dt) for n in (32, 48, 48))
    return model, x, h, c


def _lltm_loss(model: nn.Module, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    new_h, new_c = model(x, (h, c))
    return (new_h * new_h).sum() + new_c.sum()


def _reference_grads(model: LLTM, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    # DDP and FSDP2 average the ranks' gradients: the full batch's gradient of the sum over each
    # rank's share, divided by the number of ranks.
    ref = copy.deepcopy(model)
    (_lltm_loss(ref, x, h, c) / world).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _share(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return torch.tensor_split(t, world)[rank]


@scenario
def ddp_lltm(device: torch.device) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, h, c = _lltm_batch(device, world)
    want = _reference_grads(model, x, h, c, world)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    _lltm_loss(ddp, *(_share(t, rank, world) for t in (x, h, c))).backward()
    for n, p in model.named_parameters():
        close(p.grad, want[n], f"DDP gradient of {n}", **tol(device))


@scenario
def fsdp2_lltm(device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, h, c = _lltm_batch(device, world)
    want = _reference_grads(model, x, h, c, world)
    fully_shard(model)
    _lltm_loss(model, *(_share(t, rank, world) for t in (x, h, c))).backward()
    for n, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", f"FSDP2 left {n} unsharded"
        close(p.grad, want[n], f"FSDP2 gradient of {n}", **tol(device))


# --- tensor parallel: the operators run on DTensors ---


class MLP(nn.Module):
    """Linear -> opforge.sigmoid -> Linear, the tensor-parallel block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(opforge.sigmoid(self.up(x)))


def _tp_mlp(device: torch.device, compiled: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    torch.manual_seed(0)
    dt = dtype_for(device)
    one = MLP(48, 64 * world).to(device, dt)
    x = torch.randn(5, 7, 48, device=device, dtype=dt)
    g = torch.randn(5, 7, 48, device=device, dtype=dt)
    want = one(x)
    (want * g).sum().backward()

    mesh = init_device_mesh(device.type, (world,))
    tp = copy.deepcopy(one)
    tp.zero_grad()
    # use_local_output=False: the up projection's output stays a DTensor (Shard(-1)), so
    # opforge.sigmoid and its backward run on DTensors, through their sharding strategies.
    parallelize_module(tp, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(input_layouts=Shard(-1))})
    if compiled:
        # Eager first, as a user would (the operator's public function then holds its fast path),
        # then the same sharded model compiled.
        tp(x).sum().backward()
        tp.zero_grad()
    run = torch.compile(tp) if compiled else tp
    xi = x.detach().clone().requires_grad_()
    got = run(xi)
    (got * g).sum().backward()
    what = "compiled " if compiled else ""
    close(got, want, f"{what}tensor-parallel output", **tol(device))
    for (n, p), (_, p1) in zip(tp.named_parameters(), one.named_parameters(), strict=True):
        close(p.grad, p1.grad, f"{what}tensor-parallel gradient of {n}", **tol(device))


@scenario
def tp_mlp_sigmoid(device: torch.device) -> None:
    _tp_mlp(device, compiled=False)


@scenario
def tp_mlp_sigmoid_compiled(device: torch.device) -> None:
    _tp_mlp(device, compiled=True)


@scenario
def tp_qqq_pair(device: torch.device) -> None:
    """Column- then row-parallel QQQLinear (opforge.tensor_parallel) against the one-device W4A8 MLP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    for group_size in (-1, 128):
        torch.manual_seed(0)
        one = nn.Sequential(
            QQQLinear.from_linear(nn.Linear(512, 1024), group_size=group_size, out_dtype=torch.float16),
            QQQLinear.from_linear(nn.Linear(1024, 256), group_size=group_size, out_dtype=torch.float16),
        ).to(device)
        x = torch.randn(4, 9, 512, device=device, dtype=torch.float16)
        with torch.no_grad():
            want = one(x)
            hidden = one[0](x)
        tp = parallelize_module(copy.deepcopy(one), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        with torch.no_grad():
            got = tp(x)
            got_hidden = tp[0](x)  # this rank's columns
        cols = torch.tensor_split(torch.arange(hidden.shape[-1]), world)[dist.get_rank()]
        close(got_hidden, hidden[..., cols], f"column-parallel QQQLinear (group_size {group_size})", rtol=0, atol=0)
        # Row-parallel: float32 partial sums, reduced, rounded once; with the bias, an ulp of the product.
        close(got, want, f"column- then row-parallel QQQLinear (group_size {group_size})", rtol=2**-9, atol=2**-14)
        differ = (got != want).float().mean().item()
        assert differ < 0.01, f"{differ:.2%} of the TP-{world} W4A8 outputs differ from one device's"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    results: dict[str, str] = {}
    for name in args.scenarios:
        start = time.perf_counter()
        try:
            SCENARIOS[name](device)
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - report every scenario
            results[name] = f"{type(exc).__name__}: {exc}"
            print(f"rank {rank}: {name}: {traceback.format_exc()}", file=sys.stderr)
        # Every rank's verdict: a scenario passes only where it passed on all of them.
        verdicts: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(verdicts, results[name])
        bad = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v != "ok"]
        results[name] = "; ".join(bad) if bad else "ok"
        print(f"rank {rank}: {name}: {results[name]} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
