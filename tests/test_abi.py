"""``opforge abi``: a tiny library calling only the stable C shim is stable (exit 0) and
says from which torch on; one calling a c10 C++ function is not (exit 1) and names it;
a wheel is audited library by library; a file that is no library is refused (exit 2).
The shim's version table comes from the installed torch's headers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import opforge
from opforge.abi.audit import FLOOR, LibraryAudit, audit_library, parse_shim_header, render, shim_table, torch_include
from opforge.elf_symbols import read_dynamic_symbols

from .conftest import SRC

CXX = shutil.which("c++") or shutil.which("g++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++) on PATH")

# Declared by hand, as a library built against the shim's headers would take them: the
# test needs only the symbols' names in the library, not torch's headers.
STABLE_SRC = """
#include <cstdint>
extern "C" {
int32_t aoti_torch_dtype_float32();
int32_t torch_new_list_reserve_size(std::size_t size, void** ret);
}
extern "C" int32_t probe() {
  void* list = nullptr;
  return aoti_torch_dtype_float32() + torch_new_list_reserve_size(4, &list);
}
"""
# A C++ function of libc10, as TORCH_CHECK's failure path calls it.
UNSTABLE_SRC = """
#include <string>
namespace c10 { namespace detail {
[[noreturn]] void torchCheckFail(const char* func, const char* file, unsigned int line, const std::string& msg);
} }
extern "C" void probe(int ok) {
  if (!ok) c10::detail::torchCheckFail("probe", "probe.cpp", 1, "not ok");
}
"""


def compile_library(tmp: Path, name: str, source: str) -> Path:
    cpp, so = tmp / f"{name}.cpp", tmp / f"{name}.so"
    cpp.write_text(source)
    res = subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", "-O1", str(cpp), "-o", str(so)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return so


def abi_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m opforge.abi ARGS` in a process of its own, as where the opforge command is not installed."""
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "opforge.abi", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def abi(capsys):
    """The same command in this process (a process of its own would import torch again for each):
    its exit status, stdout and stderr."""
    from opforge.cli.abi import main

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    if CXX is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    tmp = tmp_path_factory.mktemp("abi")
    return {"stable": compile_library(tmp, "stable", STABLE_SRC), "unstable": compile_library(tmp, "unstable", UNSTABLE_SRC)}


def test_version_table_comes_from_the_installed_headers():
    table = shim_table()
    versions = table.versions()
    assert versions[0] == FLOOR == (2, 10)
    assert table.torch_version >= (2, 10) and versions[-1] <= table.torch_version
    # Functions outside any guard are 2.10's; the stable shim's own additions carry their guard.
    assert table.functions["aoti_torch_dtype_float32"] == (2, 10)
    assert table.functions["torch_new_list_reserve_size"] == (2, 10)
    assert table.functions["torch_library_impl"] == (2, 10)
    if table.torch_version >= (2, 11):
        assert table.functions["torch_from_blob"] == (2, 11)
        assert (2, 11) in versions
    assert table.include == torch_include()


def test_header_parser_follows_nested_guards_and_multiline_declarations():
    header = """
    // AOTI_TORCH_EXPORT int32_t in_a_comment();
    AOTI_TORCH_EXPORT int32_t plain();
    #if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_11_0
    AOTI_TORCH_EXPORT AOTITorchError
    split_over_lines(int64_t a,
                     int64_t b);
    #ifdef USE_CUDA
    AOTI_TORCH_EXPORT AOTITorchError cuda_only(void* stream);
    #endif
    #if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
    /* block */ AOTI_TORCH_EXPORT const char* newest();
    #endif
    #endif
    #if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_12_0
    AOTI_TORCH_EXPORT int32_t twelve();
    #else
    AOTI_TORCH_EXPORT int32_t fallback();
    #endif
    """
    assert parse_shim_header(header) == {
        "plain": (2, 10),
        "split_over_lines": (2, 11),
        "cuda_only": (2, 11),
        "newest": (2, 13),
        "twelve": (2, 12),
        "fallback": (2, 10),
    }


def test_both_symbol_readers_agree(libs):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not on PATH")
    for so in libs.values():
        by_nm, by_elf = read_dynamic_symbols(so, reader="nm"), read_dynamic_symbols(so, reader="elf")
        assert (by_nm.undefined, by_nm.defined, by_nm.needed) == (by_elf.undefined, by_elf.defined, by_elf.needed)
        assert "probe" in by_elf.defined and "probe" not in by_elf.undefined


def test_a_library_on_the_shim_is_stable(libs):
    # As a user runs it: `python -m opforge.abi`, in a process of its own.
    res = abi_cli(str(libs["stable"]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 from torch's stable C shim, 0 from torch outside it" in res.stdout
    assert "its shim calls need torch >= 2.10" in res.stdout
    assert "verdict: stable: loads in every torch >= 2.10" in res.stdout


def test_a_library_taking_a_c10_function_is_not_stable(libs, abi):
    res = abi(str(libs["unstable"]))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "NOT STABLE: 1 symbol of libtorch/libc10" in res.stdout
    if shutil.which("c++filt"):
        assert "c10::* (C++): 1" in res.stdout
        assert "c10::detail::torchCheckFail(char const*, char const*, unsigned int," in res.stdout
    else:
        assert "_ZN3c106detail14torchCheckFail" in res.stdout
    assert res.stdout.rstrip().splitlines()[-1].startswith("verdict: NOT STABLE: 1 symbol in 1 of 1 library")


def test_mangled_names_are_sorted_without_cplusplus_filt(libs, monkeypatch):
    # Where binutils' c++filt is missing, the mangled name itself says c10.
    monkeypatch.setattr("opforge.abi.audit.demangle", lambda names: {})
    table = shim_table()
    audit = audit_library(libs["unstable"], table, reader="elf")
    assert list(audit.unstable) == ["torch C++ (mangled)"]
    assert [s[:35] for s in audit.unstable["torch C++ (mangled)"]] == ["_ZN3c106detail14torchCheckFailEPKcS"]
    assert not audit.demangled and any("c++filt" in n for n in audit.notes)
    stable = audit_library(libs["stable"], table, reader="elf")
    assert stable.stable and stable.min_version() == (2, 10)


def test_a_wheel_is_audited_library_by_library(libs, tmp_path, abi):
    wheel = tmp_path / "probe-0.1-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(libs["stable"], "probe/_C.abi3.so")
        z.write(libs["unstable"], "probe/libhelper.so.1")
        z.writestr("probe/__init__.py", "")
    res = abi(str(wheel))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{wheel.name}!probe/_C.abi3.so" in res.stdout and f"{wheel.name}!probe/libhelper.so.1" in res.stdout
    assert "in 1 of 2 libraries" in res.stdout
    only_stable = tmp_path / "stable.whl"
    with zipfile.ZipFile(only_stable, "w") as z:
        z.write(libs["stable"], "probe/_C.abi3.so")
    res = abi(str(only_stable))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.so", "missing.so: no such file"),
        (lambda d: (d / "notes.so").write_text("not a library\n") and d / "notes.so", "notes.so is not an ELF file"),
        (lambda d: d, "is a directory: give a shared library (.so) or a wheel (.whl)"),
        (lambda d: _zip(d / "empty.whl"), "empty.whl holds no shared library (.so): nothing to audit"),
        (lambda d: (d / "bad.whl").write_bytes(b"PK\x03\x04 truncated") and d / "bad.whl", "bad.whl is not"),
    ],
    ids=["missing", "text", "directory", "empty-wheel", "broken-wheel"],
)
def test_what_is_no_library_is_refused_with_exit_2(tmp_path, make, message, abi):
    res = abi(str(make(tmp_path)))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("opforge abi: ") and message in res.stderr, res.stderr
    assert res.stdout == ""


def _zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
    return path


def test_report_lists_the_first_symbols_then_how_many_more():
    audit = LibraryAudit("lib.so", unstable={"c10::* (C++)": [f"c10::f{i}()" for i in range(30)], "at::* (C++)": ["at::g()"]})
    text = render([audit], shim_table(), show=20)
    assert "c10::f0()" in text and "at::g()" in text and "c10::f29()" not in text
    assert "and 20 more (--all lists every one)" in text  # 10 per group of 2
    assert "c10::f29()" in render([audit], shim_table(), show=sys.maxsize)


def test_opforge_op_library_is_stable(abi):
    # opforge's own library is on the stable ABI: one build for every torch from 2.10 on.
    res = abi(str(opforge.load().path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verdict: stable: loads in every torch >= 2.10" in res.stdout


def test_the_fast_path_module_is_not_stable(abi):
    # The eager fast path uses torch's private autograd headers: built per torch, and said so.
    from opforge import fast

    module = fast.module()
    if module is None:
        pytest.skip(f"the fast path is off: {fast.why_off}")
    res = abi(module.__file__)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "verdict: NOT STABLE" in res.stdout
