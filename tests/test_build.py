"""The JIT build: cache keys, reuse, corruption, locking, kills, compiler errors."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from opforge.builder import BuildConfig, BuildError, build_library, cache_root, csrc_dir, library_config, load_library, parse_diagnostics

from .conftest import SRC

# A library with one tiny operator, quick to build (no ATen headers beyond the registration).
TINY = textwrap.dedent(
    """
    #include <torch/library.h>
    static int64_t twice(int64_t x) { return 2 * x; }
    TORCH_LIBRARY(NAMESPACE, m) { m.def("twice(int x) -> int", &twice); }
    """
)


def _tiny(tmp_path: Path, namespace: str, body: str = TINY) -> BuildConfig:
    src = tmp_path / f"{namespace}.cpp"
    src.write_text(body.replace("NAMESPACE", namespace))
    return BuildConfig(name=namespace, sources=(src,), include_dirs=(tmp_path,), cflags=("-O0",))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(d))
    return d


def _run(code: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_cache_dir_is_private(cache):
    assert cache_root() == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_key_follows_content_and_flags(tmp_path):
    cfg = _tiny(tmp_path, "keyed")
    k1 = cfg.key()
    assert cfg.key() == k1
    header = tmp_path / "extra.h"
    header.write_text("#pragma once\n")
    k2 = cfg.key()
    assert k2 != k1, "a header in the include dirs is part of the key"
    cfg.sources[0].write_text(cfg.sources[0].read_text() + "\n// changed\n")
    assert cfg.key() != k2
    flags = BuildConfig(cfg.name, cfg.sources, cfg.include_dirs, cflags=("-O2",))
    assert flags.key() != cfg.key()


@pytest.mark.parametrize("stable", ["", "2.10"], ids=["torch-route", "stable-route"])
def test_a_source_groups_flags_and_include_folders_reach_its_sources_alone(tmp_path, cache, stable):
    """Per-source flags, on both ninja files the engine runs (torch's and the
    stable route's): a.cpp compiles only with its group's -D flag and include
    folder, b.cpp only without them; the group's flags are in the cache key."""
    from opforge.builder.recipe import SourceGroup

    (tmp_path / "inc_a").mkdir()
    (tmp_path / "inc_a" / "only_a.h").write_text("inline int a_part() { return ONLY_A; }\n")
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text('#ifndef ONLY_A\n#error "the group\'s flag is missing"\n#endif\n#include "only_a.h"\nint a_value() { return a_part(); }\n')
    b.write_text(
        '#ifdef ONLY_A\n#error "the group\'s flag reached another source"\n#endif\n'
        '#if __has_include("only_a.h")\n#error "the group\'s include folder reached another source"\n#endif\n'
        "int b_value() { return 1; }\n"
    )
    group = SourceGroup((a,), cflags=("-DONLY_A=2",), include_dirs=(tmp_path / "inc_a",))
    cfg = BuildConfig(f"grouped{stable.replace('.', '_')}", (a, b), (), cflags=("-O0",), stable=stable, groups=(group,))
    assert build_library(cfg, quiet=True).built_now
    other = dataclasses.replace(cfg, groups=(dataclasses.replace(group, cflags=("-DONLY_A=3",)),))
    assert other.key() != cfg.key() and other.objects_key() != cfg.objects_key()
    with pytest.raises(ValueError, match=r"a source group names files that are not among its sources: \[.*c.cpp"):
        BuildConfig("grouped", (a, b), (), groups=(SourceGroup((tmp_path / "c.cpp",), cflags=("-DX",)),))


def test_library_config_covers_every_op_folder():
    cfg = library_config(with_cuda=False)
    names = {p.name for p in cfg.sources}
    for op_dir in (csrc_dir() / "ops").iterdir():
        assert f"{op_dir.name}.cpp" in names
    assert not any(n.endswith(".cu") for n in names)
    cuda = library_config(with_cuda=True)
    assert {f"{d.name}_kernel.cu" for d in (csrc_dir() / "ops").iterdir()} <= {p.name for p in cuda.sources}
    assert "-DOPFORGE_WITH_CUDA" in cuda.cflags and any("code=sm_" in f for f in cuda.cuda_cflags)


def test_build_once_then_reuse_then_rebuild_when_corrupted(tmp_path, cache):
    import torch

    cfg = _tiny(tmp_path, "opforge_tiny_reuse")
    first = load_library(cfg, quiet=True)
    assert first.built_now and torch.ops.opforge_tiny_reuse.twice(21) == 42
    second = load_library(cfg, quiet=True)
    assert not second.built_now and second.path == first.path
    # A truncated library (a disk filled up, a copy cut short) is detected and rebuilt.
    # Written to a new inode: truncating the file this process has mapped would SIGBUS it.
    cut = first.path.with_suffix(".cut")
    cut.write_bytes(first.path.read_bytes()[:1000])
    os.replace(cut, first.path)
    third = load_library(cfg, quiet=True)
    assert third.built_now and third.path.stat().st_size > 1000


def test_two_checkouts_of_the_same_sources_share_one_entry_and_keep_its_file(tmp_path, cache):
    # Two clones of one project (or of opforge) build the same sources from different folders: one
    # cache entry (the key is the content), each under its own file name (its own object directory).
    # The second must take the first one's library, not rebuild the entry and delete a file the
    # first one's processes have loaded or are about to.
    first_dir, second_dir = tmp_path / "clone_a", tmp_path / "clone_b"
    first_dir.mkdir()
    second_dir.mkdir()
    first = _tiny(first_dir, "opforge_tiny_clones")
    second = _tiny(second_dir, "opforge_tiny_clones")
    assert first.key() == second.key() and first.objects_key() != second.objects_key()
    a = build_library(first, quiet=True)
    b = build_library(second, quiet=True)
    assert a.built_now and not b.built_now
    assert b.path == a.path and a.path.is_file()
    assert build_library(first, quiet=True).path == a.path


def test_compiler_error_shows_file_line_and_message(tmp_path, cache):
    cfg = _tiny(tmp_path, "opforge_tiny_broken", body="int broken() {\n  return undeclared_name;\n}\n")
    with pytest.raises(BuildError) as info:
        load_library(cfg, quiet=True)
    msg = str(info.value)
    assert msg.startswith("opforge: building opforge_tiny_broken failed.\n1 compiler error(s):\n")
    # The quotes around the name follow the compiler's locale.
    assert re.search(rf"{re.escape(str(cfg.sources[0]))}:2: .undeclared_name. was not declared in this scope", msg)
    assert "compiler output:" in msg and "full log:" in msg
    # Fixing the source builds: the failed attempt left nothing that blocks.
    cfg.sources[0].write_text(TINY.replace("NAMESPACE", "opforge_tiny_broken"))
    assert load_library(cfg, quiet=True).built_now


def test_parse_diagnostics_gcc_and_nvcc():
    out = "\n".join(
        [
            "[1/3] c++ -c a.cpp -o a.o",
            "FAILED: a.o",
            "/x/csrc/ops/add/add.cpp:12:5: error: 'foo' was not declared in this scope",
            "   12 |     foo();",
            '/x/csrc/ops/add/add_kernel.cu(7): error: identifier "bar" is undefined',
            "/x/a.h:3:10: fatal error: missing.h: No such file or directory",
            "ninja: build stopped: subcommand failed.",
        ]
    )
    diags = parse_diagnostics(out)
    assert [(d.file, d.line) for d in diags] == [("/x/csrc/ops/add/add.cpp", 12), ("/x/csrc/ops/add/add_kernel.cu", 7), ("/x/a.h", 3)]
    assert diags[1].message == 'identifier "bar" is undefined'


def test_static_libstdcxx_is_refused(tmp_path, cache, monkeypatch):
    wrapper_dir = tmp_path / "bin"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "g++"
    wrapper.write_text('#!/bin/sh\nexec /usr/bin/g++ -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("OPFORGE_CXX_FALLBACKS", "")  # no compiler to fall back on: the refusal itself
    body = "#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n"
    cfg = _tiny(tmp_path, "opforge_tiny_static", body=body)
    with pytest.raises(BuildError, match="linked libstdc\\+\\+ statically"):
        load_library(cfg, quiet=True)


def test_second_import_does_not_rebuild():
    code = (
        "import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); import opforge; "
        "print(opforge.library.built_now, time.perf_counter() - t1)"
    )
    _run(code, {})  # the test run's library is built already; make sure of it
    res = _run(code, {})
    assert res.returncode == 0, res.stderr[-3000:]
    built, seconds = res.stdout.split()
    assert built == "False"
    print(f"import opforge with a warm cache: {float(seconds) * 1e3:.0f} ms")
    assert float(seconds) < 2.0  # a rebuild takes ~15 s; loading takes tens of ms
    assert "building" not in res.stderr


def test_import_does_not_initialise_cuda():
    # A CUDA context made at import breaks forked workers and costs hundreds of ms.
    res = _run("import torch, opforge; print(torch.cuda.is_initialized())", {})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "False"


def test_warm_import_stays_light():
    # torch.utils.cpp_extension imports setuptools (~0.5 s); only a build needs it.
    res = _run("import sys, opforge; print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)", {})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "False False"


def _session(sid: int) -> dict[int, str]:
    """Every process under the leader ``sid`` (a Popen with start_new_session),
    by pid, with its command name. Not its process group alone: ninja starts
    each compile in a group of its own."""
    found = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat_file.read_text()
        except OSError:
            continue  # a process that ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, sid, ...
        if int(fields[3]) == sid:
            found[int(stat_file.parent.name)] = text[text.index("(") + 1 : text.rindex(")")]
    return found


@pytest.mark.slow  # a compile, and five interpreters (torchrun and four ranks)
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the compiler through /proc")
def test_killed_build_then_torchrun_ranks_build_once(tmp_path, cache):
    """A cold build killed mid-compile (compiler processes too) must leave
    nothing that blocks the next build. That next build is four ranks under
    torchrun loading the library at once: one compiles, three wait on the lock
    and load the result, and all work. A one-operator library: the lock and the
    debris are the same for opforge's own, which `import opforge` builds and
    loads through this same path."""
    cfg = _tiny(tmp_path, "opforge_tiny_race")
    load = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from opforge.builder import BuildConfig, load_library\n"
        f"lib = load_library(BuildConfig({cfg.name!r}, (Path({str(cfg.sources[0])!r}),), (Path({str(tmp_path)!r}),), {cfg.cflags!r}))\n"
    )
    # OPFORGE_NO_AUTOLOAD: opforge.builder without opforge's own library, which this cache has not.
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", load],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    # The build's own compile, not a compiler probe run before it: after build.ninja is written.
    def compiling() -> bool:
        return bool(list(cache.glob(f"{cfg.name}-*.objects/build.ninja"))) and "cc1plus" in _session(proc.pid).values()

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not compiling():
        time.sleep(0.05)
    assert proc.poll() is None, "the first build finished before it could be killed"
    assert compiling(), "no compile started within 300 s"
    for pid in _session(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    # Debris: a half-built object directory (and its lock file), no finished entry.
    [objects] = cache.glob(f"{cfg.name}-*.objects")
    assert (objects / "build.ninja").is_file() and not list(cache.glob(f"{cfg.name}-*[0-9a-f]"))

    script = tmp_path / "rank.py"
    script.write_text(
        load + "import os\n"
        "ok = torch.ops.opforge_tiny_race.twice(21) == 42\n"
        "out = Path(__file__).with_name(f\"rank{os.environ['RANK']}.txt\")\n"
        'out.write_text(f"built={lib.built_now} ok={ok}")\n'
    )
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(script)],
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # Each rank writes its own file: ranks share stdout and their lines interleave.
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(4)]
    assert sum("built=True" in line for line in lines) == 1, lines
    assert all("ok=True" in line for line in lines), lines
    [entry] = cache.glob(f"{cfg.name}-*[0-9a-f]")
    assert (entry / "COMPLETE.json").is_file(), sorted(p.name for p in cache.iterdir())
    assert list(cache.glob(f"{cfg.name}-*.objects")) == [objects], "the killed build's object directory was built in, not set aside"


def test_changing_one_source_recompiles_only_it(tmp_path, cache):
    import torch

    a, b = tmp_path / "one_a.cpp", tmp_path / "one_b.cpp"
    frag = (
        "#include <torch/library.h>\n"
        "static int64_t {f}(int64_t x) {{ return x + {v}; }}\n"
        'TORCH_LIBRARY_FRAGMENT(opforge_tiny_incr, m) {{ m.def("{f}(int x) -> int", &{f}); }}\n'
    )
    a.write_text(frag.format(f="fa", v=1))
    b.write_text(frag.format(f="fb", v=2))
    cfg = BuildConfig("opforge_tiny_incr", (a, b), (tmp_path,), ("-O0",))
    first = load_library(cfg, quiet=True)
    assert first.built_now and torch.ops.opforge_tiny_incr.fb(1) == 3
    (objects,) = cache.glob("opforge_tiny_incr-*.objects")
    log = objects / ".ninja_log"
    before = len(log.read_text().splitlines())
    b.write_text(frag.format(f="fb", v=2) + "// an edit\n")
    second = build_library(cfg, quiet=True)
    assert second.built_now and second.key != first.key and second.path != first.path
    rebuilt = [line.split("\t")[3] for line in log.read_text().splitlines()[before:]]
    assert sorted(rebuilt) == ["one_b.o", f"{second.path.stem}.so"], rebuilt
    # The first entry is untouched: a process that loaded it keeps a valid file.
    assert first.path.exists() and first.path.stat().st_ino != second.path.stat().st_ino


@pytest.mark.parametrize(("release", "fails"), [("11.8", True), ("13.9", False)])
def test_nvcc_of_another_cuda_than_torch_is_explained_before_compiling(tmp_path, monkeypatch, capsys, release, fails):
    from torch.utils import cpp_extension

    from opforge.builder import jit

    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cfg = dataclasses.replace(_tiny(tmp_path, "mismatch"), with_cuda=True)
    if fails:
        with pytest.raises(BuildError, match=r"nvcc is 11\.8 but torch was built with 13\.0.*Fix: point CUDA_HOME at a 13\.x toolkit"):
            jit._check_toolchain(cfg)
    else:
        jit._check_toolchain(cfg)
        assert "warning: nvcc is 13.9 but torch was built with 13.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "archs"),
    [
        ("9.0", ("9.0a",)),  # wgmma needs sm_90a: a 9.0 target is always built as 9.0a
        ("8.0;9.0+PTX", ("8.0", "9.0a")),
        ("9.0a 8.6", ("8.6", "9.0a")),
        ("9.0;9.0a", ("9.0a",)),  # one target, not two cubins for the driver to choose between
        ("10.0;8.0;9.0", ("8.0", "9.0a", "10.0")),  # numeric order, not string order
    ],
)
def test_cuda_archs_from_the_env(monkeypatch, env, archs):
    import opforge.builder as ob

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    assert ob.cuda_archs() == archs


@pytest.mark.parametrize(
    ("value", "flag"),
    [("1", True), ("yes", True), ("TRUE", True), (" On ", True), ("0", False), ("no", False), ("False", False), ("OFF", False), ("", None)],
)
def test_build_cuda_flag_words(monkeypatch, value, flag):
    import opforge.builder as ob

    monkeypatch.setenv("OPFORGE_BUILD_CUDA", value)
    assert ob.build_cuda_flag() is flag


@pytest.mark.parametrize("value", ["2", "maybe", "gpu"])
def test_build_cuda_flag_other_values_are_errors(monkeypatch, value):
    import opforge.builder as ob

    monkeypatch.setenv("OPFORGE_BUILD_CUDA", value)
    for read in (ob.build_cuda_flag, ob.want_cuda, lambda: ob.folder_config(csrc_dir() / "ops" / "add")):
        with pytest.raises(BuildError, match=rf"^opforge: OPFORGE_BUILD_CUDA='{value}' is neither on nor off: set it to 1 or 0"):
            read()


def test_build_cuda_yes_on_a_cpu_torch_is_refused(monkeypatch):
    # "yes" means on: with a CPU torch that is an error, never a quiet CPU-only build.
    import opforge.builder as ob

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "yes")
    with pytest.raises(BuildError, match=r"OPFORGE_BUILD_CUDA=yes but this torch build has no CUDA"):
        ob.want_cuda()


def test_cuda_archs_from_the_gpus_and_default(monkeypatch):
    import opforge.builder as ob
    from opforge.builder import archs

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(archs, "_nvml_capabilities", lambda: {(9, 0), (8, 0)})
    assert ob.cuda_archs() == ("8.0", "9.0a")
    monkeypatch.setattr(archs, "_nvml_capabilities", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ob.cuda_archs() == ("8.0", "9.0a")


@pytest.mark.parametrize(
    ("archs", "flags"),
    [
        (
            ("8.0", "9.0a"),
            [
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90a,code=sm_90a",
                # Portable PTX: compute_90a PTX would run on no GPU but a 9.0.
                "-gencode=arch=compute_90,code=compute_90",
            ],
        ),
        (("8.6",), ["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_86,code=compute_86"]),
        (
            ("9.0a", "10.0"),
            [
                "-gencode=arch=compute_90a,code=sm_90a",
                "-gencode=arch=compute_100,code=sm_100",
                "-gencode=arch=compute_100,code=compute_100",
            ],
        ),
    ],
)
def test_gencode_flags(archs, flags):
    from opforge.builder.archs import gencode_flags as _gencode_flags

    assert _gencode_flags(archs) == flags


def test_library_config_targets_sm_90a(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    cfg = library_config(with_cuda=True)
    assert cfg.cuda_archs == ("8.0", "9.0a")
    assert "-gencode=arch=compute_90a,code=sm_90a" in cfg.cuda_cflags
    assert not any("code=sm_90," in f or f.endswith("code=sm_90") for f in cfg.cuda_cflags)
