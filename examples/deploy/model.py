"""The model the deployment example packages: one LLTM step, a gemm and a W4A8
linear layer, each on an opforge operator (lltm_forward, gemm, qqq_gemm).

    python examples/deploy/model.py model.pt2 [cpu|cuda]

packages it (opforge.export.package) and writes beside the package the inputs
and the eager outputs as raw little-endian arrays, with a line each in
``<package>.io.txt`` (``name dtype d0 d1 ...``), which the C++ runner reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import opforge
import opforge.export
from opforge.nn import LLTM, QQQLinear


class StepModel(nn.Module):
    """h, c = LLTM(x, (h, c)); y = gemm(h, proj); out = W4A8 linear(y)."""

    def __init__(self, features: int = 64, state: int = 64, out_features: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cell = LLTM(features, state)
        self.proj = nn.Parameter(torch.randn(state, state) / state**0.5)
        self.head = QQQLinear.from_linear(nn.Linear(state, out_features), out_dtype=dtype)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, c = self.cell(x, (h, c))
        y = opforge.gemm(h, self.proj)
        return self.head(y), h, c


def example(batch: int = 8, device: str = "cpu") -> tuple[StepModel, tuple[torch.Tensor, ...], dict]:
    """The model, inputs of ``batch`` rows, and a dynamic batch dimension for export."""
    model = StepModel().to(device).eval()
    x = torch.randn(batch, model.cell.input_features, device=device)
    h = torch.randn(batch, model.cell.state_size, device=device)
    c = torch.randn(batch, model.cell.state_size, device=device)
    b = torch.export.Dim("batch", min=2, max=4096)
    return model, (x, h, c), {"x": {0: b}, "h": {0: b}, "c": {0: b}}


def write_arrays(path: Path, named: dict[str, torch.Tensor]) -> None:
    """Each tensor as ``<path>.<name>.bin`` (raw, row-major), listed in ``<path>.io.txt``."""
    lines = []
    for name, t in named.items():
        t = t.detach().contiguous().cpu()
        t.view(torch.uint8).numpy().tofile(f"{path}.{name}.bin") if t.numel() else Path(f"{path}.{name}.bin").write_bytes(b"")
        lines.append(" ".join([name, str(t.dtype).removeprefix("torch."), *map(str, t.shape)]))
    Path(f"{path}.io.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "model.pt2")
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    torch.manual_seed(0)
    model, args, dynamic = example(device=device)
    packaged = opforge.export.package(model, args, path, dynamic_shapes=dynamic)
    with torch.no_grad():
        out = model(*args)
    write_arrays(path, {"x": args[0], "h": args[1], "c": args[2], "out0": out[0], "out1": out[1], "out2": out[2]})
    shims = ", ".join(packaged.shims) or "none"
    print(f"{path}: ops {', '.join(packaged.ops)}; C shims for {shims}; carries {', '.join(packaged.libraries)}")


if __name__ == "__main__":
    main()
