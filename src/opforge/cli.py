"""The ``opforge`` command: build, list, check and benchmark operators."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Tables are wide: when output is piped (CI logs), rich would assume 80 columns.
_WIDTH = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
out = Console(width=_WIDTH)
err = Console(stderr=True)


def _library():  # noqa: ANN202
    """The op library, built and loaded; a build failure is a message, not a traceback."""
    import opforge
    from opforge.build import BuildError

    try:
        return opforge.load()
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        raise SystemExit(1) from None


def _device(name: str):  # noqa: ANN202 - torch imported lazily
    import torch

    _library()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("opforge: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
        if not _library().with_cuda:
            raise SystemExit("opforge: --device cuda but the op library was built without CUDA kernels (no nvcc, or OPFORGE_BUILD_CUDA=0)")
    return torch.device(name)


def _specs(names: Sequence[str]):  # noqa: ANN202
    from opforge.spec import get_specs

    _library()
    try:
        return get_specs(names)
    except KeyError as exc:
        raise SystemExit(f"opforge: {exc.args[0]}") from None


def _seed(seed: int | None) -> int:
    return random.SystemRandom().randrange(2**31) if seed is None else seed


def cmd_build(args: argparse.Namespace) -> int:
    lib = _library()
    how = f"built now in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
    out.print(f"op library: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="opforge operators")
    table.add_column("operator")
    table.add_column("schema")
    table.add_column("autograd")
    for spec in _specs([]):
        table.add_row(spec.qualname, str(spec.schema), "yes" if spec.differentiable else "")
    out.print(table)
    return 0


def run_check(names: Sequence[str], device_name: str, seed: int | None, checks: Sequence[str]) -> bool:
    from opforge.check import check_op

    device = _device(device_name)
    seed = _seed(seed)
    specs = _specs(names)
    err.print(f"opforge check on {device}, seed {seed} (rerun with --seed {seed})")
    table = Table(title=f"opforge check ({device}, seed {seed})")
    table.add_column("operator")
    for c in checks:
        table.add_column(c, justify="center")
    failures: list[str] = []
    n_pass = n_fail = 0
    for spec in specs:
        with err.status(f"checking {spec.name}"):
            results = check_op(spec, device, seed, checks)
        cells = []
        for r in results:
            if r.status == "pass":
                n_pass += 1
                cells.append(f"[green]pass[/] ({r.count})")
            elif r.status == "n/a":
                cells.append(f"[dim]n/a[/] [dim]{r.note}[/]")
            else:
                n_fail += 1
                cells.append(f"[bold red]FAIL[/] ({len(r.failures)}/{r.count})")
                failures += [f"{r.check}: {f}" for f in r.failures[:5]]
                if len(r.failures) > 5:
                    failures.append(f"{r.check}: ... {len(r.failures) - 5} more")
        table.add_row(spec.qualname, *cells)
    out.print(table)
    for f in failures:
        out.print(f"[red]x[/] {f}", highlight=False)
    out.print(f"{n_pass} passed, {n_fail} failed")
    return n_fail == 0


def cmd_check(args: argparse.Namespace) -> int:
    checks = args.checks.split(",") if args.checks else None
    from opforge.check import CHECKS

    for c in checks or ():
        if c not in CHECKS:
            raise SystemExit(f"opforge: unknown check {c!r}; choose from {', '.join(CHECKS)}")
    return 0 if run_check(args.ops, args.device, args.seed, checks or CHECKS) else 1


def _fmt_us(t) -> str:  # noqa: ANN001
    return f"{t.median_us:,.1f}" if t else "-"


def run_bench(
    names: Sequence[str], device_name: str, seed: int | None, dtypes: Sequence[str], budget: float, json_path: Path | None
) -> bool:
    import torch

    from opforge.bench import bench_op, new_report, write_json

    device = _device(device_name)
    seed = _seed(seed)
    torch_dtypes = [getattr(torch, d) for d in dtypes]
    report = new_report(device)
    with err.status("benchmarking") as status:
        for spec in _specs(names):
            report.rows += bench_op(
                spec, device, seed=seed, dtypes=torch_dtypes, budget_s=budget, progress=lambda m: status.update(f"benchmarking {m}")
            )
    table = Table(title=f"opforge bench: {report.device_name} ({device}, torch {report.torch_version}, {report.threads} threads)")
    for col, just in [
        ("operator", "left"),
        ("dtype", "left"),
        ("size", "left"),
        ("opforge us", "right"),
        ("torch us", "right"),
        ("speedup", "right"),
        ("opforge GB/s", "right"),
        ("torch GB/s", "right"),
    ]:
        table.add_column(col, justify=just)
    refused = False
    for r in report.rows:
        if r.status != "ok":
            refused = True
            table.add_row(r.op, r.dtype, r.case, f"[red]{r.status}[/]", "", "", "", "")
            continue
        sp = r.speedup or 0.0
        colour = "green" if sp >= 1.0 else "yellow"
        table.add_row(
            r.op,
            r.dtype,
            r.case,
            _fmt_us(r.opforge),
            _fmt_us(r.torch),
            f"[{colour}]{sp:.2f}x[/]",
            f"{r.gbps(r.opforge):,.1f}",
            f"{r.gbps(r.torch):,.1f}",
        )
    out.print(table)
    out.print("times are medians per call; GB/s = bytes the op must move (its cost model) / time")
    if json_path:
        write_json(report, json_path)
        out.print(f"wrote {json_path}")
    return not refused


def cmd_bench(args: argparse.Namespace) -> int:
    dtypes = args.dtype.split(",")
    return 0 if run_bench(args.ops, args.device, args.seed, dtypes, args.budget, args.json) else 1


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: build, check, benchmark, print the tables."""
    cmd_build(args)
    from opforge.check import CHECKS

    ok = run_check(args.ops, args.device, args.seed, CHECKS)
    ok = run_bench(args.ops, args.device, args.seed, ["float32", "float16", "bfloat16"], args.budget, args.json) and ok
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opforge", description="Build, check and benchmark custom PyTorch operators.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("ops", nargs="*", help="operators (default: all)")
        sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if a GPU is visible, else cpu")
        sp.add_argument("--seed", type=int, default=None, help="random seed (default: fresh, printed)")

    sp = sub.add_parser("build", help="build (or find in the cache) the op library and say where it is")
    sp.set_defaults(fn=cmd_build)
    sp = sub.add_parser("list", help="list the operators and their schemas")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser("check", help="verify operators: reference, opcheck, gradcheck, torch.compile, bad inputs")
    common(sp)
    sp.add_argument("--checks", default=None, help="comma-separated subset of: reference,opcheck,gradcheck,compile,bad inputs")
    sp.set_defaults(fn=cmd_check)
    for name, helptext, fn in [
        ("bench", "time operators against their PyTorch reference", cmd_bench),
        ("run", "the main job: build, check and benchmark every operator", cmd_run),
    ]:
        sp = sub.add_parser(name, help=helptext)
        common(sp)
        if name == "bench":
            sp.add_argument("--dtype", default="float32,float16,bfloat16", help="comma-separated dtypes")
        sp.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case and side (default 0.3)")
        sp.add_argument("--json", type=Path, default=None, help="write every figure, with device and versions, to this file")
        sp.set_defaults(fn=fn)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
