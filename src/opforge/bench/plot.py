"""``opforge bench --plot``: a report's timings drawn against the machine's ceilings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opforge.bench.results import BenchReport, BenchRow, compute_bound


def plot(report: BenchReport, path: Path) -> None:
    """Per op and dtype: bandwidth against size for streaming ops, with the
    measured copy bandwidth as the ceiling; TFLOP/s per case (bars) for
    compute-bound ops, with the measured matmul ceiling of the dtype."""
    # lazy: import time (matplotlib.pyplot, 0.28 s, only for --plot)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: after matplotlib.use("Agg"), which must run before pyplot's import
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.status == "ok"]
    ops = list(dict.fromkeys(r.op for r in rows))
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    if not ops:
        return
    bound = {op: compute_bound([r for r in rows if r.op == op]) for op in ops}
    # Streaming ops share one size axis; a compute-bound op's axis is its cases.
    share = not any(bound.values())
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(4.2 * len(dtypes), 3.0 * len(ops)), squeeze=False, sharex=share)
    styles = {"opforge": ("tab:red", "o"), "eager": ("tab:blue", "s"), "compiled": ("tab:green", "^")}
    for i, op in enumerate(ops):
        flops_axis = bound[op]
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            sel = [r for r in rows if r.op == op and r.dtype == dt]
            if flops_axis:
                _plot_tflops(ax, sel, styles, report.ceilings, dt)  # the spec's order of cases
            else:
                sel.sort(key=lambda r: r.numel)
                for impl, (colour, marker) in styles.items():
                    pts = [(r.numel, r.gbps(impl)) for r in sel if r.gbps(impl)]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), color=colour, marker=marker, markersize=3, label=impl)
                if report.ceilings:
                    ax.axhline(report.ceilings["copy_gbps"], color="black", linestyle="--", linewidth=1, label="copy ceiling")
                ax.set_xscale("log", base=2)
                if j == 0:
                    ax.set_ylabel("GB/s")
                if i == len(ops) - 1:
                    ax.set_xlabel("elements")
            ax.set_title(f"{op} {dt}", fontsize=9)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"opforge bench: {report.device_name}, torch {report.torch_version}, {report.date[:10]}" + (", CUDA graphs" if report.graph else "")
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave the suptitle its own band
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_tflops(
    ax: Any, rows: Sequence[BenchRow], styles: dict[str, tuple[str, str]], ceilings: dict[str, Any] | None, dtype: str
) -> None:
    """Grouped bars: one group per case, one bar per implementation."""
    width = 0.8 / len(styles)
    for k, (impl, (colour, _)) in enumerate(styles.items()):
        heights = [r.tflops(impl) or 0.0 for r in rows]
        ax.bar([x + (k - 1) * width for x in range(len(rows))], heights, width, color=colour, label=impl)
    rate = (ceilings or {}).get("matmul_tflops", {}).get(dtype)
    if rate:
        ax.axhline(rate, color="black", linestyle="--", linewidth=1, label="matmul ceiling")
    ax.set_xticks(range(len(rows)), [r.case for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
