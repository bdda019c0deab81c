"""The W4A8 table from an `opforge bench qqq_gemm --json` report: per case the
W4A8 kernel against float16 torch.matmul / F.linear of the same (dequantised)
weights, the target speedup per M, the per-group/per-channel ratio,
and the time as a fraction of the weight-read floor (packed bytes at the
measured device copy bandwidth).

    python benchmarks/qqq_summary.py bench.json [--markdown] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# The targets: at least this many times faster than float16 torch.matmul, by M.
TARGETS = {1: 3.0, 16: 3.0, 32: 2.5, 64: 1.8, 128: 1.2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
    p.add_argument("--plot", type=Path, default=None, help="a PNG: time against M per shape, with the float16 baseline and the floor")
    args = p.parse_args(argv)
    d = json.loads(args.report.read_text())
    copy_gbps = (d.get("ceilings") or {}).get("copy_gbps")
    rows = [r for r in d["rows"] if r["op"] == "qqq_gemm" and r["status"] == "ok"]
    by_case: dict[tuple[int, int, int, str], dict] = {}
    for r in rows:
        m = re.match(r"M=(\d+) K=(\d+) N=(\d+) (.+)", r["case"])
        if m:
            by_case[(int(m[1]), int(m[2]), int(m[3]), m[4])] = r
    head = ["K x N", "M", "scheme", "qqq us", "fp16 matmul us", "fp16 linear us", "speedup", "target", "met", "group/channel",
            "% weight floor"]  # fmt: skip
    lines = []
    misses = 0
    for (M, K, N, scheme), r in sorted(by_case.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0], kv[0][3])):
        t = {k: (v or {}).get("median_us") for k, v in r["timings"].items()}
        ours, mm, lin = t.get("opforge"), t.get("fp16 matmul"), t.get("fp16 linear")
        speed = mm / ours if ours and mm else None
        target = TARGETS.get(M)
        met = "-" if speed is None or target is None else ("yes" if speed >= target else "NO")
        misses += met == "NO"
        ratio = "-"
        if scheme != "per channel":
            base = by_case.get((M, K, N, "per channel"))
            if base and base["timings"].get("opforge") and ours:
                ratio = f"{ours / base['timings']['opforge']['median_us']:.2f}"
        floor = 100 * (K * N / 2) / (copy_gbps * 1e3) / ours if copy_gbps and ours else None
        lines.append([f"{K} x {N}", str(M), scheme, f"{ours:.1f}" if ours else "-", f"{mm:.1f}" if mm else "-",
                      f"{lin:.1f}" if lin else "-", f"{speed:.2f}x" if speed else "-", f"{target}x" if target else "-", met, ratio,
                      f"{floor:.0f}%" if floor else "-"])  # fmt: skip
    print(f"qqq_gemm on {d['device_name']}, torch {d['torch_version']}, {d['date'][:10]}, copy {copy_gbps or 0:,.0f} GB/s; "
          "speedup = fp16 torch.matmul time / qqq time")  # fmt: skip
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    print(f"{len(lines)} cases, {misses} below the speedup target")
    if args.plot:
        plot(d, by_case, copy_gbps, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot(d: dict, by_case: dict, copy_gbps: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(K, N) for (_, K, N, _) in by_case})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.6), squeeze=False)
    for ax, (K, N) in zip(axes[0], shapes, strict=True):
        ms = sorted({M for (M, k, n, _) in by_case if (k, n) == (K, N)})

        def series(scheme: str, impl: str, ms: list[int] = ms, K: int = K, N: int = N) -> list[float | None]:
            out = []
            for M in ms:
                r = by_case.get((M, K, N, scheme))
                t = (r or {}).get("timings", {}).get(impl) if r else None
                out.append(t["median_us"] if t else None)
            return out

        ax.plot(ms, series("per channel", "opforge"), "o-", color="tab:red", label="qqq_gemm per channel")
        ax.plot(ms, series("group 128", "opforge"), "s--", color="tab:orange", label="qqq_gemm group 128")
        ax.plot(ms, series("per channel", "fp16 matmul"), "^-", color="tab:blue", label="fp16 torch.matmul")
        target = [mm / TARGETS[M] if mm and M in TARGETS else None for M, mm in zip(ms, series("per channel", "fp16 matmul"), strict=True)]
        ax.plot(ms, target, ":", color="tab:blue", label="target (fp16 / speedup)")
        if copy_gbps:
            ax.axhline(K * N / 2 / (copy_gbps * 1e3), color="black", linestyle="--", linewidth=1, label="weight-read floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(M) for M in ms])
        ax.set_ylim(bottom=0)
        ax.set_title(f"K = {K}, N = {N}", fontsize=9)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("us per call (L2 flushed)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"qqq_gemm (W4A8) vs float16: {d['device_name']}, torch {d['torch_version']}, {d['date'][:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
