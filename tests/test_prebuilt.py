"""The ahead-of-time route: `pip install` builds opforge._C; the import loads it
when it fits, else builds by JIT. A stable-ABI library (opforge's own) fits
every torch from the one it targets on, any CUDA and any Python; a library of
the older kind only the torch, CUDA and Python it was built for. Either must
come from the sources as they are and cover the GPUs' archs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from opforge.builder import BuildConfig, BuildError, library_config
from opforge.builder import prebuilt as pb
from opforge.builder.setuptools_ext import build_record

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_prebuilt(tmp_path, monkeypatch) -> Path:
    """A stand-in stable `_C` library with a record that fits this process."""
    so = tmp_path / "_C.abi3.so"
    so.write_bytes(b"\x7fELF not really")
    monkeypatch.setattr(pb, "prebuilt_path", lambda: so)
    monkeypatch.setattr(pb, "_gpu_capabilities", lambda: set())
    monkeypatch.delenv("OPFORGE_LIBRARY", raising=False)
    _write_record(so, build_record(library_config(with_cuda=False)))
    return so


def _write_record(so: Path, record: dict) -> None:
    so.with_name("_C.build.json").write_text(json.dumps(record))


def _one_torch_record() -> dict:
    """The build record of a library for this torch, CUDA and Python alone (not on the stable ABI)."""
    return build_record(dataclasses.replace(library_config(with_cuda=False), stable=""))


def test_stable_record_names_its_target_not_this_python():
    record = build_record(library_config(with_cuda=False))
    assert record["stable"] == "2.10" and record["format"] == 2
    assert record["built_with_torch"] == torch.__version__  # for information: no rule reads it
    assert not {"torch", "cuda", "python"} & set(record)
    old = _one_torch_record()
    assert "stable" not in old and old["format"] == 1
    assert (old["torch"], old["cuda"], old["python"]) == (torch.__version__, torch.version.cuda, sys.implementation.cache_tag)


def test_fitting_prebuilt_is_chosen(fake_prebuilt):
    so, why = pb.choose_prebuilt()
    assert so == fake_prebuilt
    assert "CPU kernels only" in why and "stable ABI: torch 2.10 and later" in why and torch.__version__ in why


def test_no_prebuilt_means_jit(fake_prebuilt):
    fake_prebuilt.unlink()
    so, why = pb.choose_prebuilt()
    assert so is None and "--no-build-isolation" in why


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0a0+git1234567", "2.11.1+cu128", "2.99.0", "3.0.0"])
def test_stable_prebuilt_fits_every_torch_from_its_target_on(fake_prebuilt, monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    so, why = pb.choose_prebuilt()
    assert so == fake_prebuilt, why
    assert f"this is {version}" in why


@pytest.mark.parametrize("version", ["2.9.1", "2.9.0+cu126", "1.13.1"])
def test_stable_prebuilt_refuses_a_torch_below_its_target(fake_prebuilt, monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    so, why = pb.choose_prebuilt()
    assert so is None
    assert why == f"the prebuilt {fake_prebuilt.name} is on the stable ABI of torch 2.10 and later, this is torch {version}"


def test_stable_prebuilt_fits_any_cuda_and_any_python(fake_prebuilt, monkeypatch):
    record = build_record(library_config(with_cuda=False))
    # Fields of the older kind of record, which a stable one does not read.
    record.update(torch="1.0.0", cuda="9.9", python="cpython-27")
    _write_record(fake_prebuilt, record)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(sys.implementation, "cache_tag", "cpython-399")
    so, why = pb.choose_prebuilt()
    assert so == fake_prebuilt, why


@pytest.mark.parametrize("target", ["banana", "2", "2.9"])
def test_stable_record_with_no_usable_target_is_not_loaded(fake_prebuilt, target):
    record = build_record(library_config(with_cuda=False))
    record["stable"] = target
    _write_record(fake_prebuilt, record)
    so, why = pb.choose_prebuilt()
    assert so is None and f"names no torch version it targets (stable: {target!r})" in why


def test_prebuilt_of_one_torch_fits_that_torch(fake_prebuilt):
    _write_record(fake_prebuilt, _one_torch_record())
    so, why = pb.choose_prebuilt()
    assert so == fake_prebuilt, why
    assert why == f"prebuilt {fake_prebuilt.name} (torch {torch.__version__}, CPU kernels only)"


@pytest.mark.parametrize(("field", "value"), [("torch", "1.0.0"), ("torch", "2.99.0"), ("cuda", "9.9"), ("python", "cpython-27")])
def test_prebuilt_of_one_torch_for_another_torch_cuda_or_python_is_not_loaded(fake_prebuilt, field, value):
    record = _one_torch_record()
    record[field] = value
    _write_record(fake_prebuilt, record)
    so, why = pb.choose_prebuilt()
    assert so is None
    assert f"built for {field} {value}" in why


def test_prebuilt_path_prefers_the_stable_library(tmp_path, monkeypatch):
    import importlib.machinery

    package = tmp_path / "opforge"
    (package / "builder").mkdir(parents=True)
    monkeypatch.setattr(pb, "__file__", str(package / "builder" / "prebuilt.py"))
    stable, one_python = package / "_C.abi3.so", package / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    assert pb.prebuilt_path() == stable  # neither: where pip install puts opforge's own now
    one_python.write_bytes(b"")
    assert pb.prebuilt_path() == one_python
    stable.write_bytes(b"")
    assert pb.prebuilt_path() == stable


def test_prebuilt_from_other_sources_is_not_loaded(fake_prebuilt):
    record = build_record(library_config(with_cuda=False))
    record["sources_digest"] = "0" * 64
    _write_record(fake_prebuilt, record)
    so, why = pb.choose_prebuilt()
    assert so is None and "sources changed" in why


def test_missing_or_garbled_record(fake_prebuilt):
    fake_prebuilt.with_name("_C.build.json").write_text("{not json")
    so, why = pb.choose_prebuilt()
    assert so is None and "build record" in why


def test_prebuilt_without_the_gpus_arch_is_not_loaded(fake_prebuilt, monkeypatch):
    record = build_record(library_config(with_cuda=False))
    record.update(with_cuda=True, cuda_archs=["8.0", "9.0a"])
    monkeypatch.setattr(pb, "_gpu_capabilities", lambda: {"7.5"})
    # The CUDA sources need not exist for this: the record says CPU sources.
    monkeypatch.setattr(pb, "library_config", lambda with_cuda=None: library_config(with_cuda=False))
    _write_record(fake_prebuilt, record)
    so, why = pb.choose_prebuilt()
    assert so is None and "7.5" in why and "8.0, 9.0a" in why


@pytest.mark.parametrize("jit_builds_cuda", [False, True])
def test_a_cpu_prebuilt_on_a_gpu_machine_fits_where_the_jit_route_would_build_no_cuda_either(fake_prebuilt, monkeypatch, jit_builds_cuda):
    # A package scaffolded without CUDA (its sources build CPU kernels only, whatever the machine) on a
    # machine with a GPU and nvcc: its CPU wheel is what the JIT route would build again.
    cpu = library_config(with_cuda=False)
    monkeypatch.setattr(pb, "_gpu_capabilities", lambda: {"9.0"})
    monkeypatch.setattr(pb, "want_cuda", lambda stable=False: True)

    def sources(cuda: bool | None) -> BuildConfig:
        return dataclasses.replace(cpu, with_cuda=jit_builds_cuda if cuda is None else cuda)

    ok, why = pb.prebuilt_fits(fake_prebuilt, sources)
    if jit_builds_cuda:
        assert not ok and why == (
            f"the prebuilt {fake_prebuilt.name} has no CUDA kernels, and this machine has a GPU and nvcc: the JIT route builds them"
        )
    else:
        assert ok and "CPU kernels only" in why, why


@pytest.mark.parametrize(
    ("capability", "built", "covered"),
    [
        ("9.0", ("8.0", "9.0"), True),
        ("9.0", ("8.0", "9.0a"), True),  # sm_90a cubin runs on sm_90
        ("8.6", ("8.0", "9.0"), False),  # no 8.6 cubin; compute_90 PTX cannot run on 8.6
        ("10.0", ("8.0", "9.0"), True),  # compute_90 PTX JIT-compiles for newer GPUs
        ("10.0", ("9.0a",), True),  # a 9.0a build carries portable compute_90 PTX
        ("8.6", ("8.0", "9.0a"), False),  # compute_90 PTX cannot run on 8.6
        ("12.0", ("8.0", "10.0"), True),  # numeric order: 10.0 is newer than 8.0
    ],
)
def test_arch_coverage(capability, built, covered):
    assert pb._covered(capability, built) is covered


def test_library_mode_env(fake_prebuilt, monkeypatch):
    monkeypatch.setenv("OPFORGE_LIBRARY", "jit")
    assert pb.choose_prebuilt() == (None, "OPFORGE_LIBRARY=jit")
    monkeypatch.setenv("OPFORGE_LIBRARY", "wheel")
    with pytest.raises(BuildError, match=r"OPFORGE_LIBRARY='wheel' is not one of auto, prebuilt, jit"):
        pb.choose_prebuilt()


def test_prebuilt_required_but_unusable_is_an_error(fake_prebuilt, monkeypatch):
    fake_prebuilt.unlink()
    monkeypatch.setenv("OPFORGE_LIBRARY", "prebuilt")
    with pytest.raises(BuildError, match=r"OPFORGE_LIBRARY=prebuilt, but no prebuilt library"):
        pb.load_op_library()


def test_doctor_names_the_route(fake_prebuilt):
    from opforge.doctor import report as doctor

    report = doctor.collect()
    assert report.library.route == "prebuilt"
    assert report.library.entry_path == str(fake_prebuilt)
    fake_prebuilt.unlink()
    report = doctor.collect()
    assert report.library.route == "JIT" and "no prebuilt library" in report.library.prebuilt


def test_setup_extension_comes_from_the_library_config():
    from opforge.builder.setuptools_ext import library_extension, wheel_options

    ext = library_extension(REPO)
    cfg = library_config()
    assert ext.name == "opforge._C" and ext.py_limited_api
    assert sorted(ext.sources) == sorted(os.path.relpath(s, REPO) for s in cfg.sources)
    assert all(not os.path.isabs(s) for s in ext.sources)
    assert ext._opforge_config == cfg  # its flags are the config's: opforge's stable route builds it
    assert wheel_options(ext) == {"bdist_wheel": {"py_limited_api": "cp310"}}


def test_setup_extension_of_one_torch_is_torchs():
    from opforge.builder.setuptools_ext import extension, wheel_options

    cfg = dataclasses.replace(library_config(with_cuda=False), stable="")
    ext = extension(cfg, "opforge._C", REPO)
    # Python's own CFLAGS (-g, usually) come first; -g0 after them, as the JIT route builds without debug info.
    assert not ext.py_limited_api and ext.extra_compile_args["cxx"] == [*cfg.cflags, "-g0"]
    assert wheel_options(ext) == {}
    debug = dataclasses.replace(cfg, cflags=(*cfg.cflags, "-g"))
    assert extension(debug, "opforge._C", REPO).extra_compile_args["cxx"] == [*cfg.cflags, "-g"], "a -g of its own stays"


def _copy_project(dest: Path) -> Path:
    """The project's committed layout, without build outputs or the venv."""
    junk = shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", ".*cache", "*.so", "_C.build.json")

    def ignore(directory: str, names: list[str]) -> set[str]:
        top = {"build", "dist"} & set(names) if Path(directory) == REPO else set()
        return set(junk(directory, names)) | top

    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


@pytest.mark.slow
def test_wheel_installs_and_passes_the_cpu_tests_in_a_fresh_venv(tmp_path):
    """pip wheel (torch from this environment) -> a fresh venv, the wheel its
    only package -> the CPU op tests against the installed wheel, with
    OPFORGE_LIBRARY=prebuilt so that a JIT fallback cannot hide a broken wheel."""
    project = _copy_project(tmp_path / "project")
    wheels = tmp_path / "wheels"
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 2), "OPFORGE_BUILD_CUDA": "0"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(wheels), str(project)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = wheels.glob("opforge-*.whl")
    assert "opforge: building opforge._C (" in res.stderr + res.stdout
    # On the stable ABI: one wheel for every Python from 3.10 on, its library for every torch from 2.10 on.
    assert wheel.name.endswith("-cp310-abi3-linux_x86_64.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "opforge/_C.abi3.so" in names and "opforge/_C.build.json" in names, [n for n in names if "_C" in n]
    assert not [n for n in names if n.startswith("opforge/_C.cpython")]

    # torch, numpy, pytest and pip from this environment, behind the venv's own
    # packages, through a .pth file of paths: reinstalling torch took over a
    # minute of the test's time and tested pip, not the wheel. The .pth files
    # of those folders are not read, so the checkout's editable opforge stays
    # out of sight: opforge comes from the wheel or not at all.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    )
    # Every site folder this process sees, those a .pth file of its own venv chains in too.
    outer = [*site.getsitepackages(), *(p for p in sys.path if p.endswith("site-packages") and p not in site.getsitepackages())]
    (Path(purelib.stdout.strip()) / "outer_packages.pth").write_text("\n".join(outer) + "\n")
    res = subprocess.run([py, "-c", "import opforge"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode != 0 and "No module named 'opforge'" in res.stderr, "the venv sees an opforge before the wheel is in"
    res = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # --no-deps skips pip's resolver: the wheel's requirements must still be met by what the venv sees.
    res = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True, env=env, timeout=300)
    assert "opforge" not in res.stdout, res.stdout

    # OPFORGE_FAST=0: the eager fast path's module is not in a wheel (it is built per torch on first use,
    # tests/test_fast.py); built here it would compile for half a minute beside the tests of the wheel.
    run_env = {**env, "OPFORGE_LIBRARY": "prebuilt", "OPFORGE_CACHE_DIR": str(tmp_path / "cache"), "OPFORGE_FAST": "0"}
    res = subprocess.run(
        [py, "-c", "import opforge; print(opforge.__file__); print(opforge.library.route, opforge.library.path)"],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    where, route = res.stdout.splitlines()[:2]
    assert where.startswith(str(venv)) and route.startswith(f"prebuilt {venv}") and route.endswith("/opforge/_C.abi3.so"), route

    tests = [str(project / "tests" / t) for t in ("test_ops.py", "test_layout.py")]
    res = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=900
    )
    assert res.returncode == 0, res.stdout[-4000:]
    assert " passed" in res.stdout.splitlines()[-1]


# A second copy of a library registers its operators again from static
# initialisers, which aborts the process: each load runs in a process of its own.
_LOAD_SECOND = """
import sys

import opforge

try:
    opforge.load_library(sys.argv[1])
except RuntimeError as exc:
    print("refused:", exc)
else:
    print("loaded")
"""


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def _copy_of_the_op_library(tmp_path: Path) -> Path:
    """The op library under the name the CMake route gives it: the same operators, another file."""
    from .conftest import LIBRARY

    copy = tmp_path / "libopforge_ops.so"
    shutil.copyfile(LIBRARY.path, copy)
    return copy


def test_op_library_registrations_are_read_from_its_symbols():
    from opforge.builder.symbols import torch_library_registrations

    from .conftest import LIBRARY

    regs = torch_library_registrations(LIBRARY.path)
    assert regs is not None and regs["opforge"] == {"fragment", "impl"}, regs


def test_second_copy_of_the_op_library_is_refused_not_aborted(tmp_path):
    from .conftest import LIBRARY

    copy = _copy_of_the_op_library(tmp_path)
    res = _python(_LOAD_SECOND, str(copy), env={"OPFORGE_LIBRARY": "auto"})
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    out = res.stdout
    assert out.startswith(f"refused: opforge: refusing to load {copy}: it registers opforge::add"), out
    assert "operator namespace 'opforge'" in out and f"which {LIBRARY.path} already registered" in out, out
    assert f"set OPFORGE_LIBRARY={copy} before `import opforge`" in out, out


def test_a_library_already_mapped_by_another_loader_loads_again(tmp_path):
    """The same file dlopened first outside torch.ops (ctypes here; a Python extension import,
    as examples/gemm does, maps it alike): dlopen hands back that copy, nothing registers
    twice, so it is no clash."""
    from .conftest import LIBRARY

    copy = tmp_path / LIBRARY.path.name
    shutil.copyfile(LIBRARY.path, copy)
    code = (
        "import ctypes, sys, torch, opforge\n"
        "ctypes.CDLL(sys.argv[1])\n"
        "assert not torch.ops.loaded_libraries and torch.ops.opforge.add(torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]\n"
    )
    res = _python(code + _LOAD_SECOND, str(copy), env={"OPFORGE_NO_AUTOLOAD": "1"})
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip() == "loaded", res.stdout


def test_opforge_library_env_loads_that_library_instead(tmp_path):
    from .conftest import LIBRARY

    copy = _copy_of_the_op_library(tmp_path)
    code = "import opforge, torch\nlib = opforge.library\nprint(lib.route, lib.path, opforge.add(torch.ones(3), torch.ones(3)).tolist())\n"
    res = _python(code + _LOAD_SECOND, str(LIBRARY.path), env={"OPFORGE_LIBRARY": str(copy)})
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    first, second = res.stdout.splitlines()[:2]
    assert first == f"file {copy} [2.0, 2.0, 2.0]"
    assert second.startswith(f"refused: opforge: refusing to load {LIBRARY.path}: it registers opforge::add"), second
    assert f"which {copy} already registered" in second


def test_opforge_library_env_naming_no_file_is_an_error(tmp_path, monkeypatch):
    from opforge.doctor import report as doctor

    named = tmp_path / "build" / "libopforge_ops.so"
    monkeypatch.setenv("OPFORGE_LIBRARY", str(named))
    assert pb.library_mode() == "file" and pb.choose_prebuilt() == (None, f"OPFORGE_LIBRARY={named}")
    with pytest.raises(BuildError, match=rf"OPFORGE_LIBRARY={named} names no file"):
        pb.load_op_library()
    report = doctor.collect()
    assert report.library.route == "OPFORGE_LIBRARY" and report.library.entry_path == str(named) and report.library.state == "missing"
    assert f"OPFORGE_LIBRARY={named} names no file" in [p.message for p in report.errors]
    named.parent.mkdir()
    named.write_bytes(b"\x7fELF")
    report = doctor.collect()
    assert report.library.state == "built" and not [p for p in report.errors if "OPFORGE_LIBRARY" in p.message]


def test_second_torch_library_of_a_namespace_is_refused_not_aborted(tmp_path, monkeypatch):
    """Two copies of one tiny TORCH_LIBRARY: the second defines the namespace again."""
    from opforge.builder import BuildConfig, build_library

    shared_cache = os.environ["OPFORGE_CACHE_DIR"]  # the op library's, for the subprocess
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "edge_twice.cpp"
    src.write_text(
        "#include <torch/library.h>\n"
        "static int64_t twice(int64_t x) { return 2 * x; }\n"
        'TORCH_LIBRARY(opforge_edge_twice, m) { m.def("twice(int x) -> int", &twice); }\n'
    )
    built = build_library(BuildConfig(name="opforge_edge_twice", sources=(src,), include_dirs=(tmp_path,), cflags=("-O0",)), quiet=True)
    first, second = tmp_path / "first" / built.path.name, tmp_path / "second" / built.path.name
    for copy in (first, second):
        copy.parent.mkdir(mode=0o700)
        shutil.copyfile(built.path, copy)
    code = "import sys, torch, opforge\nopforge.load_library(sys.argv[2])\nprint(torch.ops.opforge_edge_twice.twice(21))\n"
    res = _python(code + _LOAD_SECOND, str(second), str(first), env={"OPFORGE_CACHE_DIR": shared_cache})
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.splitlines()[0] == "42"
    refused = res.stdout.splitlines()[1]
    assert refused.startswith(f"refused: opforge: refusing to load {second}: it registers opforge_edge_twice::twice"), refused
    assert f"operator namespace 'opforge_edge_twice'), which {first} already registered" in refused
    assert "OPFORGE_LIBRARY" not in refused, "the variable names opforge's own library only"


def test_torch_ops_load_library_of_a_second_copy_registers_nothing(tmp_path):
    """The CMake tutorial's flow: `import opforge`, then torch.ops.load_library of a
    build of the same operators. Its registrations would end the process from a
    static initialiser; the library catches that, says so once and registers nothing."""
    copy = _copy_of_the_op_library(tmp_path)
    code = (
        "import sys, torch, opforge\n"
        "torch.ops.load_library(sys.argv[1])\n"
        "print(opforge.add(torch.ones(2), torch.ones(2)).tolist(), torch.ops.opforge.square(torch.full((1,), 3.0)).tolist())\n"
    )
    res = _python(code, str(copy), env={"OPFORGE_LIBRARY": "auto"})
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip() == "[2.0, 2.0] [9.0]", res.stdout
    said = [line for line in res.stderr.splitlines() if "registers nothing" in line]
    assert len(said) == 1, res.stderr
    assert said[0].startswith(f"opforge: {copy} registers nothing: its operators in namespace 'opforge' are defined already"), said
    # The definition's own error, whether or not this torch's StableLibrary::def raises it.
    assert "The error: torch refused the definition " in said[0], said


@pytest.mark.parametrize("kept", [0.5, 0.999])
def test_truncated_library_is_refused_before_it_is_mapped(tmp_path, kept):
    """A library cut short would be mapped and the process killed by SIGBUS on
    the first page past its end: it is refused first, with its sizes."""
    from .conftest import LIBRARY

    data = LIBRARY.path.read_bytes()
    cut = tmp_path / "libopforge_ops.so"
    cut.write_bytes(data[: int(len(data) * kept)])
    res = _python("import opforge", env={"OPFORGE_LIBRARY": str(cut)})
    assert res.returncode == 1, f"rc {res.returncode}: {res.stderr[-2000:]}"
    last = res.stderr.strip().splitlines()[-1]
    # Cut before the section headers, the headers' reach says it first; else the contents'.
    said = f"could not load {cut}: {cut} is truncated: it ends at byte {cut.stat().st_size:,}, and its "
    assert said + "headers reach byte" in last or said + "contents reach byte" in last, last


def test_complete_library_passes_the_truncation_check():
    from opforge.elf_symbols import check_complete

    from .conftest import LIBRARY

    check_complete(LIBRARY.path)


def _damaged(data: bytearray) -> dict[str, tuple[int, bytes]]:
    """Damage to a library's headers that the dynamic loader would map and crash on, or refuse with no
    reason: (offset, bytes written there) by name, from the copy's own header (ELF64, little-endian)."""
    import struct

    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phnum = struct.unpack_from("<H", data, 56)[0]
    loads = [i for i in range(phnum) if struct.unpack_from("<I", data, phoff + 56 * i)[0] == 1]
    dynamic = next(i for i in range(phnum) if struct.unpack_from("<I", data, phoff + 56 * i)[0] == 2)
    return {
        "zeros-at-64": (64, bytes(8)),  # the first program header's type and flags
        "other-machine": (18, struct.pack("<H", 183)),
        "32-bit-class": (4, b"\x01"),
        "object-file-type": (16, struct.pack("<H", 1)),
        "phentsize-zero": (54, struct.pack("<H", 0)),
        "phoff-past-the-end": (32, struct.pack("<Q", len(data) * 2)),
        "shstrndx-out-of-range": (62, struct.pack("<H", 0xFFF0)),
        "filesz-over-memsz": (phoff + 56 * loads[1] + 32, struct.pack("<Q", 1 << 40)),
        "second-segment-at-0": (phoff + 56 * loads[1] + 16, struct.pack("<Q", 0)),
        "dynamic-outside": (phoff + 56 * dynamic + 16, struct.pack("<Q", 1 << 44)),
        "section-moved": (shoff + 64 * 3 + 16, struct.pack("<Q", 1 << 44)),  # an allocated section's address
    }


_DAMAGE = [
    "zeros-at-64", "other-machine", "32-bit-class", "object-file-type", "phentsize-zero", "phoff-past-the-end",
    "shstrndx-out-of-range", "filesz-over-memsz", "second-segment-at-0", "dynamic-outside", "section-moved",
]  # fmt: skip


@pytest.mark.parametrize("damage", _DAMAGE)
def test_damaged_library_headers_are_refused_before_loading(tmp_path, damage):
    copy = _copy_of_the_op_library(tmp_path)
    data = bytearray(copy.read_bytes())
    offset, written = _damaged(data)[damage]
    data[offset : offset + len(written)] = written
    copy.write_bytes(data)
    with pytest.raises(BuildError, match=rf"could not load {copy}: {copy} is (damaged|truncated).*rebuild it"):
        pb.check_mappable(copy)


def test_opforge_library_with_zeros_in_its_program_header_is_an_error_not_a_crash(tmp_path):
    copy = _copy_of_the_op_library(tmp_path)
    data = bytearray(copy.read_bytes())
    data[64:72] = bytes(8)
    copy.write_bytes(data)
    res = _python("import opforge", env={"OPFORGE_LIBRARY": str(copy)})
    assert res.returncode == 1, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert f"opforge: could not load {copy}: {copy} is damaged (its program headers)" in res.stderr, res.stderr[-2000:]


def test_opforge_library_without_opforge_operators_says_so(tmp_path):
    from .conftest import FAST

    # The fast path's module: a library whose symbols show it registers no operators; libm: one stripped of
    # its symbol table, told once it has loaded.
    others = [Path(FAST.__file__), Path("/usr/lib/x86_64-linux-gnu/libm.so.6")]
    for k, source in enumerate(p for p in others if p.is_file()):
        copy = tmp_path / f"lib{k}" / "libother.so"
        copy.parent.mkdir(mode=0o700)
        shutil.copyfile(source, copy)
        res = _python("import opforge", env={"OPFORGE_LIBRARY": str(copy)})
        assert res.returncode == 1, f"rc {res.returncode}: {res.stderr[-2000:]}"
        assert f"opforge: OPFORGE_LIBRARY={copy} registers no opforge operators" in res.stderr, res.stderr[-2000:]
        assert "no such operator" not in res.stderr
