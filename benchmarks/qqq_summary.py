"""Issue 8's table from an `opforge bench qqq_gemm --json` report: per case the
W4A8 kernel against float16 torch.matmul / F.linear of the same (dequantised)
weights, the issue's target speedup per M, the per-group/per-channel ratio,
and the time as a fraction of the weight-read floor (packed bytes at the
measured device copy bandwidth).

    python benchmarks/qqq_summary.py bench.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# Issue 8: at least this many times faster than float16 torch.matmul, by M.
TARGETS = {1: 3.0, 16: 3.0, 32: 2.5, 64: 1.8, 128: 1.2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
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
    print(f"{len(lines)} cases, {misses} below the issue's speedup target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
