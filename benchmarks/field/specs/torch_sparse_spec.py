"""torch_sparse's ind2ptr (sorted COO rows to CSR row pointers) against searchsorted."""

from collections.abc import Iterator

import torch
import torch_sparse  # noqa: F401  (its import loads the operators)

import opforge
from opforge.opspec import Sample


def _reference(ind: torch.Tensor, m: int) -> torch.Tensor:
    return torch.searchsorted(ind, torch.arange(m + 1, dtype=ind.dtype))


def _rows(n: int, m: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, m, (n,), generator=gen, device=device).sort().values


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for n, m in ((7, 3), (97, 59), (1, 1), (1025, 4)):
        yield Sample((_rows(n, m, device, gen), m), desc=f"{n} rows of {m}")


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    yield Sample((_rows(1 << 20, 1 << 14, device, gen), 1 << 14), desc="2^20 rows of 2^14")


SPECS = [
    opforge.spec(
        torch.ops.torch_sparse.ind2ptr.default,
        reference=_reference,
        samples=_samples,
        bench_cases=_bench,
        dtypes=("int64",),
    )
]
