"""The ahead-of-time route for a library on PyTorch's stable ABI: setuptools'
build_ext builds it through opforge's stable builder (not torch's
BuildExtension, which would link libtorch_python and torch's CUDA libraries),
into ``<name>.abi3.so`` with a build record naming the torch it targets, and
bdist_wheel tags the wheel ``cp310-abi3``. One op is built here, not the whole
library: the wheel of the whole library is test_prebuilt's slow test."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution

from opforge.builder import library_config
from opforge.builder.setuptools_ext import extension, wheel_options

REPO = Path(__file__).resolve().parent.parent

# setup() as opforge's setup.py calls it, for the config the first argument names: "op:<folder>"
# (one op of opforge's library) or "folder:<path>" (a user's stable folder).
_SETUP = """
import dataclasses, sys
from pathlib import Path
from setuptools import setup
from opforge.builder import folder_config, library_config
from opforge.builder.setuptools_ext import BuildExtension, extension, wheel_options

what, out = sys.argv[1], Path(sys.argv[2])
kind, _, arg = what.partition(":")
if kind == "op":
    cfg = library_config(with_cuda=False)
    keep = tuple(s for s in cfg.sources if s.parent.name == arg)
    cfg, name, base = dataclasses.replace(cfg, sources=keep, unity=keep), "opforge._C", Path(sys.argv[3])
else:
    cfg, name, base = folder_config(Path(arg), with_cuda=False, stable="2.10"), "broken._C", Path(arg)
ext = extension(cfg, name, base)
setup(
    name="probe",
    version="0.1",
    script_args=["-q", "build_ext", "--build-lib", str(out / "lib"), "--build-temp", str(out / "temp")],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options=wheel_options(ext),
)
"""


def _build_ext(tmp_path: Path, what: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1", "OPFORGE_BUILD_CUDA": "0"}
    return subprocess.run(
        [sys.executable, "-c", _SETUP, what, str(tmp_path), str(REPO)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )


def _needed(so: Path) -> list[str]:
    res = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True)
    return [line.rsplit("[", 1)[1].rstrip("]") for line in res.stdout.splitlines() if "(NEEDED)" in line]


def test_build_ext_builds_a_stable_library_through_opforges_route(tmp_path):
    user_cache = Path(os.environ["OPFORGE_CACHE_DIR"])
    before = sorted(p.name for p in user_cache.iterdir())
    res = _build_ext(tmp_path, "op:add")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "opforge: building opforge._C (1 sources, CPU kernels only, stable ABI: torch 2.10 and later)" in res.stderr
    package = tmp_path / "lib" / "opforge"
    assert sorted(p.name for p in package.iterdir()) == ["_C.abi3.so", "_C.build.json"]
    record = json.loads((package / "_C.build.json").read_text())
    assert record["stable"] == "2.10" and record["with_cuda"] is False and record["cuda_archs"] == []
    # The shim alone: no torch Python binding, no torch CUDA library, no libc10 of one torch build.
    needed = _needed(package / "_C.abi3.so")
    assert "libtorch_cpu.so" in needed, needed
    assert not [n for n in needed if n.startswith(("libtorch_python", "libtorch_cuda", "libc10", "libpython"))], needed
    # Its objects stay in the build folder, for the next build of that tree; the user's cache is untouched.
    assert (tmp_path / "temp" / "opforge-cache").is_dir()
    assert sorted(p.name for p in user_cache.iterdir()) == before

    code = "import sys, torch\ntorch.ops.load_library(sys.argv[1])\nprint(torch.ops.opforge.add(torch.ones(3), torch.ones(3)).tolist())\n"
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(package / "_C.abi3.so")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[2.0, 2.0, 2.0]"


def test_a_failed_stable_build_names_the_file_and_line(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "broken.cpp").write_text(
        "#include <torch/csrc/stable/library.h>\n\nint64_t broken(int64_t x) { return x +; }\n\n"
        'STABLE_TORCH_LIBRARY(broken, m) { m.def("broken(int x) -> int"); }\n'
    )
    res = _build_ext(tmp_path, f"folder:{folder}")
    assert res.returncode != 0
    assert "error: opforge: building broken failed." in res.stderr, res.stderr[-3000:]
    assert f"{folder / 'broken.cpp'}:3:" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "lib" / "broken").exists()


def _wheel_tag(*extensions) -> tuple[str, str, str]:
    dist = Distribution({"name": "probe", "version": "0.1", "ext_modules": list(extensions), "options": wheel_options(*extensions)})
    cmd = dist.get_command_obj("bdist_wheel")
    cmd.ensure_finalized()
    return cmd.get_tag()


def test_a_stable_library_makes_an_abi3_wheel():
    ext = extension(library_config(with_cuda=False), "opforge._C", REPO)
    impl, abi, platform = _wheel_tag(ext)
    assert (impl, abi) == ("cp310", "abi3")
    assert platform == sysconfig.get_platform().replace("-", "_").replace(".", "_")


def test_a_library_of_one_torch_makes_a_wheel_of_one_python():
    cfg = dataclasses.replace(library_config(with_cuda=False), stable="")
    impl, abi, _ = _wheel_tag(extension(cfg, "opforge._C", REPO))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert (impl, abi) == (tag, tag)
