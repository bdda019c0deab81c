"""The ``opforge`` command: build, list, check and benchmark operators.

The parser is built here; each command group lives in its own module
(build, check, bench, cache, new), with the operands resolved by
:mod:`opforge.cli.targets` and printed through :mod:`opforge.cli.render`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from opforge import __version__
from opforge.builder.child import end_children
from opforge.cli import abi, doctor, profile
from opforge.cli.args import (
    Parser,
    bench_json,
    days,
    dtype_list,
    existing_file,
    output_file,
    positive_seconds,
    seed,
    seed_count,
    usage_error,
)
from opforge.cli.bench import BenchOptions, bench_ops, cmd_bench, cmd_run, run_bench, write_outputs
from opforge.cli.build import build_folder, build_project, cmake_definition, cmd_build, print_library
from opforge.cli.cache import cmd_cache_clean, cmd_cache_list
from opforge.cli.check import check_failures, check_ops, cmd_check, cmd_list, run_check
from opforge.cli.new import cmd_new
from opforge.cli.render import bench_table, err, out, print_comparison
from opforge.cli.targets import device_and_specs, fast_path_for_packages, forget_loaded, library, pick_device, resolve_targets, specs_of

__all__ = [
    "BenchOptions",
    "bench_ops",
    "bench_table",
    "build_folder",
    "build_parser",
    "build_project",
    "check_failures",
    "check_ops",
    "device_and_specs",
    "dtype_list",
    "err",
    "existing_file",
    "fast_path_for_packages",
    "library",
    "main",
    "out",
    "pick_device",
    "positive_seconds",
    "print_comparison",
    "print_library",
    "resolve_targets",
    "run_bench",
    "run_check",
    "specs_of",
    "usage_error",
    "write_outputs",
]


def _version() -> str:
    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, every subcommand's included."""
    p = Parser(prog="opforge", description="Build, check and benchmark custom PyTorch operators.")
    p.add_argument("--version", action="version", version=f"opforge {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("ops", nargs="*",
                        help="operators, package directories of opforge new's given as paths (./my_op, my_op/: their "
                             "operators), or spec files (my_specs.py: the operators its SPECS list, opforge.spec(...) of "
                             "operators already in torch.ops); default: all")  # fmt: skip
        sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if a GPU is visible, else cpu")
        sp.add_argument("--seed", type=seed, default=None, help="random seed, 0 to 2^63 - 1 (default: fresh, printed)")

    def isolation(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--time-limit", type=positive_seconds, default=None, metavar="SECONDS",
                        help="the checks run in a process of their own: a step (one call of an operator on one sample) "
                             "still running after this long is reported and killed, and the checks go on "
                             "(default 300; at most a day)")  # fmt: skip
        sp.add_argument("--in-process", action="store_true",
                        help="run the checks in this process (for a debugger); a kernel that crashes then ends the command")  # fmt: skip

    sp = sub.add_parser("build", help="build (or find in the cache) the op library, or a folder of yours, and say where it is",
                        description="Builds opforge's op library, or the folder PATH. Building a folder runs its code, as "
                                    "pip install would: its setup.py, the __init__.py of a package imported after the build, "
                                    "a CMakeLists.txt (execute_process...), and the C++ static initializers of what was "
                                    "built. Build only folders you trust; --dry-run shows the plan and runs none of it.")  # fmt: skip
    sp.add_argument("path", nargs="?", type=Path, default=None,
                    help="a folder of your sources, in any layout: sources and headers in any subfolder, a package "
                         "importing _C, a pybind11 module, a setup.py or a CMakeLists.txt; what it finds is printed "
                         "first (default: opforge's own op library). Its code runs (see above)")  # fmt: skip
    sp.add_argument("--route", choices=["auto", "setup.py", "jit", "inline", "setuptools", "pybind", "cmake", "package"], default="auto",
                    help="auto (default): the one the folder calls for; setup.py: the extensions its setup.py declares, read "
                         "by running it with setup() replaced (its other code runs) and built in place as build_ext "
                         "--inplace would; TORCH_LIBRARY ops "
                         "by jit (cached ninja build), inline (the files as strings) or setuptools (build_ext, as pip "
                         "install); pybind: a "
                         "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) module; cmake: its CMakeLists.txt; package: a "
                         "package importing _C, its library built in place as <package>/_C<EXT_SUFFIX>")  # fmt: skip
    sp.add_argument("--all-archs", action="store_true",
                    help="a setup.py's CUDA extensions for every arch it asks for (-gencode flags, TORCH_CUDA_ARCH_LIST), "
                         "as a wheel needs; default: only the archs of this machine's GPUs, where every GPU here is "
                         "among them (also OPFORGE_ALL_ARCHS=1)")  # fmt: skip
    sp.add_argument("--dry-run", action="store_true",
                    help="print what was found and the plan (route, extensions, sources, flags, output) and stop: "
                         "nothing is compiled, and no code of the folder runs (a setup.py is parsed, not run)")  # fmt: skip
    sp.add_argument("-D", dest="defines", action="append", type=cmake_definition, default=[], metavar="NAME=VALUE",
                    help="a CMake cache definition for the cmake route, as cmake -D takes it (NAME=VALUE or "
                         "NAME:TYPE=VALUE; repeatable, also -DNAME=VALUE): -D ENABLE_CUDA=OFF. Each set of definitions "
                         "is a build of its own. An error on another route: a macro of the C++ sources is "
                         "OPFORGE_CXXFLAGS=-DNAME=VALUE")  # fmt: skip
    sp.set_defaults(fn=cmd_build)
    sp = sub.add_parser("new", help="scaffold an operator package: C++/CUDA kernels, schema, spec, tests, pyproject.toml")
    sp.add_argument("name", help="the operator's name, also the Python package's (an identifier such as my_op)")
    sp.add_argument("--dir", type=Path, default=None, help="where to write it (default: ./NAME); must not exist or be empty")
    sp.add_argument("--namespace", default=None, help="its torch.ops namespace (default: NAME)")
    sp.add_argument("--no-cuda", action="store_true", help="a CPU kernel only, no CUDA kernel")
    sp.add_argument("--backward", action="store_true", help="with an autograd formula (backward), checked by gradcheck")
    sp.add_argument(
        "--stable-abi", action="store_true", help="C++ on PyTorch's stable ABI: one build loads in every torch from --torch-min on"
    )
    sp.add_argument("--torch-min", default=None, metavar="X.Y", help="with --stable-abi: the oldest torch to target (default 2.10)")
    sp.set_defaults(fn=cmd_new)
    sp = sub.add_parser("list", help="list the operators and their schemas")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser(
        "check", help="verify operators: reference, opcheck, gradcheck, gradgradcheck, torch.compile, export, bad inputs, sharding"
    )
    common(sp)
    sp.add_argument(
        "--checks",
        default=None,
        help="comma-separated subset of: reference,opcheck,gradcheck,gradgradcheck,compile,export,bad inputs,sharding",
    )
    sp.add_argument("--seeds", type=seed_count, default=1, help="K fresh seeds per sample for the reference check, 1 to 1000 (default 1)")
    sp.add_argument("--report", action="store_true", help="the worst error per case, not per dtype")
    sp.add_argument(
        "--reference-on",
        choices=("device", "cpu"),
        default="device",
        help="where the float64 reference runs (default: the checked device; profile --sanitize uses cpu)",
    )
    isolation(sp)
    sp.set_defaults(fn=cmd_check)
    for name, helptext, fn in [
        ("bench", "time operators against their PyTorch reference", cmd_bench),
        ("run", "the main job: build, check every operator, time each in its largest case; one summary table", cmd_run),
    ]:
        sp = sub.add_parser(name, help=helptext)
        common(sp)
        run = name == "run"
        if run:
            isolation(sp)
            sp.add_argument("--full", action="store_true",
                            help="every case of the sweeps (and their plot, as --sweep), every dtype, the torch.compile "
                                 "baseline on the CPU too (tens of minutes there)")  # fmt: skip
            sp.add_argument("--dtype", default=None, type=dtype_list,
                            help="comma-separated dtypes (default: float32 on the CPU; on a GPU each op's first dtype "
                                 "and bfloat16)")  # fmt: skip
        else:
            sp.add_argument("--dtype", default="float32,float16,bfloat16", type=dtype_list, help="comma-separated dtypes")
        sp.add_argument("--budget", type=positive_seconds, default=0.3,
                        help="at most this many seconds of timing per case and side, up to a day (default 0.3)")  # fmt: skip
        sp.add_argument("--graph", action="store_true", help="replay each call from a CUDA graph (no launch overhead)")
        sp.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile baseline" + (" (run by default on a GPU only)" if run else ""))  # fmt: skip
        sp.add_argument("--sweep", action="store_true", help="every size the specs declare for sweeps, and a plot")
        sp.add_argument("--case", default=None,
                        help="comma-separated case names to run (e.g. 2^26,2^28 with --sweep); default: "
                        + ("each op's largest" if run else "all"))  # fmt: skip
        sp.add_argument("--remeasure", action="store_true", help="measure the machine's ceilings again")
        sp.add_argument("--json", type=output_file, default=None, help="write every figure, with device and versions, to this file")
        sp.add_argument("--csv", type=output_file, default=None, help="the same as CSV, one line per case and implementation")
        sp.add_argument(
            "--plot",
            type=output_file,
            default=None,
            help="PNG of bandwidth against size, or TFLOP/s per case for compute-bound ops such as gemm "
            "(default with --sweep: opforge-bench-<device>.png)",
        )
        sp.add_argument("--compare", type=bench_json, default=None,
                        help="an earlier --json: ratio per case, regressions flagged (exit 1)")  # fmt: skip
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("cache", help="list or clean the build cache")
    cache_sub = sp.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="entries, sizes, last use").set_defaults(fn=cmd_cache_list)
    sp = cache_sub.add_parser(
        "clean",
        help="remove entries (all, or unused for --older-than days) and failed background builds' logs; builds in progress are kept",
    )
    sp.add_argument("--older-than", type=days, default=None, metavar="DAYS", help="only entries not used for this many days (0 to 36500)")
    sp.set_defaults(fn=cmd_cache_clean)

    abi.register_cli(sub)
    doctor.register_cli(sub)
    profile.register_cli(sub)
    return p


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM, SIGHUP, Ctrl-C: the children (setup.py readers, build workers, the checks' process) end first,
    each with what it started; then the command unwinds as for Ctrl-C."""
    end_children()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    forget_loaded()
    if threading.current_thread() is not threading.main_thread():
        return args.fn(args)
    stops = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    # A signal ignored where the command was started (nohup) stays ignored.
    before = {s: signal.signal(s, _stop) for s in stops if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        return args.fn(args)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
