"""`opforge build PATH` on hostile folders: code whose loading fails, code that
runs when the folder is built, names and links the tools choke on.

Each build test compiles a few lines that include only <torch/library.h> (a
second or two of compiler time each, more on a loaded machine), from an empty
cache, in a new process (marked slow). The rest need no compiler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opforge.builder.child import load_failure, run_bounded
from tests.test_byo_build import SRC, run_build, write

_LIB = "#include <torch/library.h>\n"


def one_line_error(res: subprocess.CompletedProcess) -> str:
    """The command's error: exactly one line that says what failed, no C++ backtrace, no abort."""
    assert res.returncode == 1, res.stdout + res.stderr
    assert "frame #" not in res.stderr and "terminate called" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "fails:" in ln]
    assert len(errors) == 1, res.stderr
    return errors[0]


# --------------------------------------------------------------- a registration error while the library loads

_REGISTRATION_ERRORS = {
    "two_blocks": (
        {
            "a.cpp": _LIB + 'TORCH_LIBRARY(two_blocks, m) { m.def("f(Tensor x) -> Tensor"); }\n',
            "b.cpp": _LIB + 'TORCH_LIBRARY(two_blocks, m) { m.def("g(Tensor x) -> Tensor"); }\n',
        },
        "Only a single TORCH_LIBRARY can be used to register the namespace two_blocks",
        "(made by a.cpp:2, b.cpp:2)",
    ),
    "defined_twice": (
        {"op.cpp": _LIB + 'TORCH_LIBRARY(defined_twice, m) {\n  m.def("f(Tensor x) -> Tensor");\n  m.def("f(Tensor x) -> Tensor");\n}\n'},
        "Tried to register an operator (defined_twice::f(Tensor x) -> Tensor) with the same name and overload name multiple times",
        "(made by op.cpp:2)",
    ),
    "bad_schema": (
        {"ok.cpp": _LIB + "int ok = 1;\n", "op.cpp": _LIB + 'TORCH_LIBRARY(bad_schema, m) {\n  m.def("f(Tensor x -> Tensor");\n}\n'},
        "expected ) but found 'arrow' here: f(Tensor x -> Tensor",
        "(made by op.cpp:3)",
    ),
    "aten_namespace": (
        {"op.cpp": _LIB + 'TORCH_LIBRARY(aten, m) { m.def("my_op(Tensor x) -> Tensor"); }\n'},
        "Only a single TORCH_LIBRARY can be used to register the namespace aten",
        "(made by op.cpp:2)",
    ),
    "throwing_initializer": (
        {
            "op.cpp": _LIB + '#include <stdexcept>\nstatic int boom() { throw std::runtime_error("config file missing"); }\n'
            'static int x = boom();\nTORCH_LIBRARY(throwing_initializer, m) { m.def("f(Tensor x) -> Tensor"); }\n'
        },
        "loading throwing_initializer.so fails: config file missing",
        "(made by op.cpp)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_REGISTRATION_ERRORS))
def test_a_registration_error_is_one_line_naming_the_source_and_the_command_lives(tmp_path, case):
    files, message, made_by = _REGISTRATION_ERRORS[case]
    folder = write(tmp_path / case, files)
    res = run_build(folder, tmp_path / "cache", after="print('still alive', rc)")
    assert "still alive 1" in res.stdout, "the build's process went on after the failed load"
    line = one_line_error(res)
    assert message in line and line.endswith(made_by), line
    # Found in the cache, the library is still checked before it loads: it never loaded once.
    again = run_build(folder, tmp_path / "cache")
    assert "opforge: building" not in again.stderr and one_line_error(again) == line


@pytest.mark.slow
@pytest.mark.parametrize("route", ["setuptools", "setup.py"])
def test_two_blocks_of_one_namespace_are_one_line_by_setuptools_and_by_a_setup_py(tmp_path, route):
    files = dict(_REGISTRATION_ERRORS["two_blocks"][0])
    if route == "setup.py":
        files["setup.py"] = (
            "from setuptools import setup\nfrom torch.utils.cpp_extension import BuildExtension, CppExtension\n"
            "setup(name='two_blocks', ext_modules=[CppExtension('two_blocks', ['a.cpp', 'b.cpp'])], "
            "cmdclass={'build_ext': BuildExtension})\n"
        )
    folder = write(tmp_path / "two_blocks", files)
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_NO_AUTOLOAD": "1"}
    env["OPFORGE_BUILD_CUDA"] = "0"
    cmd = [sys.executable, "-m", "opforge", "build", str(folder), *(["--route", "setuptools"] if route == "setuptools" else [])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = one_line_error(res)
    assert "Only a single TORCH_LIBRARY can be used to register the namespace two_blocks" in line, line
    assert line.endswith("(made by a.cpp:2, b.cpp:2)"), line


@pytest.mark.slow
def test_a_library_that_loads_is_checked_in_a_child_once_then_loaded_here(tmp_path):
    folder = write(tmp_path / "fine_ops", {"op.cpp": _LIB + 'TORCH_LIBRARY(fine_ops, m) { m.def("f(Tensor x) -> Tensor"); }\n'})
    res = run_build(folder, tmp_path / "cache", after="import torch; print('has f', hasattr(torch.ops.fine_ops, 'f'))")
    assert res.returncode == 0 and "has f True" in res.stdout, res.stdout + res.stderr
    [marker] = (tmp_path / "cache").glob("fine_ops-*/.fine_ops.so.loads")
    assert marker.read_text()


def test_a_c_plus_plus_abort_reads_as_one_line():
    stderr = (
        "terminate called after throwing an instance of 'std::runtime_error'\n"
        "  what():  expected ) but found 'arrow' here:\nf(Tensor x -> Tensor\n           ~~ <--- HERE\n\n"
        "Exception raised from foo at /x.cpp:1 (most recent call first):\nframe #0: bar\n"
    )
    assert load_failure(stderr, -6, Path("/c/x.so")) == "loading x.so fails: expected ) but found 'arrow' here: f(Tensor x -> Tensor"
    assert load_failure("", -9, Path("/c/x.so")) == "loading x.so fails: the process was killed by SIGKILL"
    trace = "Traceback (most recent call last):\n  File 'x'\nOSError: libfoo.so: cannot open shared object file\n"
    assert load_failure(trace, 1, Path("/c/x.so")) == "loading x.so fails: libfoo.so: cannot open shared object file"


# --------------------------------------------------------------- processes a build starts


def test_a_child_that_leaves_a_helper_holding_its_output_is_ended_whole_at_the_time_limit(tmp_path):
    marker = tmp_path / "helper-alive"
    # The helper inherits stdout and outlives its parent: a plain subprocess.run(timeout=) leaves it running.
    helper = f"import time, pathlib\nfor _ in range(60):\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.2)\n"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {helper!r}])\ntime.sleep(60)\n"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded([sys.executable, "-c", code], timeout=2)
    assert time.monotonic() - start < 20
    time.sleep(0.5)
    marker.unlink(missing_ok=True)
    time.sleep(1.0)
    assert not marker.exists(), "the helper the child started is still running"


def test_a_setup_py_whose_helper_keeps_stdout_open_is_an_error_and_leaves_nothing_running(tmp_path):
    from opforge.builder.sources import DiscoveryError
    from opforge.folders.setup_py import read

    marker = tmp_path / "helper-alive"
    helper = f"import time, pathlib\nfor _ in range(100):\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.2)\n"
    setup = f"# CppExtension\nimport subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {helper!r}])\ntime.sleep(100)\n"
    folder = write(tmp_path / "p", {"setup.py": setup, "op.cpp": ""})
    with pytest.raises(DiscoveryError, match="did not finish within 3 s"):
        read(folder / "setup.py", timeout=3)
    time.sleep(0.5)
    marker.unlink(missing_ok=True)
    time.sleep(1.0)
    assert not marker.exists(), "the setup.py's helper is still running"


# --------------------------------------------------------------- links and names the walk cannot use


def hostile_folder(root: Path) -> Path:
    """A TORCH_LIBRARY source beside a dangling link, a loop of links, a link to its own
    folder and files whose names are not UTF-8."""
    folder = write(root, {"op.cpp": _LIB + "TORCH_LIBRARY(hostile, m) {}\n", "sub/k.h": ""})
    (folder / "ghost.cpp").symlink_to("missing.cpp")
    (folder / "loop1.h").symlink_to("loop2.h")
    (folder / "loop2.h").symlink_to("loop1.h")
    (folder / "self").symlink_to(".")
    (folder / "sub" / os.fsdecode(b"bad\xff.cpp")).write_text("")
    (folder / os.fsdecode(b"worse\xfe.h")).write_text("")
    return folder


def test_dangling_links_link_loops_and_names_that_are_not_utf8_are_left_out_and_said(tmp_path, monkeypatch):
    from opforge.builder import folder_config
    from opforge.folders.describe import describe
    from opforge.folders.discover import discover

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = hostile_folder(tmp_path / "hostile")
    layout = discover(folder)
    assert [p.name for p in layout.tree.sources] == ["op.cpp"]
    said = "\n".join(describe(layout, route=layout.route, cuda_reason=None))
    assert "ghost.cpp (a symbolic link to missing.cpp, which is not there)" in said
    assert "loop1.h (a loop of symbolic links), loop2.h (a loop of symbolic links)" in said
    assert "sub/bad\\xff.cpp (its name is not UTF-8: rename it)" in said and "worse\\xfe.h (its name is not UTF-8" in said
    said.encode("utf-8")  # prints anywhere
    cfg = folder_config(folder)  # the cache key reads every source and header
    assert [p.name for p in cfg.sources] == ["op.cpp"] and len(cfg.key()) == 64


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.symlink_to(p), "cannot be built: a loop of symbolic links"),
        (lambda p: p.symlink_to(p.with_name("gone")), "cannot be built: a symbolic link to "),
    ],
)
def test_a_folder_that_is_a_link_loop_or_a_dangling_link_is_a_usage_error(tmp_path, capsys, make, message):
    from opforge.cli import main

    folder = tmp_path / "ops"
    make(folder)
    with pytest.raises(SystemExit) as stop:
        main(["build", str(folder)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------- what runs: --dry-run runs none of the folder's code

_MARKING_SETUP_PY = """\
import pathlib
pathlib.Path({marker!r}).write_text("setup.py ran")
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
setup(name="marked", ext_modules=[CppExtension("marked._C", ["csrc/op.cpp"], extra_compile_args=["-O2"])],
      cmdclass={{"build_ext": BuildExtension}})
pathlib.Path({marker!r}).write_text("after setup()")
"""
_MARKING_CMAKE = """\
cmake_minimum_required(VERSION 3.18)
project(marked LANGUAGES CXX)
execute_process(COMMAND {python} -c "import pathlib; pathlib.Path('{marker}').write_text('cmake ran')")
"""


def test_dry_run_of_a_setup_py_prints_the_plan_and_runs_none_of_its_code(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "MARKER"
    folder = write(
        tmp_path / "marked",
        {
            "setup.py": _MARKING_SETUP_PY.format(marker=str(marker)),
            "csrc/op.cpp": _LIB + "TORCH_LIBRARY(marked, m) {}\n",
            "marked/__init__.py": f"import pathlib\npathlib.Path({str(marker)!r}).write_text('__init__ ran')\nfrom . import _C\n",
        },
    )
    assert main(["build", str(folder), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not marker.exists(), marker.read_text()
    assert "  route: setup.py (" in out and "  plan (--dry-run: nothing is compiled, and no code of marked runs):" in out
    assert "      marked._C (CppExtension), line 5\n        sources: csrc/op.cpp\n        extra_compile_args: ['-O2']\n" in out
    assert "  a build runs code of this folder: setup.py's top-level code" in out
    assert not list(folder.glob("marked/_C*")) and not list((tmp_path / "cache").glob("marked*")), "nothing built"


def test_dry_run_of_a_cmake_folder_does_not_configure_it(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "MARKER"
    folder = write(
        tmp_path / "cm",
        {"CMakeLists.txt": _MARKING_CMAKE.format(python=sys.executable, marker=marker), "op.cpp": _LIB + "TORCH_LIBRARY(cm, m) {}\n"},
    )
    assert main(["build", str(folder), "--route", "cmake", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not marker.exists() and not list((tmp_path / "cache").glob("cmake-*"))
    assert f"    cmake -S {folder} -B <cache>/cmake-cm-<hash>, then cmake --build; each .so it makes is loaded" in out
    assert "  a build runs code of this folder: CMakeLists.txt, configured and built by cmake (execute_process" in out


def test_dry_run_of_torch_library_sources_prints_sources_flags_and_the_cache_entry_it_would_make(tmp_path, monkeypatch, capsys):
    from opforge.builder import folder_config
    from opforge.builder.pch import with_torch_pch
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = write(tmp_path / "ops", {"my op.cpp": _LIB + "TORCH_LIBRARY(ops, m) {}\n", "include/ops.h": ""})
    assert main(["build", str(folder), "--dry-run"]) == 0
    out = capsys.readouterr().out
    key = with_torch_pch(folder_config(folder))[0].key()[:16]
    assert "    library: ops (1 source): my op.cpp\n" in out and "    cxx flags: -O3 -fopenmp" in out
    assert f"    output: {tmp_path / 'cache' / f'ops-{key}' / 'ops.so'}\n" in out
    assert not list((tmp_path / "cache").glob("ops-*")), "nothing built"


def test_the_help_says_that_building_a_folder_runs_its_code(capsys):
    from opforge.cli import main

    with pytest.raises(SystemExit):
        main(["build", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "Building a folder runs its code, as pip install would" in helptext
    assert "--dry-run" in helptext and "no code of the folder runs" in helptext
    assert "setup() is not run" not in helptext


# --------------------------------------------------------------- build messages

_CALLS_MISSING = "namespace mylib { int helper(int x); }\nint call_it() { return mylib::helper(3); }\n"


@pytest.fixture(scope="module")
def needs_missing(tmp_path_factory) -> tuple[Path, Path]:
    """A shared library (plain C++, no torch headers: a fraction of a second to build)
    that needs mylib::helper(int), which nothing defines; and its source."""
    import shutil

    folder = tmp_path_factory.mktemp("needs_missing")
    source = folder / "caller.cpp"
    source.write_text(_CALLS_MISSING)
    so = folder / "needs_missing.so"
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(so), str(source)], check=True, timeout=120)
    return so, source


def test_a_library_needing_a_missing_function_names_it_demangled_and_the_source_calling_it(needs_missing):
    from opforge.builder.child import verify_load

    so, source = needs_missing
    said = verify_load(so, sources=[source], root=source.parent)
    assert said is not None and "_ZN5mylib" not in said
    assert "loading needs_missing.so fails on an undefined symbol: the built library needs `mylib::helper(int)`" in said, said
    assert "(called in caller.cpp), but none of the sources defines it" in said, said


def test_a_library_that_does_not_load_says_the_loaders_reason_not_only_could_not_load(needs_missing):
    from opforge.builder import BuildError
    from opforge.builder.prebuilt import load_library_file

    so, _ = needs_missing
    with pytest.raises(BuildError) as failed:
        load_library_file(so)
    said = str(failed.value)
    assert "Could not load this library" not in said and "undefined symbol: _ZN5mylib6helperEi" in said, said
    assert "needs_missing.so: the built library needs `mylib::helper(int)`, but none of the sources defines it" in said, said


# --------------------------------------------------------------- a library built with -fsanitize=

_SANITIZED = "int at(int* p, int i) { return p[i]; }\nint add(int a, int b) { return a + b; }\n"


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> dict[str, Path]:
    """Plain C++ built with -fsanitize= (a fraction of a second each): compiled with it and linked
    without, as a build given the flag for its compiles only makes it (its runtime's symbols left
    undefined); and linked with it too, as CMake makes it (libasan.so needed, which must come first)."""
    import shutil

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    folder = tmp_path_factory.mktemp("sanitized")
    (folder / "code.cpp").write_text(_SANITIZED)
    made = {}
    for name, flag, link in (("asan", "address", False), ("ubsan", "undefined", False), ("asan_linked", "address", True)):
        so, obj = folder / f"{name}.so", folder / f"{name}.o"
        subprocess.run([cxx, f"-fsanitize={flag}", "-fPIC", "-c", str(folder / "code.cpp"), "-o", str(obj)], check=True, timeout=120)
        subprocess.run([cxx, "-shared", *([f"-fsanitize={flag}"] if link else []), str(obj), "-o", str(so)], check=True, timeout=120)
        made[name] = so
    return made


def _preload(runtime: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={runtime}"], capture_output=True, text=True, check=True).stdout.strip()


_NOTE = (
    "the library was built with -fsanitize={flag}, whose runtime must be loaded first in the process: "
    "run LD_PRELOAD=$(gcc -print-file-name={runtime}){options} python ..., or build without -fsanitize={flag}"
)


@pytest.mark.parametrize(
    "name, flag, runtime, options",
    [("asan", "address", "libasan.so", " ASAN_OPTIONS=detect_leaks=0"), ("ubsan", "undefined", "libubsan.so", ""),
     ("asan_linked", "address", "libasan.so", " ASAN_OPTIONS=detect_leaks=0")],
)  # fmt: skip
def test_a_sanitized_library_says_its_runtime_must_be_preloaded_and_how_and_the_way_works(sanitized, name, flag, runtime, options):
    from opforge.builder import BuildError
    from opforge.builder.child import verify_load
    from opforge.builder.prebuilt import load_library_file

    so = sanitized[name]
    note = _NOTE.format(flag=flag, runtime=runtime, options=options)
    said = verify_load(so)
    assert said is not None and said.startswith(f"loading {so.name} fails: ") and said.endswith(note), said
    assert "a function declared but never written" not in said, said
    # Here, in this process: a clear error (a library that needs libasan.so is refused before the
    # loader, whose ASan would end the process), not "Could not load this library".
    with pytest.raises(BuildError) as failed:
        load_library_file(so)
    assert str(failed.value).endswith(note) and "Could not load" not in str(failed.value), failed.value
    # The way the note gives loads it.
    env = {**os.environ, "LD_PRELOAD": _preload(runtime), **({"ASAN_OPTIONS": "detect_leaks=0"} if options else {})}
    res = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(so)!r}); print('loaded')"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and "loaded" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_OPFORGE_CXXFLAGS_fsanitize_address_builds_a_folder_that_says_how_to_load_it(tmp_path):
    folder = write(
        tmp_path / "asan_ops",
        {"op.cpp": _LIB + "#include <ATen/ATen.h>\nat::Tensor twice(const at::Tensor& x) { return x * 2; }\n"
                   'TORCH_LIBRARY(asan_ops, m) { m.def("twice(Tensor x) -> Tensor"); m.impl("twice", &twice); }\n'},
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_NO_AUTOLOAD": "1"}
    env |= {"OPFORGE_BUILD_CUDA": "0", "OPFORGE_CXXFLAGS": "-fsanitize=address"}
    res = subprocess.run([sys.executable, "-m", "opforge", "build", str(folder)], env=env, capture_output=True, text=True, timeout=900)
    line = one_line_error(res)
    note = _NOTE.format(flag="address", runtime="libasan.so", options=" ASAN_OPTIONS=detect_leaks=0")
    assert "undefined symbol: __asan_" in line and line.endswith(note), line
    # Run as the note says, the library it built loads and runs.
    so = re.search(r"(/\S+/asan_ops\.so): undefined symbol", line)[1]
    env |= {"LD_PRELOAD": _preload("libasan.so"), "ASAN_OPTIONS": "detect_leaks=0"}
    code = f"import torch; torch.ops.load_library({so!r}); print(torch.ops.asan_ops.twice(torch.ones(2)).tolist())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "[2.0, 2.0]" in res.stdout, res.stdout + res.stderr


def test_a_source_whose_name_holds_a_space_compiles_through_a_file_of_a_plain_name(tmp_path):
    from opforge.builder.jit import _unique_objects

    spaced = write(tmp_path / "src dir", {"my op.cpp": "", "plain.cpp": "", "we$ird:name.cu": ""})
    sources = [spaced / "my op.cpp", spaced / "plain.cpp", spaced / "we$ird:name.cu"]
    objects = tmp_path / "objects"
    objects.mkdir()
    compiled = _unique_objects(sources, objects)
    assert [p.name for p in compiled] == ["my_op.cpp", "plain.cpp", "we_ird_name.cu"]
    assert compiled[1] == sources[1]
    assert compiled[0].read_text().endswith(f'#include "{spaced / "my op.cpp"}"\n')


@pytest.mark.slow
def test_a_folder_with_my_op_cpp_builds_and_loads(tmp_path):
    folder = write(tmp_path / "spaced", {"my op.cpp": _LIB + 'TORCH_LIBRARY(spaced, m) { m.def("f(Tensor x) -> Tensor"); }\n'})
    res = run_build(folder, tmp_path / "cache", after="import torch; print('has f', hasattr(torch.ops.spaced, 'f'))")
    assert res.returncode == 0 and "has f True" in res.stdout, res.stdout + res.stderr


def test_a_relative_cache_dir_is_taken_from_where_the_command_started_and_made_absolute(tmp_path, monkeypatch):
    from opforge.builder.store import cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPFORGE_CACHE_DIR", "rel/cache")
    root = cache_root()
    assert root == tmp_path / "rel" / "cache" and root.is_dir()
    assert os.environ["OPFORGE_CACHE_DIR"] == str(tmp_path / "rel" / "cache"), "the processes it starts get the same cache"
    monkeypatch.chdir(tmp_path / "rel")
    assert cache_root() == tmp_path / "rel" / "cache"


def test_discovery_and_opforge_abi_run_none_of_the_folders_code(tmp_path, monkeypatch, capsys):
    import shutil

    from opforge.cli import main
    from opforge.folders.describe import describe
    from opforge.folders.discover import discover

    marker = tmp_path / "MARKER"
    folder = write(
        tmp_path / "marked",
        {
            "setup.py": _MARKING_SETUP_PY.format(marker=str(marker)),
            "csrc/op.cpp": _LIB + "TORCH_LIBRARY(marked, m) {}\n",
            # A static initializer that leaves a mark when the library loads.
            "init.cpp": f'#include <fstream>\nstatic int mark = (std::ofstream("{marker}") << "loaded", 0);\n',
        },
    )
    layout = discover(folder)
    describe(layout, route=layout.route, cuda_reason=None)
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    so = tmp_path / "marked.so"
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(so), str(folder / "init.cpp")], check=True, timeout=120)
    main(["abi", str(so)])
    capsys.readouterr()
    assert not marker.exists(), marker.read_text()


def test_a_library_without_a_module_init_is_told_from_a_module(needs_missing, tmp_path):
    from opforge.folders.package import has_module_init

    so, _ = needs_missing
    assert not has_module_init(so, "pkg.needs_missing")
    assert has_module_init(Path(subprocess.__file__).with_name("lib-dynload") / "nothing.so", "x"), "unreadable: the import says"
    import _ctypes

    assert has_module_init(Path(_ctypes.__file__), "_ctypes")


@pytest.mark.slow
def test_a_cpp_extension_of_torch_library_code_is_loaded_as_an_op_library_and_an_init_importing_it_is_explained(tmp_path):
    setup = (
        "from setuptools import setup\nfrom torch.utils.cpp_extension import BuildExtension, CppExtension\n"
        "setup(name='tl', packages=['tl'], ext_modules=[CppExtension('tl._C', ['op.cpp'])], cmdclass={'build_ext': BuildExtension})\n"
    )
    op = _LIB + 'TORCH_LIBRARY(tl, m) { m.def("f(Tensor x) -> Tensor"); }\n'
    folder = write(tmp_path / "tl", {"setup.py": setup, "op.cpp": op, "tl/__init__.py": "import torch\n"})
    res = run_build(folder, tmp_path / "cache")
    assert res.returncode == 0 and "`import tl._C` works" in res.stdout and "operators tl::f" in res.stdout, res.stdout + res.stderr
    (folder / "tl" / "__init__.py").write_text("from . import _C\n")
    res = run_build(folder, tmp_path / "cache")
    said = " ".join(res.stderr.split())
    assert res.returncode == 1 and "defines no PyInit_ function: it holds TORCH_LIBRARY operators, not a Python module" in said, said
    assert "loads with torch.ops.load_library(path)" in said
