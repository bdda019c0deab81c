"""Writes docs/performance.md, the measured performance of opforge's operators
and of its build, from the benchmark results committed under benchmarks/results/,
so that no figure on that page is typed by hand.

    python scripts/gen_performance.py           # (re)writes docs/performance.md
    python scripts/gen_performance.py --check   # exits 1, with a diff, when docs/performance.md is stale

Each family of results (a table on the page) reads the newest file matching its
glob in FAMILIES: newest by the date in the file's name, then by the date the
run recorded inside it. Committing a newer result file and rerunning this script
updates the page. Every figure comes from a result file, or is computed from
one (ratios, ranges); the prose beside each table says what bounds the result
and holds no figure of its own. The result files are plain JSON: nothing here
imports torch or opforge, so the check is quick.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"

Json = dict[str, Any]


@dataclass(frozen=True)
class Source:
    """Where one result file of a family is found: the newest file in the results
    directory matching ``glob`` and none of ``exclude``."""

    glob: str
    required: bool = True
    exclude: tuple[str, ...] = ()


# Family -> its result files, in the order the family's table reads them.
FAMILIES: dict[str, tuple[Source, ...]] = {
    "gpu-elementwise": (Source("nvidia-h200_*_elementwise.json"), Source("nvidia-h200_*_fused.json")),
    "gpu-layouts": (Source("nvidia-h200_*_layouts.json"),),
    "cpu-elementwise": (
        Source("cpu-amd-epyc-2threads_*_elementwise.json"),
        Source("cpu-amd-epyc-1thread_*_elementwise.json", required=False),
    ),
    "host-overhead": (Source("host-overhead_nvidia-*.json"), Source("host-overhead_cpu-*.json", required=False, exclude=("*_before.json",))),
    "lltm": (Source("lltm_nvidia-h200_*.json"), Source("lltm-graph_nvidia-h200_*.json", required=False)),
    "gemm": (Source("nvidia-*_gemm.json"),),
    "qqq": (Source("nvidia-*_qqq.json"),),
    "build": (Source("build-speed_cpu-2cores_*.json"),),
}

# The order of the elementwise ops in a table (an op not named here comes after, in its file's order).
OP_ORDER = ("add", "add_out", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward")

# A time is marked (*) when its inter-quartile range is over this fraction of its median:
# a disturbed measurement, to be read with care.
NOISY_SPREAD = 0.2

# What bounds each family's result: static prose, no figure (a test holds it to that).
PROSE: dict[str, str] = {
    "intro": (
        "Every figure on this page is read from a result file committed under "
        "[`benchmarks/results/`](../benchmarks/results/), or computed from one, by `python scripts/gen_performance.py`; "
        "each table names its file and the device, torch version and date of the run. "
        "[`benchmarks/results/README.md`](../benchmarks/results/README.md) says how each file was made. "
        "Committing a newer result file of a family and rerunning the script updates its table."
    ),
    "conventions": (
        "Times are medians per call in microseconds (us), from `opforge bench` unless a table says otherwise: "
        "CUDA events on a GPU, each call after the `L2` cache is flushed by reading a buffer larger than it; the host "
        "clock on the CPU, each call on an input set not read since twice the last-level cache went through it (so its "
        "inputs come from memory, while the code every operator runs stays in cache, as in a model); every case "
        "checked against its reference before it is timed. "
        '"vs eager" (or "vs" any baseline) is the baseline\'s time over opforge\'s: above one, opforge is faster. '
        "GB/s counts the bytes the operator must move by its cost model, so an unfused baseline is charged the same bytes. "
        '"% of limit" is the roofline floor over the time: the bytes at the copy rate the same run measured, '
        "or the FLOPs at its measured matrix-multiply rate, whichever takes longer; a kernel that streams better "
        "than the measured copy passes the limit."
    ),
    "gpu-elementwise": (
        "These operators do next to no arithmetic per byte, so memory bounds them: each must read its inputs and write "
        "its output once, and the copy limit is what the device's own copy reaches on a buffer far larger than its cache. "
        "The fused operators (`axpby` and the backwards) beat eager PyTorch by moving fewer bytes, since eager runs "
        "several kernels with the intermediates going through memory; `torch.compile`, compiled per case with static "
        "shapes, fuses them too, so against it the comparison is kernel against kernel at the same bytes."
    ),
    "gpu-layouts": (
        "A transposed or `channels_last` input is as dense as a contiguous one, only in another order: the kernel keeps "
        "the input's layout for its output and streams the same bytes, so the same copy limit bounds it and its time "
        'should match the contiguous case of the same size ("vs contiguous": the contiguous time over this one).'
    ),
    "cpu-elementwise": (
        "The CPU loops are compiled for `AVX2` and `AVX-512` (all but LLTM's forward) "
        "chosen at run time by what the CPU reports and `ATEN_CPU_CAPABILITY`, as torch chooses its own, and as plain C++, "
        "and split between torch's threads at torch's grain. The copy limit is measured on a buffer larger than the CPU's "
        "caches and these cases are far smaller, so a fraction of that limit says little about them and the table gives "
        "none: their time is the loop's (its vector width, and for `sigmoid` the exponential) and the caches'. The machine "
        "is a shared virtual one whose neighbours move its timings: the ratio to eager, timed in the same run, is the "
        "figure to compare."
    ),
    "host-overhead": (
        "A call on a small tensor is bound by the host, not the GPU: Python, the dispatcher and autograd take longer than "
        "the kernel, whose own duration (from the profiler, per call) is in the device columns. The public functions take "
        "an eager fast path, below autograd when no gradient is needed and recording one node per call when one is; the "
        "same operator called through `torch.ops` goes the dispatcher's whole way. "
        "Measured by `benchmarks/host_overhead.py`: many calls from Python per loop, one synchronisation, the routes "
        "interleaved round by round so that the machine's noise hits them alike, the best round of each."
    ),
    "lltm": (
        "The bench queues each call behind a spin on the GPU that outlasts the host's time to queue the whole call, so "
        "these are the GPU's times from the call's first kernel to its last: host overhead, which bounds a small "
        "training step's wall time, is not in them (the host-overhead table has it). At the small size eager's training "
        "step still leaves the GPU idle between its small kernels; replayed from CUDA graphs its calls take a fraction "
        "of the time, opforge's, fused into fewer kernels, less to gain. At the large size the gate matrix products, which opforge leaves to cuBLAS as eager PyTorch does, take "
        "most of the time, and opforge gains in the fused elementwise work around them. "
        "Measured by `examples/lltm/bench.py` in `float32` (forward, and forward with backward as a training step pays "
        "for it, autograd included), the reference compiled per size; the timer is the bench's."
    ),
    "gemm": (
        "At the large sizes a matrix product is bound by the tensor cores' peak (`float16` and `bfloat16`, on `wgmma` "
        "with TMA) or by the CUDA cores' (`float32`, with TF32 off), as cuBLAS is; "
        '"% of ceiling" compares opforge with the run\'s own `torch.matmul` rate on a large square product. '
        "An operand whose rows are not aligned for TMA is first copied into an aligned workspace, where cuBLAS takes a "
        "slow path; a product with few rows is bound by reading the other operand, and `float32` then splits the "
        "reduction so that every SM has work."
    ),
    "qqq": (
        "At small M a matrix product is bound by reading its weights: `float16` weights against the W4A8 kernel's "
        "packed integer weights (a quarter of the bytes) and its scales. The weight-read floor is the packed weights' "
        "bytes at the run's measured copy rate. No kernel reaches it under this timing, not even one that only reads the "
        "weights: launch and the memory system's ramp-up cost every timed call the same few microseconds "
        "([qqq_notes.md](../benchmarks/qqq_notes.md) measures both), and both sides pay them, so a quarter of the bytes "
        "does not give a quarter of the time. "
        "As M grows the product turns compute-bound and the `float16` tensor cores catch up. "
        '"speedup" is the time of `float16` `torch.matmul` on the same dequantised weights over the W4A8 kernel\'s.'
    ),
    "build": (
        "A cold build is bound by compiling torch's headers: the fast path's Python module (torch's Python headers and "
        "`pybind11`) and every operator's wrapper (one translation unit) compile side by side, so a cold build takes at "
        "least as long as the slower of the two alone; a warm `import opforge` only loads the cached library; a rebuild after one "
        "wrapper changed recompiles the whole wrappers unit. Measured by `python benchmarks/build_speed.py`, each case "
        "a fresh process on an empty cache."
    ),
}

TITLES: dict[str, str] = {
    "gpu-elementwise": "Elementwise on the GPU",
    "gpu-layouts": "Elementwise layouts on the GPU",
    "cpu-elementwise": "Elementwise on the CPU",
    "host-overhead": "Host time per call",
    "lltm": "LLTM",
    "gemm": "GEMM",
    "qqq": "W4A8 qqq_gemm",
    "build": "Build speed",
}


class MissingResult(LookupError):
    """A family's result file is not there: the page cannot be written."""


@dataclass(frozen=True)
class Result:
    path: Path
    data: Json


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _load(path: Path) -> Json:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MissingResult(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise MissingResult(f"{path} is not a JSON object")
    return data


def pick(results: Path, source: Source) -> Result | None:
    """The newest file in ``results`` matching ``source`` (None where there is none and it is optional)."""
    found = [p for p in sorted(results.glob(source.glob)) if p.is_file() and not any(fnmatch.fnmatch(p.name, x) for x in source.exclude)]
    if not found:
        if source.required:
            raise MissingResult(f"no result file in {results} matches {source.glob!r}")
        return None
    loaded = [Result(p, _load(p)) for p in found]

    def newest(r: Result) -> tuple[str, str, str]:
        in_name = _DATE.search(r.path.name)
        return (in_name.group(0) if in_name else "", str(r.data.get("date", "")), r.path.name)

    return max(loaded, key=newest)


# --------------------------------------------------------------- formatting


def fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}%"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def fmt_tflops(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def span(values: Iterable[float | None], fmt: Callable[[float], str], unit: str = "") -> str:
    """'lo-hi' and the unit, of the values as ``fmt`` writes them (one value where both read the same); '-' for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def sentence(text: str) -> str:
    """``text`` with its first letter capitalised (str.capitalize would lower the rest: CUDA, TFLOP/s)."""
    return text[:1].upper() + text[1:]


def _num(x: float) -> str:
    return f"{x:,.0f}"


def _x_num(x: float) -> str:
    return f"{x:.2f}"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]], *, text_columns: int) -> list[str]:
    """A Markdown table: the first ``text_columns`` columns left-aligned, the figures right-aligned."""
    align = ["---" if i < text_columns else "---:" for i in range(len(head))]
    return ["| " + " | ".join(line) + " |" for line in (head, align, *rows)]


# --------------------------------------------------------------- bench reports


def median(row: Json, impl: str) -> float | None:
    t = (row.get("timings") or {}).get(impl)
    return t["median_us"] if t else None


def noisy(row: Json, impl: str) -> bool:
    t = (row.get("timings") or {}).get(impl)
    if not t or not t.get("median_us") or t.get("p25_us") is None or t.get("p75_us") is None:
        return False
    return (t["p75_us"] - t["p25_us"]) / t["median_us"] > NOISY_SPREAD


def time_cell(row: Json, impl: str) -> str:
    return fmt_us(median(row, impl)) + (" (*)" if noisy(row, impl) else "")


def vs(row: Json, baseline: str, ours: str = "opforge") -> float | None:
    """How many times faster ``ours`` is than ``baseline`` in this row."""
    a, b = median(row, ours), median(row, baseline)
    return b / a if a and b else None


def gbps(row: Json, impl: str = "opforge") -> float | None:
    m = median(row, impl)
    return row["bytes"] / (m * 1e3) if m and row.get("bytes") else None


def tflops(row: Json, impl: str = "opforge") -> float | None:
    m = median(row, impl)
    return row["flops"] / (m * 1e6) if m and row.get("flops") else None


def pct_of_limit(row: Json, impl: str = "opforge") -> float | None:
    m = median(row, impl)
    return 100 * row["floor_us"] / m if m and row.get("floor_us") else None


def ok_rows(report: Json) -> list[Json]:
    return [r for r in report.get("rows", []) if r.get("status") == "ok"]


def _op_rank(op: str) -> int:
    return OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER)


def by_op(reports: Sequence[Json]) -> list[Json]:
    """The timed rows of the reports, in OP_ORDER; an op's rows from the first report that has it."""
    taken: dict[str, list[Json]] = {}
    for report in reports:
        mine: dict[str, list[Json]] = {}
        for row in ok_rows(report):
            if row["op"] not in taken:
                mine.setdefault(row["op"], []).append(row)
        taken.update(mine)
    ordered = sorted(taken.items(), key=lambda kv: _op_rank(kv[0]))  # stable: file order among unnamed ops
    return [row for _, rows in ordered for row in rows]


def has_timing(rows: Iterable[Json], impl: str) -> bool:
    return any(median(r, impl) is not None for r in rows)


def elementwise_table(rows: Sequence[Json], *, case_head: str = "size") -> list[str]:
    """op | dtype | case | opforge, eager (and compiled) us | vs eager (vs compiled) | GB/s | % of limit."""
    compiled = has_timing(rows, "compiled")
    head = ["op", "dtype", case_head, "opforge us", "eager us"]
    head += ["compiled us"] if compiled else []
    head += ["vs eager"] + (["vs compiled"] if compiled else []) + ["GB/s", "% of limit"]
    body = []
    for r in rows:
        line = [r["op"], r["dtype"], r["case"], time_cell(r, "opforge"), time_cell(r, "eager")]
        line += [time_cell(r, "compiled")] if compiled else []
        line += [fmt_x(vs(r, "eager"))] + ([fmt_x(vs(r, "compiled"))] if compiled else [])
        line += [fmt_rate(gbps(r)), fmt_pct(pct_of_limit(r))]
        body.append(line)
    return md_table(head, body, text_columns=3)


def per_op_span(rows: Sequence[Json], value: Callable[[Json], float | None], fmt: Callable[[float], str], unit: str = "") -> str:
    """'op lo-hi, op lo-hi, ...' over the rows, in their order."""
    ops: dict[str, list[float | None]] = {}
    for r in rows:
        ops.setdefault(r["op"], []).append(value(r))
    return ", ".join(f"`{op}` {span(vals, fmt, unit)}" for op, vals in ops.items() if any(v is not None for v in vals))


# --------------------------------------------------------------- the page


@dataclass
class Page:
    output: Path

    def link(self, path: Path) -> str:
        rel = os.path.relpath(path, self.output.parent).replace(os.sep, "/")
        return f"[`{path.name}`]({rel})"


def describe(result: Result, page: Page) -> str:
    """The run a result file holds: device, torch, date, commit, with a link to the file."""
    d = result.data
    parts = []
    device = d.get("device_name") or d.get("cpu") or (d.get("device") if d.get("device") not in ("cuda", "cpu") else None)
    device = device or d.get("machine") or "?"
    parts.append(f"{device} (driver {d['driver']})" if d.get("driver") else device)
    if d.get("device") == "cpu" and d.get("threads"):
        parts.append(f"{d['threads']} thread{'s' if d['threads'] != 1 else ''}")
    if d.get("cores"):
        parts.append(f"{d['cores']} cores")
    torch = d.get("torch_version") or d.get("torch")
    if torch:
        parts.append(f"torch {torch}")
    cuda = d.get("cuda_version") or d.get("cuda")
    if cuda:
        parts.append(f"CUDA {cuda}")
    if d.get("date"):
        parts.append(str(d["date"])[:10])
    if d.get("git_commit"):
        parts.append(f"commit `{str(d['git_commit'])[:7]}`")
    text = f"{page.link(result.path)}: {', '.join(parts)}"
    extras = [f"the run warned: {w}" for w in d.get("warnings") or []]
    if d.get("note"):
        extras.append(f"its note: {d['note']}")
    return text + (f" ({'; '.join(extras)})" if extras else "") + "."


def heading(family: str, results: Sequence[Result | None], page: Page) -> list[str]:
    found = [r for r in results if r is not None]
    lines = [f"## {TITLES[family]}", ""]
    if len(found) == 1:
        lines.append("From " + describe(found[0], page))
    else:
        lines += ["From:", ""] + [f"- {describe(r, page)}" for r in found]
    return [*lines, "", PROSE[family], ""]


def gpu_elementwise(results: Sequence[Result | None], page: Page) -> list[str]:
    reports = [r.data for r in results if r is not None]
    rows = by_op(reports)
    copies = [f"{rep['ceilings']['copy_gbps']:,.0f}" for rep in reports if rep.get("ceilings")]
    lines = [
        f"opforge runs at {span(map(pct_of_limit, rows), _num, ' %')} of the copy limit in every row"
        + (f" (the runs measured the copy at {' and '.join(copies)} GB/s)." if copies else "."),
        f"Against eager, per op: {per_op_span(rows, lambda r: vs(r, 'eager'), _x_num, 'x')}.",
    ]
    if has_timing(rows, "compiled"):
        compiled_rows = [r for r in rows if median(r, "compiled") is not None]
        lines.append(f"Against `torch.compile`, per op: {per_op_span(compiled_rows, lambda r: vs(r, 'compiled'), _x_num, 'x')}.")
    # Why a row has no compiled time, as the run recorded it (one sentence per reason).
    why: dict[str, list[str]] = {}
    for r in rows:
        note = (r.get("notes") or {}).get("compiled")
        if median(r, "compiled") is None and note and r["op"] not in why.setdefault(note, []):
            why[note].append(r["op"])
    lines += [f"No compiled time for {', '.join(f'`{op}`' for op in ops)}: {note}." for note, ops in why.items()]
    return [" ".join(lines), "", *elementwise_table(rows)]


def _layout(case: str) -> tuple[str, str]:
    """('transposed', '8192x8192') from 'transposed 8192x8192'; ('contiguous', '2^26') from '2^26'."""
    first, _, rest = case.partition(" ")
    return (first, rest) if rest else ("contiguous", case)


def layouts_table(rows: Sequence[Json]) -> list[str]:
    contiguous = {(r["op"], r["dtype"], r["numel"]): r for r in rows if _layout(r["case"])[0] == "contiguous"}
    head = ["op", "dtype", "layout", "shape", "opforge us", "contiguous us", "vs contiguous", "eager us", "vs eager", "GB/s", "% of limit"]
    body = []
    for r in rows:
        layout, shape = _layout(r["case"])
        if layout == "contiguous":
            continue
        base = contiguous.get((r["op"], r["dtype"], r["numel"]))
        ours, theirs = median(r, "opforge"), median(base, "opforge") if base else None
        versus = theirs / ours if ours and theirs else None
        line = [r["op"], r["dtype"], layout, shape, time_cell(r, "opforge"), time_cell(base, "opforge") if base else "-", fmt_x(versus)]
        line += [time_cell(r, "eager"), fmt_x(vs(r, "eager")), fmt_rate(gbps(r)), fmt_pct(pct_of_limit(r))]
        body.append(line)
    return md_table(head, body, text_columns=4)


def gpu_layouts(results: Sequence[Result | None], page: Page) -> list[str]:
    rows = by_op([r.data for r in results if r is not None])
    strided = [r for r in rows if _layout(r["case"])[0] != "contiguous"]
    contiguous = {(r["op"], r["dtype"], r["numel"]): r for r in rows if _layout(r["case"])[0] == "contiguous"}
    ratios = []
    for r in strided:
        base = contiguous.get((r["op"], r["dtype"], r["numel"]))
        if base and median(r, "opforge") and median(base, "opforge"):
            ratios.append(median(base, "opforge") / median(r, "opforge"))  # type: ignore[operator]
    layouts = list(dict.fromkeys(_layout(r["case"])[0] for r in strided))
    text = (
        f"Over the {' and '.join(f'`{x}`' for x in layouts)} cases opforge runs at {span(map(pct_of_limit, strided), _num, ' %')} "
        f"of the copy limit, at {span(ratios, _x_num, 'x')} its contiguous time of the same size, and "
        f"{span((vs(r, 'eager') for r in strided), _x_num, 'x')} against eager."
    )
    return [text, "", *layouts_table(rows)]


def _threads(report: Json) -> str:
    n = report.get("threads")
    return f"{n} thread{'s' if n != 1 else ''}" if n else "?"


def cpu_elementwise(results: Sequence[Result | None], page: Page) -> list[str]:
    reports = [r.data for r in results if r is not None]
    main_rows = by_op(reports[:1])
    lines = []
    for rep in reports:
        rows = by_op([rep])
        copy = (rep.get("ceilings") or {}).get("copy_gbps")
        lines.append(
            f"With {_threads(rep)}, against eager per op: {per_op_span(rows, lambda r: vs(r, 'eager'), _x_num, 'x')}; "
            f"opforge moves {span(map(gbps, rows), _num, ' GB/s')}" + (f", the copy limit measured {copy:,.1f} GB/s." if copy else ".")
        )
    # Runs of the same cases go side by side in one table, a set of columns per run; any other run gets its own table.
    keys = [(r["op"], r["dtype"], r["case"]) for r in main_rows]
    runs: list[tuple[Json, list[Json]]] = [(reports[0], main_rows)]
    apart: list[tuple[Json, list[Json]]] = []
    for rep in reports[1:]:
        rows = by_op([rep])
        (runs if [(r["op"], r["dtype"], r["case"]) for r in rows] == keys else apart).append((rep, rows))
    head = ["op", "dtype", "case"]
    for rep, _ in runs:
        t = _threads(rep)
        head += [f"opforge us, {t}", f"eager us, {t}", f"vs eager, {t}"]
    body = []
    for i, r in enumerate(main_rows):
        line = [r["op"], r["dtype"], r["case"]]
        for _, rows in runs:
            line += [time_cell(rows[i], "opforge"), time_cell(rows[i], "eager"), fmt_x(vs(rows[i], "eager"))]
        body.append(line)
    out = [" ".join(lines), "", *md_table(head, body, text_columns=3)]
    for rep, rows in apart:
        out += ["", f"With {_threads(rep)}:", "", *elementwise_table(rows, case_head="case")]
    return out


def host_overhead(results: Sequence[Result | None], page: Page) -> list[str]:
    out: list[str] = []
    for result in results:
        if result is None:
            continue
        report = result.data
        table = _host_per_op(report) if any("op" in r for r in report.get("rows", [])) else _host_add(report)
        if out:
            out.append("")
        if len(results) > 1:
            out += [f"{report.get('device') if report.get('device') != 'cpu' else report.get('cpu', 'CPU')}, `{result.path.name}`:", ""]
        out += table
    return out


def _host_per_op(report: Json) -> list[str]:
    """Every elementwise operator, public function against torch's and torch.ops, with and without grad."""
    rows = report.get("rows", [])
    routes = list(dict.fromkeys(k for r in rows for k in r.get("us_per_call", {})))
    device_routes = list(dict.fromkeys(k for r in rows for k in r.get("device_us_per_call") or {}))

    def ratio(r: Json) -> float | None:
        t = r.get("us_per_call") or {}
        return t["torch"] / t["opforge"] if t.get("opforge") and t.get("torch") else None

    head = ["operator", "elements", "requires_grad", "torch's call", *(f"{k} us" for k in routes), "vs torch"]
    head += [f"{k} device us" for k in device_routes]
    body = []
    for r in rows:
        line = [f"`{r['op']}`", f"{r['n']:,}", str(r["requires_grad"]).lower(), f"`{r.get('torch_equivalent', '')}`"]
        line += [f"{r['us_per_call'][k]:,.2f}" if k in r["us_per_call"] else "-" for k in routes]
        line.append(fmt_x(ratio(r)))
        dev = r.get("device_us_per_call") or {}
        line += [f"{dev[k]:.3f}" if k in dev else "-" for k in device_routes]
        body.append(line)
    plain = [ratio(r) for r in rows if not r["requires_grad"]]
    grad = [ratio(r) for r in rows if r["requires_grad"]]
    clock = "the thread's CPU time" if report.get("clock") == "thread" else "wall time"
    facts = [f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}"] if report.get("threads") else []
    if report.get("loadavg_before") and report.get("loadavg_after"):
        facts.append(f"load average {report['loadavg_before'][0]:.1f} before the run and {report['loadavg_after'][0]:.1f} after")
    text = (
        f"Host time per call, the public function against torch's own: {span(plain, _x_num, 'x')} without a gradient, "
        f"{span(grad, _x_num, 'x')} with `requires_grad` (over 1x: faster than torch). Timed by {clock}, the best of "
        f"{report.get('rounds', '?')} interleaved rounds of {report.get('calls_per_round', 0):,} calls per route"
        + (f"; {', '.join(facts)}" if facts else "")
        + "."
    )
    return [text, "", *md_table(head, body, text_columns=4)]


def _host_add(report: Json) -> list[str]:
    """The older format: opforge.add against torch.add only."""
    rows = report.get("rows", [])
    impls = list(dict.fromkeys(k for r in rows for k in r.get("us_per_call", {})))
    device_impls = list(dict.fromkeys(k for r in rows for k in r.get("device_us_per_call") or {}))

    def ratio(r: Json, where: str = "us_per_call") -> float | None:
        t = r.get(where) or {}
        return t["torch.add"] / t["opforge.add"] if t.get("opforge.add") and t.get("torch.add") else None

    head = ["elements", "requires_grad", *(f"{k} us" for k in impls), "vs torch.add"]
    head += [f"{k} device us" for k in device_impls]
    body = []
    for r in rows:
        line = [f"{r['n']:,}", str(r["requires_grad"]).lower()]
        line += [f"{r['us_per_call'][k]:,.2f}" if k in r["us_per_call"] else "-" for k in impls]
        line.append(fmt_x(ratio(r)))
        dev = r.get("device_us_per_call") or {}
        line += [f"{dev[k]:.3f}" if k in dev else "-" for k in device_impls]
        body.append(line)
    calls = report.get("calls_per_run")
    plain = [ratio(r) for r in rows if not r["requires_grad"]]
    grad = [ratio(r) for r in rows if r["requires_grad"]]
    text = (
        f"Host time per call, `opforge.add` against `torch.add`: {span(plain, _x_num, 'x')} without a gradient, "
        f"{span(grad, _x_num, 'x')} with `requires_grad`; device time per call "
        f"{span((ratio(r, 'device_us_per_call') for r in rows), _x_num, 'x')}." + (f" Each run makes {calls:,} calls." if calls else "")
    )
    return [text, "", *md_table(head, body, text_columns=2)]


def _lltm_size(r: Json) -> str:
    return f"B={r['B']}, F={r['F']}, S={r['S']}"


def lltm(results: Sequence[Result | None], page: Page) -> list[str]:
    plain = results[0].data["results"] if results[0] else []
    graphs = {(r["B"], r["F"], r["S"], r["dtype"], r["pass"]): r for r in (results[1].data["results"] if results[1] else [])}
    head = ["size", "dtype", "pass", "opforge us", "eager us", "compiled us", "vs eager", "vs compiled"]
    head += ["opforge us, CUDA graphs", "eager us, CUDA graphs"] if graphs else []

    def ratio(r: Json | None, base: str) -> float | None:
        return r[base] / r["opforge"] if r and r.get(base) and r.get("opforge") else None

    body = []
    sentences = []
    for r in plain:
        g = graphs.get((r["B"], r["F"], r["S"], r["dtype"], r["pass"]))
        line = [_lltm_size(r), r["dtype"], r["pass"], fmt_us(r.get("opforge")), fmt_us(r.get("eager")), fmt_us(r.get("compiled"))]
        line += [fmt_x(ratio(r, "eager")), fmt_x(ratio(r, "compiled"))]
        if graphs:
            line += [fmt_us(g.get("opforge")) if g else "-", fmt_us(g.get("eager")) if g else "-"]
        body.append(line)
        if g and r["pass"] == "forward+backward" and r.get("opforge") and g.get("opforge"):
            sentences.append(f"{fmt_us(r['opforge'])} to {fmt_us(g['opforge'])} us at {_lltm_size(r)}")
    text = f"Replayed from CUDA graphs, opforge's forward+backward goes from {' and from '.join(sentences)}." if sentences else ""
    return ([text, ""] if text else []) + md_table(head, body, text_columns=3)


def gemm(results: Sequence[Result | None], page: Page) -> list[str]:
    report = next(r.data for r in results if r is not None)
    rows = ok_rows(report)
    ceilings = (report.get("ceilings") or {}).get("matmul_tflops") or {}
    head = ["dtype", "M x N x K", "opforge us", "torch.matmul us", "opforge TFLOP/s", "torch.matmul TFLOP/s", "% of cuBLAS"]
    head += ["% of ceiling"] if ceilings else []
    body = []
    for r in rows:
        t = tflops(r)
        line = [r["dtype"], r["case"], time_cell(r, "opforge"), time_cell(r, "eager"), fmt_tflops(t), fmt_tflops(tflops(r, "eager"))]
        speed = vs(r, "eager")
        line.append(fmt_pct(100 * speed if speed else None))
        if ceilings:
            peak = ceilings.get(r["dtype"])
            line.append(fmt_pct(100 * t / peak if t and peak else None))
        body.append(line)
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    per_dtype = ", ".join(
        f"`{d}` {span((100 * v if (v := vs(r, 'eager')) else None for r in rows if r['dtype'] == d), _num, ' %')}" for d in dtypes
    )
    text = f"opforge's speed as a share of cuBLAS's (`torch.matmul`), per dtype: {per_dtype}."
    if ceilings:
        text += " The run measured `torch.matmul` at " + ", ".join(f"{v:,.1f} TFLOP/s in `{k}`" for k, v in ceilings.items()) + "."
    return [text, "", *md_table(head, body, text_columns=2)]


_QQQ_CASE = re.compile(r"M=(\d+) K=(\d+) N=(\d+) (.+)")


def qqq(results: Sequence[Result | None], page: Page) -> list[str]:
    report = next(r.data for r in results if r is not None)
    copy = (report.get("ceilings") or {}).get("copy_gbps")
    cases: dict[tuple[int, int], dict[int, dict[str, Json]]] = {}
    schemes: list[str] = []
    for r in ok_rows(report):
        m = _QQQ_CASE.match(r["case"])
        if not m:
            continue
        M, K, N, scheme = int(m[1]), int(m[2]), int(m[3]), m[4]
        cases.setdefault((K, N), {}).setdefault(M, {})[scheme] = r
        if scheme not in schemes:
            schemes.append(scheme)
    # The per-channel scheme first: the others are read against it.
    schemes.sort(key=lambda s: s != "per channel")
    base = schemes[0] if schemes else "per channel"
    head = ["K x N", "M", *(f"{s} us" for s in schemes), "fp16 matmul us", *(f"speedup, {s}" for s in schemes)]
    head += [f"{s} / {base}" for s in schemes[1:]] + ([f"{base}: % of weight floor"] if copy else [])
    body = []
    speeds: dict[tuple[str, int], list[float | None]] = {}
    floors: list[float | None] = []
    for (K, N), by_m in cases.items():
        for M in sorted(by_m):
            row = by_m[M]
            ref = row.get(base) or next(iter(row.values()))
            line = [f"{K} x {N}", str(M)]
            line += [time_cell(row[s], "opforge") if s in row else "-" for s in schemes]
            line.append(time_cell(ref, "fp16 matmul"))
            for s in schemes:
                v = vs(row[s], "fp16 matmul") if s in row else None
                speeds.setdefault((s, M), []).append(v)
                line.append(fmt_x(v))
            for s in schemes[1:]:
                ours, theirs = median(row.get(s) or {}, "opforge"), median(row.get(base) or {}, "opforge")
                line.append(f"{ours / theirs:.2f}" if ours and theirs else "-")
            if copy:
                t = median(row.get(base) or {}, "opforge")
                floor = 100 * (K * N / 2) / (copy * 1e3) / t if t else None  # packed weights: two per byte
                floors.append(floor)
                line.append(fmt_pct(floor))
            body.append(line)
    ms = sorted({M for by_m in cases.values() for M in by_m})
    sentences = [
        f"{s} " + ", ".join(f"{span(speeds.get((s, M), []), _x_num, 'x')} at M = {M}" for M in ms if speeds.get((s, M))) for s in schemes
    ]
    text = "Speedup over `float16` `torch.matmul`: " + "; ".join(sentences) + "."
    if copy:
        text += (
            f" {sentence(base)}, the kernel runs at {span(floors, _num, ' %')} of the weight-read floor "
            f"(the run measured the copy at {copy:,.0f} GB/s)."
        )
    return [text, "", *md_table(head, body, text_columns=2)]


def build(results: Sequence[Result | None], page: Page) -> list[str]:
    report = next(r.data for r in results if r is not None)
    body = [[r["case"], fmt_s(r["seconds"])] for r in report.get("rows", [])]
    out = md_table(["case", "seconds"], body, text_columns=1)
    facts = []
    if report.get("jobs"):
        facts.append(f"compile jobs: {report['jobs']}")
    facts.append("CUDA kernels built" if report.get("cuda_kernels_built") else "no CUDA kernels")
    loads = [c["load_before"] for c in report.get("cold_runs", []) if c.get("load_before") is not None]
    load = [f"{span(loads, lambda x: f'{x:.1f}')} before each cold build"] if loads else []
    if report.get("load_average_after") is not None:
        load.append(f"{report['load_average_after']:.1f} after the run")
    if load:
        facts.append(f"load average {', '.join(load)}")
    text = [f"{sentence('; '.join(facts))}.", ""]
    per = report.get("per_file")
    if per:
        # A generated unit lives in the run's temporary build directory: its name is what says what it is.
        units = [[f"`{Path(u['file']).name if Path(u['file']).is_absolute() else u['file']}`", fmt_s(u["seconds"])]
                 for u in per.get("translation_units", [])]  # fmt: skip
        units += [[f"precompiled header ({p['size_mb']:,.1f} MB)", fmt_s(p["seconds"])] for p in per.get("precompiled_headers", [])]
        if per.get("link") is not None:
            units.append(["link", fmt_s(per["link"])])
        out += ["", "Each translation unit compiled alone:", "", *md_table(["unit", "seconds"], units, text_columns=1)]
    return text + out


RENDER: dict[str, Callable[[Sequence[Result | None], Page], list[str]]] = {
    "gpu-elementwise": gpu_elementwise,
    "gpu-layouts": gpu_layouts,
    "cpu-elementwise": cpu_elementwise,
    "host-overhead": host_overhead,
    "lltm": lltm,
    "gemm": gemm,
    "qqq": qqq,
    "build": build,
}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def render(results_dir: Path = RESULTS, output: Path = DOC) -> str:
    """The text of docs/performance.md."""
    page = Page(output)
    picked = {family: [pick(results_dir, s) for s in sources] for family, sources in FAMILIES.items()}
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `python scripts/gen_performance.py` from the result files in benchmarks/results/: do not edit by hand.",
        "     tests/test_performance_doc.py fails when this file is stale. -->",
        "",
        PROSE["intro"],
        "",
        PROSE["conventions"] + f" (*) marks a time whose inter-quartile range is over {NOISY_SPREAD:.0%} of its median.",
        "",
        *(f"- [{TITLES[f]}](#{_slug(TITLES[f])})" for f in FAMILIES),
    ]
    for family in FAMILIES:
        lines += ["", *heading(family, picked[family], page), *RENDER[family](picked[family], page)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write docs/performance.md from the committed benchmark results.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff when docs/performance.md is stale")
    p.add_argument("--output", type=Path, default=DOC, help=f"where to write (default {DOC.relative_to(ROOT)})")
    p.add_argument("--results", type=Path, default=RESULTS, help=f"the result files (default {RESULTS.relative_to(ROOT)})")
    args = p.parse_args(argv)
    try:
        text = render(args.results, args.output)
    except MissingResult as exc:
        print(f"gen_performance: {exc}", file=sys.stderr)
        return 2
    if args.check:
        old = args.output.read_text() if args.output.is_file() else ""
        if old == text:
            print(f"{args.output} is up to date")
            return 0
        diff = list(
            difflib.unified_diff(
                old.splitlines(keepends=True), text.splitlines(keepends=True), f"{args.output} (committed)", f"{args.output} (generated)"
            )
        )
        sys.stdout.writelines(diff)
        changed = sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")))
        print(f"\n{args.output} is stale ({changed} lines differ): run python scripts/gen_performance.py", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
