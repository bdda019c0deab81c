"""The toolchain a build uses: the static-libstdc++ compiler caught by a probe
and replaced by one that links it dynamically, the probe's cache, nvcc's host
compiler, and precompiled headers that are built once and actually used."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opforge.builder import BuildConfig, BuildError, load_library, pch, toolchain
from opforge.builder.flags import torch_cxx_flags

from .conftest import SRC

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None or shutil.which("readelf") is None, reason="needs g++ and readelf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache, and none of the variables that choose compilers."""
    for var in ("CXX", "CC", "CUDAHOSTCXX", "OPFORGE_CXX_FALLBACKS", "OPFORGE_PCH"):
        monkeypatch.delenv(var, raising=False)
    d = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(d))
    return d


def _static_gxx(folder: Path, name: str = "g++") -> Path:
    """A compiler that links libstdc++ statically, as a devtoolset-style GCC does."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / name
    wrapper.write_text(f'#!/bin/sh\nexec {GXX} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return wrapper


def _note(configured: Path, used: str) -> str:
    why = "links libstdc++ statically (a second copy beside torch's breaks its exceptions)"
    return f"opforge: CXX={configured} {why}; building with {used} instead"


def test_the_probe_tells_static_from_shared_and_caches_its_verdict(tmp_path, monkeypatch):
    wrapper = _static_gxx(tmp_path / "bin")
    first = toolchain.verdict(str(wrapper))
    assert (first.libstdcxx, first.cached) == ("static", False), first
    assert toolchain.verdict(GXX).libstdcxx == "shared"

    def no_probe(*args):
        raise AssertionError("probed again despite the cached verdict")

    monkeypatch.setattr(toolchain, "probe_libstdcxx", no_probe)
    again = toolchain.verdict(str(wrapper))
    assert (again.libstdcxx, again.cached) == ("static", True)
    # A changed compiler (here: its size) is probed again.
    wrapper.write_text(wrapper.read_text() + "# edited\n")
    with pytest.raises(AssertionError, match="probed again"):
        toolchain.verdict(str(wrapper))


def test_a_static_cxx_falls_back_to_a_dynamic_one(tmp_path, monkeypatch):
    wrapper = _static_gxx(tmp_path / "bin")
    monkeypatch.setenv("CXX", str(wrapper))
    tc = toolchain.resolve(with_cuda=False)
    assert tc.cxx.fell_back and os.path.realpath(tc.cxx.use) == os.path.realpath(GXX)
    [line] = tc.notes()
    assert line == _note(wrapper, tc.cxx.use)
    # Statically linking candidates are passed over.
    monkeypatch.setenv("OPFORGE_CXX_FALLBACKS", os.pathsep.join([str(_static_gxx(tmp_path / "other")), GXX]))
    assert toolchain.resolve(with_cuda=False).cxx.use == GXX
    with toolchain.applied(tc):
        assert os.environ["CXX"] == tc.cxx.use
    assert os.environ["CXX"] == str(wrapper)


def test_no_fallback_is_the_clear_error(tmp_path, monkeypatch):
    wrapper = _static_gxx(tmp_path / "bin")
    monkeypatch.setenv("CXX", str(wrapper))
    assert toolchain.verdict(str(wrapper)).libstdcxx == "static"  # probed with the full PATH (as, ld), then cached
    # PATH without a g++ of its own: the wrapper's folder, and readelf.
    (wrapper.parent / "readelf").symlink_to(shutil.which("readelf"))
    monkeypatch.setenv("PATH", str(wrapper.parent))
    monkeypatch.setattr(toolchain, "FALLBACKS", ("g++",))
    with pytest.raises(BuildError, match=r"linked libstdc\+\+ statically into a probe library, and no compiler that links it dynamically"):
        toolchain.resolve(with_cuda=False)
    monkeypatch.setenv("OPFORGE_CXX_FALLBACKS", "")
    with pytest.raises(BuildError, match=r"CXX=g\+\+ CC=gcc CUDAHOSTCXX=g\+\+"):
        toolchain.resolve(with_cuda=False)


def test_nvccs_host_compiler_falls_back_through_ccbin(tmp_path, monkeypatch):
    wrapper = _static_gxx(tmp_path / "bin")
    monkeypatch.setenv("CUDAHOSTCXX", str(wrapper))
    tc = toolchain.resolve(with_cuda=True)
    assert tc.cuda_host is not None and tc.cuda_host.fell_back
    assert [n for n in tc.notes() if "CUDAHOSTCXX=" in n]
    # torch passes $CC to nvcc as -ccbin (a second -ccbin would be an nvcc error).
    with toolchain.applied(tc):
        assert os.environ["CC"] == tc.cuda_host.use
    assert "CC" not in os.environ
    # A C driver is judged by its C++ sibling: gcc links no libstdc++ at all.
    gcc = _static_gxx(tmp_path / "cc", "gcc")
    _static_gxx(tmp_path / "cc", "g++")
    monkeypatch.delenv("CUDAHOSTCXX")
    monkeypatch.setenv("CC", str(gcc))
    assert toolchain.resolve(with_cuda=True).cuda_host.fell_back


TINY = textwrap.dedent(
    """
    #include <sstream>
    #include <string>
    #include <torch/library.h>
    static std::string show(int64_t x) { std::ostringstream s; s << x; return s.str(); }
    static int64_t twice(int64_t x) { TORCH_CHECK(x >= 0, "twice: got ", show(x)); return 2 * x; }
    TORCH_LIBRARY(NAMESPACE, m) { m.def("twice(int x) -> int", &twice); }
    """
)


def _tiny(tmp_path: Path, namespace: str, **kw) -> BuildConfig:
    src = tmp_path / f"{namespace}.cpp"
    src.write_text(TINY.replace("NAMESPACE", namespace))
    return BuildConfig(name=namespace, sources=(src,), include_dirs=(tmp_path,), cflags=("-O0",), **kw)


def test_a_build_with_a_static_cxx_uses_the_fallback_and_says_so(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("CXX", str(_static_gxx(tmp_path / "bin")))
    load_library(_tiny(tmp_path, "opforge_tiny_fallback"))
    assert torch.ops.opforge_tiny_fallback.twice(4) == 8
    # Torch's exceptions work: the library shares torch's libstdc++.
    with pytest.raises(RuntimeError, match="twice: got -3"):
        torch.ops.opforge_tiny_fallback.twice(-3)
    err = capsys.readouterr().err
    assert err.count("links libstdc++ statically") == 1 and f"building with {GXX} instead" in err


def _compile_commands(objects: Path) -> list[str]:
    ninja = shutil.which("ninja") or str(Path(__import__("ninja").BIN_DIR) / "ninja")
    out = subprocess.run([ninja, "-C", str(objects), "-t", "commands"], capture_output=True, text=True, check=True).stdout
    return [c for c in out.splitlines() if " -c " in c]


def _uses_pch(cmd: str, cwd: Path) -> str:
    argv = shlex.split(cmd)
    i = argv.index("-o")
    del argv[i : i + 2]
    res = subprocess.run([*argv, "-H", "-fsyntax-only"], cwd=cwd, capture_output=True, text=True)
    return next((ln for ln in res.stderr.splitlines() if ln.endswith(".gch")), "")


def test_a_precompiled_header_is_built_once_and_used(tmp_path, cache, capsys):
    # <vector> stands in for torch's headers: the mechanism, quickly.
    cfg = _tiny(tmp_path, "opforge_tiny_pch", pch_headers=("<vector>",))
    load_library(cfg)
    [entry] = cache.glob("pch-*/pch.h.gch")
    [objects] = cache.glob("opforge_tiny_pch-*.objects")
    [cmd] = _compile_commands(objects)
    # torch's own flags, as learned, are the ones it compiled with: gcc takes the header.
    assert _uses_pch(cmd, objects).startswith(f"! {entry}")
    assert "precompiling <vector>" in capsys.readouterr().err
    with pch.precompiled_header(("<vector>",), [f"-I{tmp_path}", *torch_cxx_flags(), "-O0"], compiler="c++") as again:
        assert again is not None and again.gch == entry and again.seconds is None  # reused, not rebuilt
    with pch.precompiled_header(("<vector>",), ["-O1"], compiler="c++") as other:
        assert other is not None and other.gch != entry  # other flags, another header


def test_precompiled_header_rebuilds_after_a_header_changes_and_gives_up_quietly(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "mine.h").write_text("#include <vector>\n")
    (inc / "more.h").write_text('#include <string>\n#include "mine.h"\n')
    flags = [f"-I{inc}", "-O1"]
    with pch.precompiled_header(('"more.h"',), flags, compiler="c++", quiet=True) as first:
        assert first is not None and first.seconds is not None
    # An edit of a header it includes, not named in the key, is noticed from gcc's dependency list.
    (inc / "mine.h").write_text("#include <vector>\n#include <map>\n")
    with pch.precompiled_header(('"more.h"',), flags, compiler="c++", quiet=True) as second:
        assert second is not None and second.seconds is not None
    (inc / "broken.h").write_text("#error no\n")
    with pch.precompiled_header(('"broken.h"',), flags, compiler="c++", quiet=True) as broken:
        assert broken is None
    monkeypatch.setenv("OPFORGE_PCH", "0")
    with pch.precompiled_header(('"more.h"',), flags, compiler="c++") as off:
        assert off is None


@pytest.mark.slow
def test_import_opforge_with_a_static_cxx_builds_with_the_fallback(tmp_path):
    """The whole library from an empty cache: the one line, and every compile on the fallback compiler."""
    wrapper = _static_gxx(tmp_path / "bin")
    cache = tmp_path / "fresh-cache"
    # OPFORGE_FAST=0: the fast path's module builds in the background, after this short process is gone.
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "CXX": str(wrapper),
        "OPFORGE_CACHE_DIR": str(cache),
        "OPFORGE_LIBRARY": "jit",
        "OPFORGE_FAST": "0",
    }
    code = "import torch, opforge; assert opforge.square(torch.tensor([3.0])).item() == 9.0; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    notes = [ln for ln in res.stderr.splitlines() if "links libstdc++ statically" in ln]
    assert notes == [_note(wrapper, GXX)]
    [objects] = cache.glob("opforge_ops-*.objects")
    commands = _compile_commands(objects)
    # The ops' wrappers as one unit (the fast path's module is a library of its own).
    argvs = [shlex.split(c) for c in commands]
    assert sorted(Path(a[a.index("-c") + 1]).name for a in argvs) == ["opforge_ops_unity.cpp"]
    assert all(a[0] == GXX for a in argvs), commands
