"""``opforge doctor``: what it finds on this machine, and the traps it must catch."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

import opforge
from opforge.builder import library_config, want_cuda
from opforge.builder.jit import module_name
from opforge.cli.doctor import register_cli
from opforge.doctor import probes as doctor_probes
from opforge.doctor import report as doctor
from opforge.doctor.report import (
    SECTIONS,
    DoctorReport,
    collect,
    compare_cuda_versions,
    parse_nvcc_version,
    render,
    run,
    to_json,
)


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch) -> Path:
    """A private cache, and none of the variables that change what the doctor finds."""
    for var in ("CXX", "CC", "CUDAHOSTCXX", "OPFORGE_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST", "OPFORGE_CXXFLAGS"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(cache))
    return cache


def _errors(report: DoctorReport) -> list[str]:
    return [p.message for p in report.problems if p.severity == "error"]


def _rendered(report: DoctorReport) -> str:
    console = Console(record=True, width=120)
    render(report, console)
    return console.export_text()


def test_this_machine_has_what_a_build_needs(clean_env):
    start = time.perf_counter()
    report = collect()
    seconds = time.perf_counter() - start
    assert _errors(report) == [], report.problems
    assert report.torch.version == torch.__version__ and report.torch.cuda == torch.version.cuda, report.torch
    assert report.torch.build == ("CUDA" if torch.version.cuda else "CPU"), report.torch
    assert report.torch.cxx11_abi is not None, report.torch
    assert report.python.executable == sys.executable, report.python
    assert report.compiler.path and report.compiler.version, report.compiler
    assert report.compiler.libstdcxx == "shared", report.compiler
    assert report.ninja.path and re.match(r"\d+\.\d+", report.ninja.version or ""), report.ninja
    assert report.gpu.build_cuda is want_cuda(), report.gpu
    if torch.version.cuda is None:
        assert report.gpu.build_cuda_reason == "torch is a CPU build", report.gpu
        # No GPU and no TORCH_CUDA_ARCH_LIST: the default targets.
        assert report.gpu.archs == ["8.0", "9.0a"] and "default" in report.gpu.archs_source, report.gpu
        # nvcc may be installed, but a CPU torch has no CUDA version to compare with.
        if report.nvcc.path:
            assert report.nvcc.matches_torch is None, report.nvcc
    else:
        assert report.nvcc.matches_torch is True, report.nvcc
    assert run(False) == 0, collect().problems
    # A generous bound: the machine is shared; alone it takes about 0.5 s.
    assert seconds < 10, f"collect() took {seconds:.1f} s"


def test_library_section_names_the_entry_without_building(clean_env):
    report = collect()
    key = library_config().key()
    lib = report.library
    assert lib.route == "JIT" and lib.key == key and lib.entry == f"opforge_ops-{key[:16]}"
    assert lib.state == "not built" and lib.with_cuda is want_cuda()
    assert lib.loaded_path == (str(opforge.library.path) if opforge.library is not None else None)
    assert not any(clean_env.iterdir()), "the doctor must not build anything"

    # A completed build of that entry (checksum and all) reads as built.
    entry = clean_env / lib.entry
    entry.mkdir()
    so = entry / f"{module_name(library_config())}.so"
    so.write_bytes(b"not really a library")
    marker = {"library": so.name, "size": so.stat().st_size, "sha256": hashlib.sha256(so.read_bytes()).hexdigest()}
    (entry / "COMPLETE.json").write_text(json.dumps(marker))
    assert collect().library.state == "built"
    so.write_bytes(b"changed after the build")
    assert collect().library.state == "corrupt"


def test_missing_compiler_is_an_error_with_a_fix(monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    report = collect()
    [problem] = [p for p in report.problems if p.severity == "error"]
    assert "/nonexistent/g++" in problem.message and "no C++ compiler" in problem.message
    assert "CXX" in problem.fix and "g++" in problem.fix
    assert report.compiler.path is None
    assert run(False) == 1
    out = capsys.readouterr().out
    assert "error: no C++ compiler" in out and "fix: install g++" in out
    assert run(True) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["compiler"]["path"] is None and data["problems"][0]["severity"] == "error"


def test_static_libstdcxx_compiler_is_caught(tmp_path, monkeypatch):
    # The trap of a GPU image's CXX=/opt/gcc/bin/g++, reproduced with the system g++.
    wrapper = tmp_path / "static-g++"
    wrapper.write_text('#!/bin/sh\nexec /usr/bin/g++ -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("OPFORGE_CXX_FALLBACKS", "")  # no compiler to fall back on: the refusal itself
    report = collect()
    assert report.compiler.libstdcxx == "static"
    [problem] = [p for p in report.problems if p.severity == "error"]
    assert "statically" in problem.message and str(wrapper) in problem.message
    assert "export CXX=g++ CC=gcc CUDAHOSTCXX=g++" in problem.fix


def test_nvcc_and_torch_cuda_versions():
    assert parse_nvcc_version("Cuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0/compiler") == "13.0"
    assert parse_nvcc_version("command not found") is None

    major = compare_cuda_versions("12.1", "13.0")
    assert major is not None and major.severity == "error"
    assert major.message == "nvcc is 12.1 but torch was built with 13.0"
    assert "point CUDA_HOME at a 13.x toolkit" in major.fix

    not_building = compare_cuda_versions("12.1", "13.0", building_cuda=False)
    assert not_building is not None and not_building.severity == "warning"

    minor = compare_cuda_versions("13.1", "13.0")
    assert minor is not None and minor.severity == "warning" and minor.message.startswith("nvcc is 13.1 but torch was built with 13.0")
    assert "13.0 toolkit" in minor.fix

    assert compare_cuda_versions("12.8", "12.8") is None


def test_forcing_cuda_without_nvcc_is_an_error(monkeypatch):
    import opforge.builder.config

    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch, on any machine
    monkeypatch.setattr(opforge.builder.config, "cuda_home", lambda: None)
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "1")
    report = collect()
    [problem] = [p for p in report.problems if p.severity == "error"]
    assert "OPFORGE_BUILD_CUDA=1" in problem.message and "nvcc" in problem.message and "OPFORGE_BUILD_CUDA" in problem.fix
    assert report.gpu.build_cuda is None and report.library.key is None


def test_forcing_cuda_with_a_cpu_torch_and_nvcc_builds_cuda_kernels(monkeypatch, tmp_path):
    # The op library is on the stable ABI: a CPU torch builds CUDA kernels that a CUDA torch runs.
    import opforge.builder.config

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(opforge.builder.config, "cuda_home", lambda: tmp_path)
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "1")
    report = collect()
    assert report.gpu.build_cuda is True
    assert not [p for p in report.problems if "OPFORGE_BUILD_CUDA" in p.message]


def test_build_cuda_that_is_neither_on_nor_off_is_an_error(monkeypatch):
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "maybe")
    report = collect()
    [problem] = [p for p in report.problems if p.severity == "error"]
    assert problem.message == "OPFORGE_BUILD_CUDA='maybe' is neither on nor off"
    assert problem.fix.startswith("set it to 1 or 0")
    assert report.gpu.build_cuda is None and report.library.key is None


# Holds an flock on argv[1] as a build does, until its stdin closes.
_HOLDER = (
    "import fcntl, os, sys\n"
    "f = open(sys.argv[1], 'a+')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "f.write(f'pid {os.getpid()}'); f.flush()\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_cache_entries_and_locks(clean_env):
    cache = clean_env
    cache.mkdir(mode=0o700)
    done = cache / "opforge_ops-0123456789abcdef"
    done.mkdir()
    (done / "COMPLETE.json").write_text("{}")
    (done / "lib.so").write_bytes(b"x" * 1000)
    debris = cache / "opforge_ops-fedcba9876543210"
    debris.mkdir()
    (debris / "build.log").write_text("add.cpp:1:1: error: boom")
    (cache / f"{debris.name}.lock").touch()  # left behind by a killed build: free
    building = cache / "opforge_ops-00000000000000aa"
    building.mkdir()
    (cache / "not-an-entry").mkdir()

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache / f"{building.name}.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        report = collect()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)

    entries = {e.name: e for e in report.cache.entries}
    assert set(entries) == {done.name, debris.name, building.name}
    assert entries[done.name].state == "complete" and entries[done.name].size_bytes >= 1000
    assert entries[debris.name].state == "incomplete"
    assert "wipes" in entries[debris.name].note and str(debris / "build.log") in entries[debris.name].note
    assert entries[building.name].state == "building" and f"pid {holder.pid}" in entries[building.name].note
    assert report.cache.size_bytes >= 1000

    locks = {lk.name: lk for lk in report.cache.locks}
    held, free = locks[f"{building.name}.lock"], locks[f"{debris.name}.lock"]
    assert held.held is True and held.holder == f"pid {holder.pid}" and "in progress" in held.note
    assert free.held is False and "cannot go stale" in free.note
    # Neither debris nor locks block anything: the next build cleans up.
    assert report.problems == []
    text = _rendered(report)
    assert "being built now" in text and "cannot go stale" in text

    # The holder has exited, so its lock is free (a kernel flock never goes
    # stale), and the doctor's own tests of the locks left none held.
    assert [lk.held for lk in collect().cache.locks] == [False, False]


def test_group_writable_cache_is_a_problem(clean_env):
    clean_env.mkdir()
    clean_env.chmod(0o770)
    report = collect()
    assert report.cache.mode == "0770"
    [problem] = [p for p in report.problems if "writable by its group" in p.message]
    assert f"chmod 700 {clean_env}" in problem.fix
    clean_env.chmod(0o700)
    assert collect().problems == []


def test_world_writable_cache_is_an_error(clean_env, capsys):
    # `import opforge` refuses to load from it: the doctor must not pass it with a warning.
    clean_env.mkdir()
    clean_env.chmod(0o777)
    try:
        report = collect()
        [problem] = [p for p in report.problems if "writable by others" in p.message]
        assert problem.severity == "error" and "(mode 0777)" in problem.message and f"chmod 700 {clean_env}" in problem.fix
        assert run(as_json=True) == 1
    finally:
        clean_env.chmod(0o700)
    assert json.loads(capsys.readouterr().out)["problems"][0]["severity"] == "error"


def test_cache_that_is_a_file_is_an_error_with_a_fix(clean_env):
    clean_env.write_text("")
    [problem] = collect().problems
    assert problem.severity == "error"
    assert problem.message == f"OPFORGE_CACHE_DIR={clean_env} is a file, not a directory"
    assert problem.fix.startswith("set OPFORGE_CACHE_DIR to a directory you can write")


def test_gpus_with_a_cpu_torch_are_a_warning(monkeypatch):
    # Stand in for NVML's answer and for a CPU build of torch.
    monkeypatch.setattr(torch.version, "cuda", None)
    gpus = [doctor.GpuInfo(0, "NVIDIA H200", "9.0", 139.8)]
    monkeypatch.setattr(doctor_probes, "_nvml_gpus", lambda: (gpus, "580.65", "13.0"))
    report = collect()
    assert report.gpu.source == "NVML" and report.gpu.gpus == gpus and report.gpu.driver_cuda == "13.0"
    [problem] = report.problems
    assert problem.severity == "warning" and f"torch {torch.__version__} is a CPU build" in problem.message
    assert re.search(r"GPU 0 +NVIDIA H200, compute capability 9.0, 139.8 GiB", _rendered(report))


@pytest.mark.parametrize(("arch_list", "capability", "warned"), [("9.0", "9.0", False), ("8.0;9.0", "8.6", True)])
def test_gpu_arch_against_the_targets(monkeypatch, arch_list, capability, warned):
    # A 9.0 target is built as 9.0a (opforge.builder.cuda_archs), whose SASS runs on a 9.0 GPU.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(doctor_probes, "want_cuda", lambda **_: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    gpus = [doctor.GpuInfo(0, "NVIDIA GPU", capability, 80.0)]
    monkeypatch.setattr(doctor_probes, "_nvml_gpus", lambda: (gpus, "580.65", "13.0"))
    report = collect()
    assert report.gpu.archs == (["9.0a"] if arch_list == "9.0" else ["8.0", "9.0a"])
    arch_problems = [p for p in report.problems if "not among the target archs" in p.message]
    assert bool(arch_problems) is warned, report.problems


def test_json_round_trips(clean_env):
    data = to_json(collect())
    assert json.loads(json.dumps(data)) == data
    assert set(data) >= {"python", "torch", "nvcc", "compiler", "ninja", "gpu", "cache", "library", "problems"}
    assert data["torch"]["build"] == ("CUDA" if torch.version.cuda else "CPU") and data["library"]["route"] == "JIT"


def test_render_has_every_section():
    text = _rendered(collect())
    for section in SECTIONS:
        assert re.search(rf"^{re.escape(section)}$", text, re.M), section
    assert "none: everything a build needs is in place" in text


def test_cli_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="opforge")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", "--json"])
    assert args.json is True
    assert args.fn(args) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
    assert parser.parse_args(["doctor"]).json is False


def test_doctor_runs_without_the_op_library(tmp_path):
    # What `opforge doctor` does when the build is broken: nothing imports the library.
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1", "OPFORGE_CACHE_DIR": str(tmp_path / "c")}
    code = "import opforge, opforge.doctor as d; r = d.collect(); assert opforge.library is None; print(r.library.state)"
    src = str(Path(opforge.__file__).resolve().parent.parent)
    res = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": src}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "not built"
