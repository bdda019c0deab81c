"""opforge profile: ncu's CSV and compute-sanitizer's reports parsed, the command
lines it builds, case selection, and a clear exit 2 where the GPU or a tool is
missing. The samples below are what ncu 2025.3 and compute-sanitizer 2025.3
print on an H200 (trimmed); the end-to-end runs are marked cuda."""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from opforge.cli import profile as profile_cli
from opforge.opspec import Sample
from opforge.profile import run as profile
from opforge.profile.run import (
    METRICS,
    CaseInfo,
    case_infos,
    find_tool,
    ncu_command,
    parse_ncu_csv,
    parse_sanitizer_summary,
    profile_op,
    sanitize_op,
    sanitizer_command,
    select_case,
    short_kernel_name,
)
from opforge.registry import get_specs

_HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)
_ADD = '"0","1102","python3.12","127.0.0.1","void binary_kernel<float, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)","1","7","(256, 1, 1)","(1056, 1, 1)","0","9.0","Command line profiler metrics"'  # noqa: E501
_FILL = '"1","1102","python3.12","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>(int, T2, T3)","1","7","(128, 1, 1)","(2048, 1, 1)","0","9.0","Command line profiler metrics"'  # noqa: E501

# Two launches; the first in ns as ncu 2025 prints it, the second in the older
# spelled-out units with a scaled shared-memory size; noise around the table.
NCU_DETAILS = "\n".join(
    [
        "==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling results may be inconsistent.",
        "==PROF== Connected to process 1102 (/usr/bin/python3.12)",
        "==PROF== Disconnected from process 1102",
        _HEAD,
        f'{_ADD},"dram__throughput.avg.pct_of_peak_sustained_elapsed","%","81.34"',
        f'{_ADD},"gpu__time_duration.sum","ns","201,888"',
        f'{_ADD},"launch__block_size","","256"',
        f'{_ADD},"launch__grid_size","","1,056"',
        f'{_ADD},"launch__registers_per_thread","register/thread","32"',
        f'{_ADD},"launch__shared_mem_per_block_dynamic","byte/block","0"',
        f'{_ADD},"launch__shared_mem_per_block_static","byte/block","0"',
        f'{_ADD},"sm__throughput.avg.pct_of_peak_sustained_elapsed","%","12.81"',
        f'{_ADD},"sm__warps_active.avg.pct_of_peak_sustained_active","%","94.76"',
        "some line the profiled program printed",
        f'{_FILL},"dram__throughput.avg.pct_of_peak_sustained_elapsed","%","1.5"',
        f'{_FILL},"gpu__time_duration.sum","usecond","1,234.5"',
        f'{_FILL},"launch__registers_per_thread","register/thread","16"',
        f'{_FILL},"launch__shared_mem_per_block_static","Kbyte/block","1.02"',
        f'{_FILL},"launch__shared_mem_per_block_dynamic","byte/block","n/a"',
        f'{_FILL},"sm__throughput.avg.pct_of_peak_sustained_elapsed","%","3"',
        f'{_FILL},"sm__warps_active.avg.pct_of_peak_sustained_active","%","44.25"',
        "==PROF== Report: /tmp/r.ncu-rep",
    ]
)

# --page raw: metric names across, a row of units, one row per launch.
NCU_RAW = "\n".join(
    [
        "==PROF== Connected to process 1159 (/usr/bin/python3.12)",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",'
        '"dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__block_size","launch__grid_size",'
        '"launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static",'
        '"sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active"',
        '"","","","","","","","","","","","%","ns","","","register/thread","byte/block","byte/block","%","%"',
        '"0","1159","python3.12","127.0.0.1","void binary_kernel<float, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)",'
        '"1","7","(256, 1, 1)","(1056, 1, 1)","0","9.0","28.29","6,208","256","1,056","32","0","0","16.65","59.28"',
    ]
)

# ncu's own sections (--section SpeedOfLight ...) name metrics by label, and add rule rows.
NCU_SECTIONS = "\n".join(
    [
        _HEAD + ',"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"',
        f'{_ADD.replace("Command line profiler metrics", "GPU Speed Of Light Throughput")},"DRAM Frequency","hz","3,190,226,876.09",',
        f'{_ADD.replace("Command line profiler metrics", "GPU Speed Of Light Throughput")},"DRAM Throughput","%","28.63",',
        f'{_ADD.replace("Command line profiler metrics", "GPU Speed Of Light Throughput")},"Duration","ns","6,112",',
        f'{_ADD.replace("Command line profiler metrics", "SpeedOfLight")},"","","","SOLBottleneck","OPT","This workload exhibits low",'
        '"",""',
        f'{_ADD.replace("Command line profiler metrics", "Launch Statistics")},"Registers Per Thread","register/thread","32",',
        f'{_ADD.replace("Command line profiler metrics", "Occupancy")},"Achieved Occupancy","%","59.63",',
    ]
)


def test_parse_ncu_csv_details_page():
    add, fill = parse_ncu_csv(NCU_DETAILS)
    assert (add.id, fill.id) == (0, 1)
    assert add.name.startswith("void binary_kernel<float, unnamed>::AddOp>(")
    assert add.duration_us == pytest.approx(201.888)
    assert add.metrics["gpu__time_duration.sum"].unit == "us"
    assert add.dram_pct == pytest.approx(81.34) and add.sm_pct == pytest.approx(12.81)
    assert add.occupancy_pct == pytest.approx(94.76)
    assert add.registers == 32 and add.shared_bytes == 0
    assert add.value("launch__grid_size") == 1056 and add.value("launch__block_size") == 256
    assert (add.grid, add.block) == ("(1056, 1, 1)", "(256, 1, 1)")
    # usecond and thousands separators; Kbyte is ncu's 1000 bytes; "n/a" is no value.
    assert fill.duration_us == pytest.approx(1234.5)
    assert fill.shared_bytes == pytest.approx(1020.0)
    assert fill.metrics["launch__shared_mem_per_block_static"].unit == "byte/block"
    assert "launch__shared_mem_per_block_dynamic" not in fill.metrics
    assert fill.block == "(128, 1, 1)"


def test_parse_ncu_csv_raw_page_and_section_labels():
    (k,) = parse_ncu_csv(NCU_RAW)
    assert k.duration_us == pytest.approx(6.208) and k.dram_pct == pytest.approx(28.29)
    assert k.registers == 32 and k.occupancy_pct == pytest.approx(59.28) and k.value("launch__grid_size") == 1056
    (s,) = parse_ncu_csv(NCU_SECTIONS)
    assert s.duration_us == pytest.approx(6.112) and s.dram_pct == pytest.approx(28.63)
    assert s.registers == 32 and s.occupancy_pct == pytest.approx(59.63)


@pytest.mark.parametrize(
    ("unit", "value", "want"),
    [("nsecond", "1,500", 1.5), ("ns", "6,304", 6.304), ("usecond", "3.52", 3.52), ("us", "3.52", 3.52), ("msecond", "1.25", 1250.0)],
)
def test_durations_normalise_to_microseconds(unit, value, want):
    (k,) = parse_ncu_csv(f'{_HEAD}\n{_ADD},"gpu__time_duration.sum","{unit}","{value}"')
    assert k.duration_us == pytest.approx(want)


def test_parse_ncu_csv_without_a_table_is_empty():
    assert parse_ncu_csv("==PROF== Connected to process 1\n==WARNING== No kernels were profiled.\n") == []


def test_short_kernel_names():
    assert short_kernel_name("void binary_kernel<float, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)") == (
        "binary_kernel<float, AddOp>"
    )
    assert short_kernel_name("void opforge::cuda::unary_kernel<__half, opforge::(anonymous namespace)::SigmoidOp>(__half *, long)") == (
        "unary_kernel<__half, SigmoidOp>"
    )
    assert short_kernel_name("oob_write(float *, int)") == "oob_write"
    assert len(short_kernel_name("k<" + "x" * 200 + ">()")) == 72


# compute-sanitizer 2025.3 on a clean run of `opforge check` (the program's own output interleaved).
MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
opforge check (cuda, seed 1)
\u2502 opforge::add \u2502 pass (52) \u2502
1 passed, 0 failed
========= ERROR SUMMARY: 0 errors
"""
# racecheck prints no ERROR SUMMARY, only its own.
RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
1 passed, 0 failed
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at oob_write(float *, int)+0xc0 in bugs.cu:3
=========     by thread (64,0,0) in block (0,0,0)
=========     Access to 0x7efa18800100 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7efa18800000 of size 256 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: main [0x8d40] in bugs_plain
=========
========= Invalid __global__ read of size 2 bytes
=========     at 0x1b0 in void binary_kernel<c10::Half, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)
=========     by thread (3,0,0) in block (7,0,0)
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaDeviceSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: shared_race(float*) [0x932c] in bugs_plain
=========
done
========= ERROR SUMMARY: 3 errors
"""
RACECHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at shared_race(float *)+0xa0 in bugs.cu:6
=========     and Read access at shared_race(float *)+0xb0 in bugs.cu:7 [256 hazards]
=========
========= Error: Race reported between Write access at 0x50 in reduce(float *) and Read access at 0x90 in reduce(float *)
done
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
INITCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, T2, T3)+0x90
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f3f1e800200
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x250 in add.cu:41:add_kernel(float*)
=========
========= Host API memory access error at 0x7f3f1e800200 of size 4 bytes
=========     Uninitialized access at 0x7f3f1e800200 on access by cudaMemcpyAsync source
=========
========= ERROR SUMMARY: 1,234 errors
"""


def test_sanitizer_summary_clean():
    assert parse_sanitizer_summary(MEMCHECK_CLEAN) == (0, [])
    assert parse_sanitizer_summary(RACECHECK_CLEAN) == (0, [])


def test_sanitizer_summary_names_the_kernels():
    errors, kernels = parse_sanitizer_summary(MEMCHECK_ERRORS)
    assert errors == 3
    assert kernels == ["oob_write(float *, int)", "void binary_kernel<c10::Half, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)"]
    errors, kernels = parse_sanitizer_summary(RACECHECK_ERRORS)
    assert errors == 2 and kernels == ["shared_race(float *)", "reduce(float *)"]
    errors, kernels = parse_sanitizer_summary(INITCHECK_ERRORS)
    assert errors == 1234
    assert kernels == [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, T2, T3)",
        "add_kernel(float*)",
        "(cudaMemcpyAsync)",
    ]


def test_sanitizer_summary_missing_means_unfinished():
    assert parse_sanitizer_summary("========= COMPUTE-SANITIZER\nSegmentation fault\n") == (-1, [])


def test_ncu_command_never_touches_clocks_and_profiles_one_call(tmp_path):
    cmd = ncu_command("/x/ncu", "add", "2^20", "float16")
    assert cmd[0] == "/x/ncu"
    pairs = list(itertools.pairwise(cmd))
    assert ("--clock-control", "none") in pairs and ("--profile-from-start", "off") in pairs
    assert "--csv" in cmd and set(cmd[cmd.index("--metrics") + 1].split(",")) == set(METRICS)
    assert cmd[-7:] == [sys.executable, "-m", "opforge.profile", "--run-case", "add", "2^20", "float16"]
    assert "--export" not in cmd  # nothing kept on disk
    report = tmp_path / "r.ncu-rep"
    cmd = ncu_command("/x/ncu", "add", "2^20", "float16", export=report)
    assert cmd[cmd.index("--export") + 1] == str(report)
    assert cmd.index("--export") < cmd.index(sys.executable)  # an ncu option, not the program's
    # An operator of a package of opforge new's: the runner loads the package first.
    cmd = ncu_command("/x/ncu", "my_ns::my_op", "2^20", "float32", project=tmp_path)
    runner = [sys.executable, "-m", "opforge.profile", "--run-case", "my_ns::my_op", "2^20", "float32"]
    assert cmd[-9:] == [*runner, "--project", str(tmp_path)]


def test_profile_target_that_is_a_folder_but_no_package(tmp_path, capsys):
    assert profile_cli._package_ops("add") == (None, ["add"])  # an operator's name passes through
    assert profile_cli._package_ops(str(tmp_path)) == 2  # a usage error
    assert f"is not an opforge package: no [tool.opforge] table in {tmp_path}" in capsys.readouterr().err


SPEC_FILE = Path(__file__).resolve().parent / "fixtures" / "spec_file" / "muladd_spec.py"
MULADD = "extension_cpp::mymuladd"


def test_a_spec_file_stands_for_the_operators_its_specs_name(tmp_path, capsys):
    # As `opforge check FILE.py` takes it: run, its SPECS registered, their operators profiled.
    assert profile_cli._package_ops(str(SPEC_FILE)) == (SPEC_FILE, [MULADD])
    assert profile_cli._package_ops("nothere.py") == 2  # a usage error, as every command's
    assert "opforge profile: nothere.py: no such file" in capsys.readouterr().err
    empty = tmp_path / "no_specs.py"
    empty.write_text("import torch\n")
    assert profile_cli._package_ops(str(empty)) == 2  # no SPECS: a usage error
    assert "SPECS" in capsys.readouterr().err
    # The runner under ncu and the checks under compute-sanitizer load the file first.
    cmd = ncu_command("/x/ncu", MULADD, "2^20", "float32", project=SPEC_FILE)
    assert cmd[-2:] == ["--project", str(SPEC_FILE)] and cmd[-5] == MULADD
    assert sanitizer_command("cs", "memcheck", [str(SPEC_FILE)], 7)[-10:-8] == ["check", str(SPEC_FILE)]


def test_the_cli_profiles_a_spec_files_operators(monkeypatch):
    parser = argparse.ArgumentParser(prog="opforge")
    profile_cli.register_cli(parser.add_subparsers(dest="command", required=True))
    calls = []
    monkeypatch.setattr(profile_cli, "profile_op", lambda *a, project: calls.append(("profile", *a, project)) or 0)
    monkeypatch.setattr(profile_cli, "sanitize_op", lambda *a, project: calls.append(("sanitize", *a, project)) or 0)
    for argv in (["profile", str(SPEC_FILE), "--case", "2^20"], ["profile", str(SPEC_FILE), "--sanitize", "--seed", "3"]):
        args = parser.parse_args(argv)
        assert args.fn(args) == 0
    assert calls == [("profile", MULADD, "2^20", "float32", False, SPEC_FILE), ("sanitize", MULADD, 3, SPEC_FILE)]


@pytest.mark.parametrize("which", ["profile", "sanitize"])
def test_without_a_gpu_a_spec_file_is_resolved_then_one_line_says_what_is_missing(no_tools, monkeypatch, capsys, which):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    project, (op,) = profile_cli._package_ops(str(SPEC_FILE))
    run = profile_op(op, None, "float32", False, project=project) if which == "profile" else sanitize_op(op, 1, project=project)
    assert run == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot run, missing: a CUDA GPU (torch.cuda.is_available() is False); " in line
    assert line.endswith(f"on this machine, opforge bench {SPEC_FILE} --device cpu times them")
    # What can be found wrong here is, before anything says the GPU is missing.
    assert profile_op(op, None, "float16", False, project=project) == 2
    assert "extension_cpp::mymuladd: mymuladd does not take float16; it takes float32" in capsys.readouterr().err
    assert profile_op("no_such_op_here", None, "float32", False) == 2
    assert "no_such_op_here" in capsys.readouterr().err


def test_an_operator_of_a_spec_file_without_a_cuda_kernel_is_named(monkeypatch):
    project, _ = profile_cli._package_ops(str(SPEC_FILE))
    monkeypatch.setattr(profile, "has_kernel_for", lambda overload, device: device != "cuda")
    assert profile._library_missing(project) == [f"a CUDA kernel for {MULADD} (none registered by what muladd_spec.py imports)"]


def test_sanitizer_commands():
    several = sanitizer_command("cs", "memcheck", ["add", "sigmoid"], 7)
    assert several[-11:-8] == ["check", "add", "sigmoid"]
    cmd = sanitizer_command("/x/compute-sanitizer", "memcheck", "add", 7)
    assert cmd[:5] == ["/x/compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9"]
    assert ("--leak-check", "no") in list(itertools.pairwise(cmd))
    # The reference on the CPU: the report is about the operator's kernels, not PyTorch's (whose
    # multi-block reductions initcheck flags).
    tail = [sys.executable, "-m", "opforge", "check", "add", "--device", "cuda"]
    tail += ["--checks", "reference", "--reference-on", "cpu", "--seed", "7"]
    assert cmd[-len(tail) :] == tail
    for tool in ("racecheck", "initcheck", "synccheck"):
        cmd = sanitizer_command("cs", tool, "add", 7)
        assert cmd[1:3] == ["--tool", tool] and "--leak-check" not in cmd and cmd[-len(tail) :] == tail


def test_case_selection_picks_the_largest_by_default():
    (spec,) = get_specs(["add"])
    cpu = torch.device("cpu")
    cases = case_infos(spec.bench_cases(cpu, torch.float32, torch.Generator().manual_seed(0)))
    assert [c.desc for c in cases] == ["2^16", "2^20", "2^22", "transposed 1024x1024", "channels_last 16x64x32x32"]
    assert select_case(cases, None) == CaseInfo("2^22", 2 * 2**22)  # the largest; the layout cases hold 2^20 elements
    assert select_case(cases, "2^20").desc == "2^20"
    # By size, not by order.
    t = torch.empty
    shuffled = case_infos([Sample((t(8), t(8)), desc="big"), Sample((t(2),), desc="small"), Sample((t(4), 1.0), desc="mid")])
    assert select_case(shuffled, None).desc == "big"


def test_unknown_case_names_the_available_ones():
    cases = [CaseInfo("2^16", 1), CaseInfo("2^20", 2)]
    with pytest.raises(ValueError, match=r"no case '2\^30'; available: 2\^16, 2\^20"):
        select_case(cases, "2^30")


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    """Neither on PATH nor where NVIDIA installs them."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(profile, "_search_dirs", lambda name: [])


_RUNS = {
    "profile": (lambda: profile_op("add", None, "float32", False), "ncu"),
    "sanitize": (lambda: sanitize_op("add", 1), "compute-sanitizer"),
}


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("which", sorted(_RUNS))
def test_missing_gpu_or_tool_is_one_line_and_exit_2(no_tools, monkeypatch, capsys, gpu, which):
    run, tool = _RUNS[which]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert run() == 2
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert tool in lines[0] and "missing" in lines[0]
    assert ("torch.cuda.is_available() is False" in lines[0]) is not gpu


def test_missing_gpu_alone_is_exit_2(monkeypatch, tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile_op("add", None, "float32", False) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "CUDA GPU" in line and "ncu (" not in line


def test_find_tool(monkeypatch, tmp_path):
    on_path, elsewhere = tmp_path / "bin", tmp_path / "opt" / "2025.3.1"
    for d in (on_path, elsewhere):
        d.mkdir(parents=True)
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setattr(profile, "_search_dirs", lambda name: [elsewhere])
    assert find_tool("ncu") is None
    (elsewhere / "ncu").write_text("#!/bin/sh\n")
    assert find_tool("ncu") is None  # not executable
    (elsewhere / "ncu").chmod(0o755)
    assert find_tool("ncu") == str(elsewhere / "ncu")
    (on_path / "ncu").write_text("#!/bin/sh\n")
    (on_path / "ncu").chmod(0o755)
    assert find_tool("ncu") == str(on_path / "ncu")  # PATH first


def test_register_cli(monkeypatch):
    parser = argparse.ArgumentParser(prog="opforge")
    register = profile_cli.register_cli
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", "add", "--case", "2^20", "--dtype", "bfloat16", "--full"])
    assert (args.op, args.case, args.dtype, args.full, args.sanitize) == (["add"], "2^20", "bfloat16", True, False)
    calls = []
    monkeypatch.setattr(profile_cli, "profile_op", lambda *a, project: calls.append(("profile", *a, project)) or 0)
    monkeypatch.setattr(profile_cli, "sanitize_op", lambda *a, project: calls.append(("sanitize", *a, project)) or 1)
    assert args.fn(args) == 0
    args = parser.parse_args(["profile", "square", "--sanitize", "--seed", "5"])
    assert (args.case, args.dtype, args.full) == (None, "float32", False)
    assert args.fn(args) == 1
    assert calls == [("profile", "add", "2^20", "bfloat16", True, None), ("sanitize", "square", 5, None)]
    # Several operators: profiled one after the other; sanitized in one check per tool.
    calls.clear()
    args = parser.parse_args(["profile", "add", "sigmoid"])
    assert args.fn(args) == 0
    args = parser.parse_args(["profile", "add", "sigmoid", "--sanitize"])
    assert args.fn(args) == 1
    assert calls == [
        ("profile", "add", None, "float32", False, None),
        ("profile", "sigmoid", None, "float32", False, None),
        ("sanitize", ["add", "sigmoid"], None, None),
    ]


# ---------------------------------------------------------------- on a GPU, with the NVIDIA tools


def _need(tool: str) -> None:
    if find_tool(tool) is None:
        pytest.skip(f"{tool} not found")


@pytest.mark.cuda
def test_runner_calls_the_op_once_profiled():
    assert profile.run_case("add", "2^16", "float32") == 0
    assert profile.run_case("add", "no such case", "float32") == 1


@pytest.mark.cuda
def test_runner_loads_a_spec_file_then_calls_its_operator_once():
    project, (op,) = profile_cli._package_ops(str(SPEC_FILE))
    (spec,) = get_specs([op])
    cuda = torch.device("cuda")
    cases = case_infos(spec.bench_cases(cuda, torch.float32, torch.Generator(device=cuda).manual_seed(0)))
    assert profile.run_case(op, cases[0].desc, "float32", project=str(project)) == 0


@pytest.mark.xdist_group("gpu-tools")  # Nsight Compute and compute-sanitizer runs, one at a time under pytest-xdist
@pytest.mark.cuda
def test_profile_add_end_to_end(capsys, tmp_path, monkeypatch):
    _need("ncu")
    monkeypatch.chdir(tmp_path)
    # As wide as a terminal would be: the runner's log may say 80 columns, which folds the names.
    monkeypatch.setattr(profile, "out", Console(width=220))
    assert profile_op("add", "2^20", "float32", False) == 0
    text = capsys.readouterr().out
    assert "elementwise_kernel" in text and "AddOp" in text and "duration us" in text and " x 256" in text
    assert list(tmp_path.iterdir()) == []  # nothing kept without --full
    assert profile_op("add", None, "float16", True) == 0
    text = capsys.readouterr().out
    (report,) = tmp_path.iterdir()
    assert report.suffix == ".ncu-rep" and "2_26" in report.name and str(report) in text.replace("\n", "")


@pytest.mark.xdist_group("gpu-tools")  # Nsight Compute and compute-sanitizer runs, one at a time under pytest-xdist
@pytest.mark.cuda
def test_profile_unknown_case(capsys):
    _need("ncu")
    assert profile_op("add", "2^30", "float32", False) == 2
    assert "no case '2^30'; available: 2^16, 2^20, 2^24, 2^26" in capsys.readouterr().err


@pytest.mark.xdist_group("gpu-tools")  # Nsight Compute and compute-sanitizer runs, one at a time under pytest-xdist
@pytest.mark.cuda
def test_sanitize_add_end_to_end(capsys):
    _need("compute-sanitizer")
    status = sanitize_op("add", 1)
    text = capsys.readouterr().out
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        assert tool in text
    assert status == 0, text
    assert "all passed" in text


def test_a_library_operator_is_found_by_name_by_the_command():
    """`opforge profile square` loads opforge's library before resolving the name
    (the command itself starts without it): a wrong dtype is then what it reports."""
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "opforge", "profile", "square", "--dtype", "int7"], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no operator named" not in res.stderr, res.stderr
    assert "opforge profile: square: " in res.stderr and "int7" in res.stderr, res.stderr
