"""The LLTM timings: forward and forward+backward of opforge's LLTM
against the plain-PyTorch LLTM in eager mode and under torch.compile, at the
two sizes, the way the tutorial times them (the module's parameters
require grad; the loss is new_h.sum() + new_cell.sum()).

``opforge bench lltm_forward lltm_backward`` times each operator alone (no
autograd); this times what a training step pays, autograd included, which the
bench command cannot yet express. Same timer as ``opforge bench`` (CUDA events,
L2 flushed before each call, median and IQR, stop at 1 % spread or the budget).

    python examples/lltm/bench.py --device cuda                 # both sizes, float32
    python examples/lltm/bench.py --device cuda --graph         # replayed from CUDA graphs
    python examples/lltm/bench.py --device cpu --budget 0.2 --sizes 16,32,128
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import opforge
from opforge.bench import Timer, time_fn
from opforge.ops.lltm import BENCH_SIZES, make_cell, reference_forward
from opforge.opspec import Sample

Fn = Callable[..., Any]


def forward_only(forward: Fn) -> Fn:
    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Any:
        return forward(x, w, b, h, c)[:2]

    return run


def forward_backward(forward: Fn) -> Fn:
    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Any:
        new_h, new_cell = forward(x, w, b, h, c)[:2]
        return torch.autograd.grad(new_h.sum() + new_cell.sum(), (w, b))

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--sizes", action="append", help="B,F,S (repeatable); default the two of the README")
    p.add_argument("--budget", type=float, default=0.3, help="seconds per timing (default 0.3)")
    p.add_argument("--graph", action="store_true", help="replay each call from a CUDA graph")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes] if args.sizes else list(BENCH_SIZES)
    graph = args.graph and device.type == "cuda"
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.dtype}{', CUDA graphs' if graph else ''}")

    impls: dict[str, Fn] = {"opforge": opforge.lltm_forward, "eager": reference_forward}
    if not args.no_compile:
        impls["compiled"] = reference_forward  # compiled per size below
    results: list[dict[str, Any]] = []
    header = (
        f"{'size':<22} {'pass':<17}"
        + "".join(f"{k + ' us':>14}" for k in impls)
        + "".join(f"{'vs ' + k:>12}" for k in impls if k != "opforge")
    )
    print(header)
    for B, F_, S in sizes:
        if "compiled" in impls:
            # Compiled for this size alone (static shapes): compiled once for every size, the
            # second size would get dynamic-shape kernels, a weaker baseline.
            torch._dynamo.reset()
            impls["compiled"] = torch.compile(reference_forward, dynamic=False)
        x, w, b, h, c = make_cell(B, F_, S, dtype, device, gen)
        w, b = w.detach().requires_grad_(), b.detach().requires_grad_()
        sets = [Sample((x, w, b, h, c))]
        for label, wrap in (("forward", forward_only), ("forward+backward", forward_backward)):
            row: dict[str, Any] = {"B": B, "F": F_, "S": S, "dtype": args.dtype, "pass": label, "graph": graph}
            for impl, fwd in impls.items():
                try:
                    row[impl] = time_fn(wrap(fwd), sets, timer, budget_s=args.budget, graph=graph).median_us
                except Exception as exc:  # noqa: BLE001 - report and keep timing the others
                    row[impl] = None
                    print(f"  {impl} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", file=sys.stderr)
            results.append(row)
            ours = row["opforge"]
            line = f"{f'B={B} F={F_} S={S}':<22} {label:<17}" + "".join(f"{row[k]:>14,.1f}" if row[k] else f"{'-':>14}" for k in impls)
            line += "".join(f"{row[k] / ours:>11.2f}x" if row[k] and ours else f"{'-':>12}" for k in impls if k != "opforge")
            print(line)
    if args.json:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "date": date, "results": results}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
