"""The LLTM cell, runnable: trains opforge's LLTM cell (``opforge.nn.LLTM``: one
matmul and one fused kernel each way) and the tutorial's plain-PyTorch LLTM
side by side, from the same initial weights on the same batches, and checks
that both losses fall and that the two loss curves agree.

    python examples/lltm/run.py                        # the CPU, small sizes
    python examples/lltm/run.py --device cuda          # a GPU, B=16 F=32 S=128
    python examples/lltm/run.py --steps 50 --dtype float64

The task: sequences of T random vectors; the target is tanh of a fixed linear
map of their running sum, so the cell has to integrate its inputs over time.
A linear head reads the last hidden state. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import opforge


class ReferenceLLTM(opforge.nn.LLTM):
    """The tutorial's Python LLTM: opforge.nn.LLTM's parameters (names, shapes,
    initialisation), the forward written in plain PyTorch."""

    def forward(self, input: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        old_h, old_cell = state
        X = torch.cat([old_h, input], dim=1)
        gate_weights = F.linear(X, self.weights, self.bias)
        gates = gate_weights.chunk(3, dim=1)
        input_gate = torch.sigmoid(gates[0])
        output_gate = torch.sigmoid(gates[1])
        candidate_cell = F.elu(gates[2])
        new_cell = old_cell + candidate_cell * input_gate
        new_h = torch.tanh(new_cell) * output_gate
        return new_h, new_cell


class Model(nn.Module):
    """The cell unrolled over the sequence, then a linear head on the last hidden state."""

    def __init__(self, cell: nn.Module, state_size: int, out_features: int) -> None:
        super().__init__()
        self.cell = cell
        self.state_size = state_size
        self.head = nn.Linear(state_size, out_features)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:  # xs: [T, B, F]
        h = xs.new_zeros(xs.shape[1], self.state_size)
        c = xs.new_zeros(xs.shape[1], self.state_size)
        for x in xs:
            h, c = self.cell(x, (h, c))
        return self.head(h)


def train(model: Model, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float, sync: Callable[[], None]) -> tuple[list[float], float]:
    """Adam over the batches; the loss of every step and the seconds per step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    sync()
    start = time.perf_counter()
    for xs, y in batches:
        loss = F.mse_loss(model(xs), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    sync()
    return losses, (time.perf_counter() - start) / max(len(batches), 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, help="default 33 on the CPU, 16 on a GPU")
    p.add_argument("--features", type=int, help="default 13 on the CPU, 32 on a GPU")
    p.add_argument("--state", type=int, help="default 37 on the CPU, 128 on a GPU")
    p.add_argument("--seq", type=int, default=6, help="sequence length (default 6)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, help="loss curves' relative tolerance (default 1e-4 in float32, 1e-10 in float64)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and opforge.library is not None and opforge.library.with_cuda):
        print("lltm: --device cuda needs a GPU and an op library built with CUDA kernels", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    B = args.batch or (16 if gpu else 33)
    F_ = args.features or (32 if gpu else 13)
    S = args.state or (128 if gpu else 37)
    T, out_features = args.seq, 5
    rtol = args.rtol if args.rtol is not None else (1e-4 if dtype == torch.float32 else 1e-10)
    print(f"device: {device.type}, dtype: {args.dtype}, batch {B}, input_features {F_}, state_size {S}, sequence {T}, steps {args.steps}")

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    # A fixed data set of 16 batches, visited in a fixed random order: both
    # models see exactly the same inputs at every step.
    n_seqs = 16 * B
    xs = torch.randn(T, n_seqs, F_, generator=gen)
    mix = torch.randn(F_, out_features, generator=gen) / math.sqrt(F_)
    ys = torch.tanh(xs.cumsum(0)[-1] @ mix / math.sqrt(T))
    order = torch.randint(0, 16, (args.steps,), generator=gen).tolist()
    xs, ys = xs.to(device, dtype), ys.to(device, dtype)
    batches = [(xs[:, k * B : (k + 1) * B], ys[k * B : (k + 1) * B]) for k in order]

    ours = Model(opforge.nn.LLTM(F_, S), S, out_features).to(device, dtype)
    ref = Model(ReferenceLLTM(F_, S), S, out_features).to(device, dtype)
    ref.load_state_dict(ours.state_dict())

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    losses_ours, step_ours = train(ours, batches, args.lr, sync)
    losses_ref, step_ref = train(ref, batches, args.lr, sync)

    print(f"\n{'step':>5}  {'opforge loss':>13}  {'reference loss':>14}  {'rel diff':>9}")
    every = max(1, args.steps // 12)
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses_ours, losses_ref, strict=True)]
    for i in sorted({*range(0, args.steps, every), args.steps - 1}):
        print(f"{i + 1:>5}  {losses_ours[i]:>13.6f}  {losses_ref[i]:>14.6f}  {rel[i]:>9.2e}")
    print(
        f"\ntime per step: opforge {step_ours * 1e3:.2f} ms, reference {step_ref * 1e3:.2f} ms (forward, backward and Adam, {T} cell steps)"
    )

    failures = []
    k = max(1, min(10, args.steps // 10))
    first, last = sum(losses_ours[:k]) / k, sum(losses_ours[-k:]) / k
    # Over a few steps the loss need only fall; over a few hundred it must halve.
    want = 0.5 * first if args.steps >= 100 else first
    ok = last < want
    verdict = "ok" if ok else "FAILED"
    print(f"check: opforge's loss fell from {first:.4f} to {last:.4f} (mean of the first and last {k} steps; want < {want:.4f}): {verdict}")
    if not ok:
        failures.append("loss did not fall")
    worst = max(range(len(rel)), key=rel.__getitem__)
    ok = rel[worst] <= rtol
    print(f"check: loss curves match within rtol {rtol:g} (worst {rel[worst]:.2e} at step {worst + 1}): {'ok' if ok else 'FAILED'}")
    if not ok:
        failures.append("loss curves differ")
    with torch.no_grad():
        drift = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    print(f"final parameters: max |opforge - reference| = {drift:.2e}")

    if failures:
        print(f"lltm: FAILED: {', '.join(failures)}")
        return 1
    print("lltm: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
