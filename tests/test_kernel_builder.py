"""`opforge build PATH` on Hugging Face kernel-builder projects: a build.toml,
kernels per backend, the torch extension in torch-ext/.

Two fixtures of kernel-builder's layout: hub_kernel (silu_and_mul, a CPU and a
CUDA kernel on ATen) and hub_kernel_stable (scaled_add on PyTorch's stable ABI,
``[torch.stable-abi]``). The tests without a compiler read the build.toml and
the plan in milliseconds; the build tests (slow) compile a fixture from an empty
cache, import its package from torch-ext and load its variant folder with the
``kernels`` package's own loader (``kernels.get_local_kernel``), then check the
operator against a torch reference; the CUDA tests do the same with the CUDA
kernels on the GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge.folders.discover import discover, find_build_toml
from opforge.folders.kernel_builder.build import plan
from opforge.folders.kernel_builder.layout import metadata, ops_py, place_in_torch_ext, variant_name
from opforge.folders.kernel_builder.toml import KernelBuilderError, read_project

from .conftest import SRC as CHECKOUT_SRC

# kernels lives in a folder of its own (scripts/env.sh installs it there): its 0.17.0 wheel
# declares a setuptools egg_info writer whose module it lacks, so installed into the venv it
# breaks every metadata step of setuptools there (the wheel and editable-install tests').
KERNELS_SITE = os.environ.get("OPFORGE_KERNELS_SITE", "")
SRC = os.pathsep.join(p for p in (CHECKOUT_SRC, KERNELS_SITE) if p)
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def need_kernels():
    """The kernels package, from OPFORGE_KERNELS_SITE (what scripts/env.sh installs) or
    installed. Its absence fails the test rather than skipping what it is there to show, except
    where scripts/env.sh could not install it (no package index and no wheel carried): that skips,
    saying how to provide it."""
    if KERNELS_SITE and KERNELS_SITE not in sys.path:
        sys.path.append(KERNELS_SITE)
    try:
        import kernels
    except ImportError as exc:
        how = (
            "bash scripts/test.sh installs kernels==0.17.0 into .venv/kernels-site from the package index, or from "
            "wheels in the checkout's .whl/ folder (pip download --no-deps kernels==0.17.0 tomlkit), "
            "or set OPFORGE_KERNELS_SITE to a folder holding it"
        )
        unavailable = Path(KERNELS_SITE, ".unavailable") if KERNELS_SITE else None
        if unavailable is not None and unavailable.is_file():
            pytest.skip(f"{unavailable.read_text().strip()}; {how}")
        pytest.fail(f"the kernels package is not importable ({exc}): {how}")
    return kernels


def test_without_kernels_and_no_way_to_install_it_the_tests_skip_saying_how(tmp_path, monkeypatch):
    (tmp_path / ".unavailable").write_text("kernels==0.17.0 could not be installed: no package index reached\n")
    monkeypatch.setattr(sys.modules[__name__], "KERNELS_SITE", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "kernels", None)
    with pytest.raises(pytest.skip.Exception, match=r"could not be installed: no package index reached; .*\.whl/ folder"):
        need_kernels()
    # Where the install was not tried or should have worked, its absence is a failure.
    (tmp_path / ".unavailable").unlink()
    with pytest.raises(pytest.fail.Exception, match="the kernels package is not importable"):
        need_kernels()


def copy_fixture(tmp_path: Path, name: str) -> Path:
    """A copy to build: the build writes into torch-ext/ and build/, and the fixture must stay as committed."""
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def cpu_torch_ext_variant() -> str:
    return variant_name("cpu")


# --------------------------------------------------------------- no compiler


@pytest.mark.parametrize("name", ["hub_kernel", "hub_kernel_stable"])
def test_each_fixture_is_a_kernel_builder_project_by_kernels_own_reading(name):
    """kernels' own parser of build.toml (kernel-builder's) takes the fixtures as
    they are, edition 5, and so does opforge's route choice."""
    need_kernels()
    from kernels._rust import Build

    build = Build.open(FIXTURES / name)
    assert [str(b) for b in build.general.backends] == ["cpu", "cuda"]
    layout = discover(FIXTURES / name)
    assert layout.route == "kernel-builder", layout.why
    assert "build.toml names a torch extension and its kernels" in layout.why


def test_a_build_toml_of_another_tool_does_not_select_the_route(tmp_path):
    """Only a [torch] or [kernel.<name>] section marks a kernel-builder project."""
    (tmp_path / "ops.cpp").write_text('#include <torch/library.h>\nTORCH_LIBRARY(mine, m) { m.def("f(Tensor x) -> Tensor"); }\n')
    (tmp_path / "build.toml").write_text('[tool.other]\nname = "x"\n')
    assert find_build_toml(tmp_path) is None and discover(tmp_path).route == "jit"
    (tmp_path / "build.toml").write_text('[general]\nname = "x"\n\n[kernel.k]\nsrc = []\n')
    assert find_build_toml(tmp_path) == tmp_path / "build.toml" and discover(tmp_path).route == "kernel-builder"


def test_the_plan_says_what_is_built_and_skips_what_cannot_be_built_here(tmp_path):
    """One variant a backend this machine builds, named as kernel-builder names
    it, under a namespace of the build's own; a backend it cannot build is said
    with the reason and the sources left out, never dropped silently."""
    project = copy_fixture(tmp_path, "hub_kernel")
    text = (project / "build.toml").read_text().replace('backends = ["cpu", "cuda"]', 'backends = ["cpu", "cuda", "metal"]')
    (project / "build.toml").write_text(text)
    p = plan(project)
    said = "\n".join(p.lines)
    assert "  build.toml: gated-silu (version 1), backends cpu, cuda, metal\n" in said
    assert "  kernel gated_silu_cpu (cpu): gated_silu_cpu/gated_silu_cpu.cpp; include: common\n" in said
    assert "  route: kernel-builder (" in said and "  registration.h: generated (" in said
    assert "  metal: skipped (opforge builds the cpu and cuda backends)" in said
    cpu = p.variants[0]
    assert cpu.backend == "cpu" and re.fullmatch(r"_gated_silu_cpu_[0-9a-f]{10}", cpu.ops_name)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert cpu.name == f"torch{major}{minor}-cxx11-cpu-x86_64-linux"
    assert f"    variant: build/{cpu.name}/gated_silu/, namespace {cpu.ops_name}" in said
    assert {s.name for s in cpu.config.sources} == {"torch_binding.cpp", "gated_silu_cpu.cpp"}
    assert "-DCPU_KERNEL" in cpu.config.cflags and "-DCUDA_KERNEL" not in cpu.config.cflags
    if torch.version.cuda is None:
        assert [v.backend for v in p.variants] == ["cpu"]
        assert f"  cuda: skipped (torch {torch.__version__} has no CUDA); left out: gated_silu_cuda/gated_silu.cu" in said
    else:
        cuda = p.variants[1]
        assert {s.name for s in cuda.config.sources} == {"torch_binding.cpp", "gated_silu.cu"} and cuda.config.with_cuda
        assert cuda.name.startswith(f"torch{major}{minor}-cxx11-cu")


def test_the_namespace_follows_the_sources_and_headers(tmp_path):
    """kernel-builder's unique namespace: the same sources give the same one, an
    edited header a new one, so two versions of a kernel load side by side."""
    project = copy_fixture(tmp_path, "hub_kernel")
    first = plan(project).variants[0].ops_name
    assert plan(project).variants[0].ops_name == first
    header = project / "common" / "gated_silu_math.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert plan(project).variants[0].ops_name != first


def test_the_variant_names_are_the_ones_kernels_picks_on_this_machine():
    """kernels' own resolver parses the names opforge gives and accepts, on this
    machine, the CPU build for this torch and the stable-ABI build for 2.10."""
    need_kernels()
    from kernels.variants import VariantAccepted, parse_variant, resolve_variants

    names = [variant_name("cpu"), variant_name("cpu", stable="2.10"), variant_name("cuda", cuda="13.0")]
    assert names[1] == "torch-stable-abi210-cpu-x86_64-linux" and "-cu130-" in names[2]
    accepted, trace = resolve_variants([parse_variant(n) for n in names], backend="cpu")
    assert {v.variant_str for v in accepted} == set(names[:2]), trace
    # The stable build is kernels' first choice where both are there.
    assert accepted[0].variant_str == names[1]
    assert not any(isinstance(d, VariantAccepted) and d.variant.variant_str == names[2] for d in trace)


def test_metadata_json_is_what_kernels_reads(tmp_path):
    need_kernels()
    from kernels._rust import Backend, Metadata

    project = copy_fixture(tmp_path, "hub_kernel")
    p = plan(project)
    m = Metadata.from_bytes(json.dumps(metadata(p.project, p.variants[0])).encode())
    assert str(m.name) == "gated-silu" and m.version == 1 and m.license == "Apache-2.0" and m.id == p.variants[0].ops_name
    assert m.backend.backend_type == Backend.CPU and m.python_depends == []


def test_a_projects_own_ops_py_is_kept_and_a_generated_one_is_written_again(tmp_path):
    project = copy_fixture(tmp_path, "hub_kernel")
    p = plan(project)
    variant, lib = p.variants[0], tmp_path / "fake.so"
    lib.write_bytes(b"\x7fELF not really")
    ops = project / "torch-ext" / "gated_silu" / "_ops.py"
    # kernel-builder's own generated _ops.py (another build's namespace): written again.
    ops.write_text("import torch\nfrom . import _gated_silu_0123abc\nops = torch.ops._gated_silu_0123abc\n\n"
                   "def add_op_namespace_prefix(op_name: str):\n    return f'_gated_silu_0123abc::{op_name}'\n")  # fmt: skip
    stale = project / "torch-ext" / "gated_silu" / "_gated_silu_cpu_0123456789.abi3.so"
    stale.write_bytes(b"old")
    assert place_in_torch_ext(p.project, variant, lib) is False
    assert ops.read_text() == ops_py(variant.ops_name) and (ops.parent / variant.library_name).read_bytes() == lib.read_bytes()
    assert not stale.exists(), "an earlier build's library is removed"
    compile(ops.read_text(), str(ops), "exec")
    # A project's own shim is not overwritten.
    ops.write_text("import torch\nops = torch.ops.mine\n")
    assert place_in_torch_ext(p.project, variant, lib) is True and ops.read_text() == "import torch\nops = torch.ops.mine\n"


_TORCH = '[torch]\nsrc = ["torch-ext/torch_binding.cpp"]\n'
_GENERAL = '[general]\nname = "gated-silu"\nbackends = ["cpu"]\n'


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[general\nname = 'x'\n", "is not valid TOML: "),
        ("[torch]\nsrc = []\n", "no [general] section: kernel-builder needs at least [general] name"),
        ('[general]\nname = "Gated_Silu"\n' + _TORCH, "[general] name must be lowercase letters, digits and dashes"),
        ('[general]\nname = "gated-silu"\nbackends = ["cuda", "vulkan"]\n' + _TORCH, "got 'vulkan'"),
        (_GENERAL + '[kernel.k]\nbackend = "cpu"\nsrc = ["gated_silu_cpu/gated_silu_cpu.cpp"]\n', "no [torch] section"),
        (
            '[general]\nname = "gated-silu"\n' + _TORCH + '[kernel.k]\nbackend = "cpu"\nsrc = ["kernels/missing.cpp"]\n',
            "[kernel.k] src names kernels/missing.cpp, which is not there",
        ),
        (
            '[general]\nname = "gated-silu"\n' + _TORCH + '[kernel.k]\nbackend = "cpu"\nsrc = "k.cpp"\n',
            "[kernel.k] src must be a list of strings, got 'k.cpp'",
        ),
        (_GENERAL + _TORCH + 'stable-abi = "2.4"\n', "[torch] stable-abi for cpu: the stable ABI is versioned"),
        (_GENERAL + _TORCH + "minver = 2.10\n", '[torch] minver must be a string (a version in quotes, "2.10"), got 2.1'),
        (
            _GENERAL.replace("gated-silu", "other-name") + _TORCH,
            "its Python package in torch-ext/other_name/, but torch-ext/other_name/__init__.py",
        ),
        ('[general]\nname = "gated-silu"\nuniversal = true\n' + _TORCH, "a universal kernel is pure Python"),
    ],
)
def test_a_build_toml_that_cannot_be_built_is_a_clear_error_naming_it(tmp_path, toml, message):
    project = copy_fixture(tmp_path, "hub_kernel")
    (project / "build.toml").write_text(toml)
    with pytest.raises(KernelBuilderError) as err:
        read_project(project)
    assert str(project / "build.toml") in str(err.value) and message in str(err.value), err.value


def test_cuda_capabilities_that_exclude_every_targeted_arch_are_a_clear_error(tmp_path, monkeypatch):
    """A kernel's cuda-capabilities narrow the archs built; none left is an error
    that says which archs were targeted and how to target others. (CUDA is made
    to look available: the plan compiles nothing.)"""
    import opforge.folders.kernel_builder.build as kb

    monkeypatch.setattr(kb, "_cuda_reason", lambda stable: None)
    monkeypatch.setattr(kb, "_cuda_version", lambda stable: "13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    project = copy_fixture(tmp_path, "hub_kernel")
    toml = project / "build.toml"
    text = toml.read_text()
    toml.write_text(text.replace("[kernel.gated_silu]\n", '[kernel.gated_silu]\ncuda-capabilities = ["9.0"]\n'))
    cuda = plan(project).variants[1]
    assert cuda.config.cuda_archs == ("9.0a",) and "-gencode=arch=compute_90a,code=sm_90a" in cuda.config.cuda_cflags
    assert cuda.archs == ("9.0a", "9.0+PTX") and "-DCUDA_KERNEL" in cuda.config.cflags
    assert "  cuda: sm 8.0 left out: [kernel.gated_silu] cuda-capabilities exclude it" in plan(project).lines
    toml.write_text(text.replace("[kernel.gated_silu]\n", '[kernel.gated_silu]\ncuda-capabilities = ["7.5", "8.6"]\n'))
    with pytest.raises(KernelBuilderError, match=r"\[kernel.gated_silu\] cuda-capabilities \(7.5, 8.6\) include none of the archs"):
        plan(project)


def test_cuda_is_compiled_with_kernel_builders_default_nvcc_flags(tmp_path, monkeypatch):
    """kernel-builder's nvcc line: --expt-extended-lambda (a __device__ lambda in a
    kernel compiles), --expt-relaxed-constexpr, -DENABLE_FP8, and torch's four
    __CUDA_NO_HALF* macros taken back; a kernel's cuda-flags go to its own .cu files
    alone. (CUDA is made to look available: the plan compiles nothing.)"""
    import opforge.folders.kernel_builder.build as kb

    monkeypatch.setattr(kb, "_cuda_reason", lambda stable: None)
    monkeypatch.setattr(kb, "_cuda_version", lambda stable: "13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    project = copy_fixture(tmp_path, "hub_kernel")
    toml = project / "build.toml"
    toml.write_text(toml.read_text().replace("[kernel.gated_silu]\n", '[kernel.gated_silu]\ncuda-flags = ["-lineinfo"]\n'))
    cuda = plan(project).variants[1].config
    flags = cuda.cuda_cflags
    for f in ("--expt-extended-lambda", "--expt-relaxed-constexpr", "-DENABLE_FP8", "-O3", "-DNDEBUG", "-DCUDA_KERNEL"):
        assert f in flags, (f, flags)
    assert {"-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"} <= set(flags)
    assert "--use_fast_math" not in flags and "-lineinfo" not in flags
    kernel = next(s for s in cuda.sources if s.name == "gated_silu.cu")
    assert "-lineinfo" in cuda.source_flags()[kernel][1]


def _two_kernel_project(root: Path) -> Path:
    """A CPU project of two kernels: kernel_a declares -DKERNEL_A_FLAG and an include
    folder of its own; kernel_b's source and the binding refuse to compile if either
    reaches them, and kernel_a's refuses to compile without them."""
    (root / "torch-ext" / "two_kernels").mkdir(parents=True)
    (root / "kernel_a" / "inc").mkdir(parents=True)
    (root / "kernel_b").mkdir()
    (root / "build.toml").write_text(
        '[general]\nname = "two-kernels"\nbackends = ["cpu"]\n\n[torch]\nsrc = ["torch-ext/torch_binding.cpp"]\n\n'
        '[kernel.kernel_a]\nbackend = "cpu"\nsrc = ["kernel_a/a.cpp"]\ninclude = ["kernel_a/inc"]\n'
        'cxx-flags = ["-DKERNEL_A_FLAG=3"]\n\n'
        '[kernel.kernel_b]\nbackend = "cpu"\nsrc = ["kernel_b/b.cpp"]\n'
    )
    refuse = (
        '#ifdef KERNEL_A_FLAG\n#error "kernel_a\'s cxx-flags reached this file"\n#endif\n'
        '#if __has_include("only_a.h")\n#error "kernel_a\'s include folder reached this file"\n#endif\n'
    )
    (root / "kernel_a" / "inc" / "only_a.h").write_text("inline double a_part() { return KERNEL_A_FLAG; }\n")
    (root / "kernel_a" / "a.cpp").write_text(
        '#ifndef KERNEL_A_FLAG\n#error "kernel_a\'s own cxx-flags are missing"\n#endif\n#include "only_a.h"\n'
        "double kernel_a_value() { return a_part(); }\n"
    )
    (root / "kernel_b" / "b.cpp").write_text(refuse + "double kernel_b_value() { return 0.25; }\n")
    (root / "torch-ext" / "torch_binding.cpp").write_text(
        '#include <torch/library.h>\n\n#include "registration.h"\n\n' + refuse + "double kernel_a_value();\n"
        "double kernel_b_value();\nstatic double both() { return kernel_a_value() + kernel_b_value(); }\n\n"
        'TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) { ops.def("both() -> float", &both); }\n\n'
        "REGISTER_EXTENSION(TORCH_EXTENSION_NAME)\n"
    )
    (root / "torch-ext" / "two_kernels" / "__init__.py").write_text("from ._ops import ops\n\n\ndef both():\n    return ops.both()\n")
    return root


def test_a_kernels_cxx_flags_and_include_folders_are_its_own(tmp_path):
    """As kernel-builder scopes them (per-source COMPILE_OPTIONS and INCLUDE_DIRECTORIES):
    a kernel's cxx-flags and include folders go with that kernel's sources alone."""
    p = plan(_two_kernel_project(tmp_path))
    cfg = p.variants[0].config
    assert not any("KERNEL_A_FLAG" in f for f in cfg.cflags), cfg.cflags
    assert tmp_path / "kernel_a" / "inc" not in cfg.include_dirs, cfg.include_dirs
    own = cfg.source_flags()
    assert set(own) == {tmp_path / "kernel_a" / "a.cpp"}, own
    assert own[tmp_path / "kernel_a" / "a.cpp"][0] == ("-DKERNEL_A_FLAG=3", f"-I{tmp_path / 'kernel_a' / 'inc'}")
    # A flag of a kernel is in the cache key: another flag, another library.
    toml = tmp_path / "build.toml"
    toml.write_text(toml.read_text().replace("-DKERNEL_A_FLAG=3", "-DKERNEL_A_FLAG=4"))
    assert plan(tmp_path).variants[0].config.key() != cfg.key()


def test_the_cli_says_what_is_wrong_with_a_build_toml_before_compiling(tmp_path, monkeypatch, capsys):
    from opforge.cli import main

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    project = copy_fixture(tmp_path, "hub_kernel")
    toml = project / "build.toml"
    toml.write_text(toml.read_text().replace('src = ["gated_silu_cpu/gated_silu_cpu.cpp"]', 'src = ["gated_silu_cpu/gated_silu.cpp"]'))
    assert main(["build", str(project)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"opforge build: {toml}: [kernel.gated_silu_cpu] src names gated_silu_cpu/gated_silu.cpp, which is not there" in err
    assert not any((tmp_path / "cache").glob("gated_silu_*")), "refused before any compiler ran"


# --------------------------------------------------------------- builds


def run_build(folder: Path, cache: Path, *, cuda: bool) -> subprocess.CompletedProcess:
    """`opforge build FOLDER` in a new process with its own cache; CUDA kernels
    on (on a CUDA machine) or off, as asked."""
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_CACHE_DIR": str(cache), "OPFORGE_NO_AUTOLOAD": "1"}
    env.pop("OPFORGE_BUILD_CUDA", None)
    if cuda or torch.version.cuda is not None:
        env["OPFORGE_BUILD_CUDA"] = "1" if cuda else "0"
    code = f"import sys\nfrom opforge.cli import main\nsys.exit(main(['build', {str(folder)!r}]))\n"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    print(res.stdout, res.stderr)
    return res


def built_seconds(res: subprocess.CompletedProcess, name: str) -> float:
    return float(re.search(rf"opforge: built {name} in (\d+\.\d) s", res.stderr)[1])


def in_new_process(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    print(res.stdout, res.stderr)
    return res


# kernels' own loader in a new process (a build's namespace registers once a process, and the
# tests build the same sources, the same namespace, in two folders): the variant it picks for
# BACKEND (None: this machine's default), which must be VARIANT, and the operator against torch.
KERNELS_SILU_CHECK = """
import re, torch, kernels
from pathlib import Path
module = kernels.get_local_kernel(Path("."), backend=BACKEND)
assert Path(module.__file__).parent.parent.name == VARIANT, module.__file__
device = "cuda" if VARIANT.split("-")[-3].startswith("cu") else "cpu"
for shape in ((1, 2), (3, 59, 194), (1025, 2 * 97), (7, 4096)):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.randn(shape, device=device, dtype=dtype)
        d = shape[-1] // 2
        ref = (torch.nn.functional.silu(x[..., :d].double()) * x[..., d:].double()).to(dtype)
        torch.testing.assert_close(module.silu_and_mul(x), ref)
assert module.silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
try:
    module.silu_and_mul(torch.randn(3, 5, device=device))
    raise SystemExit("no error for an odd last dimension")
except RuntimeError as exc:
    assert re.search(r"silu_and_mul: the last dimension of input must be even .*got \\[3, 5\\]", str(exc)), exc
print("KERNELS OK", VARIANT)
"""


def kernels_check(project: Path, code: str, backend: str | None, variant: str) -> None:
    res = in_new_process(f"BACKEND = {backend!r}\nVARIANT = {variant!r}\n" + code, project)
    assert res.returncode == 0 and f"KERNELS OK {variant}" in res.stdout, res.stdout + res.stderr


TORCH_EXT_CHECK = """
import sys, torch
sys.path.insert(0, "torch-ext")
import gated_silu
x = torch.randn(59, 2 * 97, device=DEVICE)
ref = torch.nn.functional.silu(x[:, :97].double()) * x[:, 97:].double()
torch.testing.assert_close(gated_silu.silu_and_mul(x), ref.float())
# Traced whole by torch.compile: the fake kernel its __init__ registers under add_op_namespace_prefix's name.
f = torch.compile(lambda x: gated_silu.silu_and_mul(x) * 2, backend="eager", fullgraph=True)
torch.testing.assert_close(f(x), 2 * ref.float())
print("TORCH-EXT OK")
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_kernel_builder_project_builds_imports_and_loads_with_kernels(tmp_path, device):
    """A bare `opforge build` on the fixture: each backend this machine builds,
    registration.h and _ops.py generated, the package importable from torch-ext
    with no install step, build/<variant>/ loaded by kernels.get_local_kernel,
    and its operator right against torch. Built again: nothing compiled, nothing
    rewritten. An edited header: a new namespace, and the old library gone."""
    kernels = need_kernels()
    project = copy_fixture(tmp_path, "hub_kernel")
    cuda = device == "cuda"
    res = run_build(project, tmp_path / "cache", cuda=cuda)
    assert res.returncode == 0, res.stdout + res.stderr
    p = plan(project) if not cuda else None
    cpu_variant = cpu_torch_ext_variant()
    assert "gated-silu: cpu (built in " in res.stdout and f"): build/{cpu_variant}/gated_silu/_gated_silu_cpu_" in res.stdout
    assert "gated_silu: `import gated_silu` works (from torch-ext/, no install step): _gated_silu_" in res.stdout
    assert f"gated_silu: kernels {kernels.__version__}: get_local_kernel(backend='cpu') loads build/{cpu_variant}/: " in res.stdout
    seconds = {"cpu": built_seconds(res, "gated_silu_cpu")}
    if cuda:
        seconds["cuda"] = built_seconds(res, "gated_silu_cuda")
        cuda_variant = next(d.name for d in (project / "build").iterdir() if "-cu" in d.name)
        assert f"get_local_kernel(backend='cuda') loads build/{cuda_variant}/" in res.stdout
        assert "gated-silu: torch-ext/gated_silu/ holds the cuda build: _gated_silu_cuda_" in res.stdout
        meta = json.loads((project / "build" / cuda_variant / "metadata.json").read_text())
        assert meta["backend"]["type"] == "cuda" and meta["backend"]["archs"], meta
    else:
        assert "gated-silu: torch-ext/gated_silu/ holds the cpu build: _gated_silu_cpu_" in res.stdout
        assert p is not None and (project / "torch-ext" / "gated_silu" / p.variants[0].library_name).is_file()

    # kernels' own loader: the CPU build, and on a GPU the CUDA one (its default there).
    kernels_check(project, KERNELS_SILU_CHECK, "cpu", cpu_variant)
    if cuda:
        kernels_check(project, KERNELS_SILU_CHECK, None, cuda_variant)
    # The torch-ext package, as its author imports it (a process of its own: one namespace registers once a process).
    check = in_new_process(f"DEVICE = {device!r}\n" + TORCH_EXT_CHECK, project)
    assert check.returncode == 0 and "TORCH-EXT OK" in check.stdout, check.stdout + check.stderr

    again = run_build(project, tmp_path / "cache", cuda=cuda)
    assert again.returncode == 0 and "opforge: building" not in again.stderr, again.stdout + again.stderr
    assert f"gated-silu: cpu (cached, already in place): build/{cpu_variant}/" in again.stdout

    if not cuda:
        old = p.variants[0]
        header = project / "common" / "gated_silu_math.h"
        header.write_text(header.read_text() + "\n// edited: a new version of the kernel\n")
        edited = run_build(project, tmp_path / "cache", cuda=False)
        assert edited.returncode == 0, edited.stdout + edited.stderr
        new = plan(project).variants[0]
        assert new.ops_name != old.ops_name and f"namespace {new.ops_name}" in edited.stdout
        libs = sorted(f.name for f in (project / "torch-ext" / "gated_silu").glob("*.so"))
        assert libs == [new.library_name], libs
        assert [f.name for f in (project / "build" / cpu_variant / "gated_silu").glob("*.so")] == [new.library_name]
        # A package that fails to import fails the build, with its error, though it compiled.
        init = project / "torch-ext" / "gated_silu" / "__init__.py"
        init.write_text(init.read_text() + "\nraise ImportError('gated_silu: a planted failure')\n")
        broken = run_build(project, tmp_path / "cache", cuda=False)
        err = " ".join(broken.stderr.split())
        assert broken.returncode == 1 and "opforge: building" not in broken.stderr, broken.stdout + broken.stderr
        assert "opforge build: gated_silu: `import gated_silu` fails from torch-ext/: Traceback" in err, err
        assert "kernels.get_local_kernel(" in err and "ImportError: gated_silu: a planted failure" in err, err
    print(f"hub_kernel ({device}): built in " + ", ".join(f"{b} {s:.1f} s" for b, s in seconds.items()))


@pytest.mark.slow
def test_a_kernels_cxx_flags_reach_its_sources_and_no_other(tmp_path):
    """Built for real: kernel_a compiles only with its own -D flag and include
    folder, kernel_b and the binding only without them, and the package imports
    and runs with both kernels in it."""
    project = _two_kernel_project(tmp_path / "two-kernels")
    res = run_build(project, tmp_path / "cache", cuda=False)
    assert res.returncode == 0, res.stdout + res.stderr
    check = in_new_process('import sys\nsys.path.insert(0, "torch-ext")\nimport two_kernels\nprint("BOTH", two_kernels.both())\n', project)
    assert check.returncode == 0 and "BOTH 3.25" in check.stdout, check.stdout + check.stderr


DEVICE_LAMBDA_CU = """
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

template <typename F>
__global__ void apply(float* x, long n, F f) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) x[i] = f(x[i]);
}

void twice(at::Tensor& x) {
  long n = x.numel();
  // A __device__ lambda: nvcc takes it with --extended-lambda, which kernel-builder's builds pass.
  auto f = [] __device__(float v) { return 2.0f * v; };
  apply<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), n, f);
}
"""


@pytest.mark.slow
@pytest.mark.cuda
def test_a_cuda_kernel_with_a_device_lambda_builds_as_with_kernel_builder(tmp_path):
    project = tmp_path / "device-lambda"
    (project / "torch-ext" / "device_lambda").mkdir(parents=True)
    (project / "kernel").mkdir()
    (project / "build.toml").write_text(
        '[general]\nname = "device-lambda"\nbackends = ["cuda"]\n\n[torch]\nsrc = ["torch-ext/torch_binding.cpp"]\n\n'
        '[kernel.twice]\nbackend = "cuda"\nsrc = ["kernel/twice.cu"]\n'
    )
    (project / "kernel" / "twice.cu").write_text(DEVICE_LAMBDA_CU)
    (project / "torch-ext" / "torch_binding.cpp").write_text(
        '#include <ATen/core/Tensor.h>\n#include <torch/library.h>\n\n#include "registration.h"\n\nvoid twice(at::Tensor& x);\n\n'
        'TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {\n  ops.def("twice(Tensor! x) -> ()");\n'
        '  ops.impl("twice", c10::kCUDA, &twice);\n}\n\nREGISTER_EXTENSION(TORCH_EXTENSION_NAME)\n'
    )
    (project / "torch-ext" / "device_lambda" / "__init__.py").write_text("from ._ops import ops\n")
    res = run_build(project, tmp_path / "cache", cuda=True)
    assert res.returncode == 0, res.stdout + res.stderr
    code = (
        'import sys, torch\nsys.path.insert(0, "torch-ext")\nimport device_lambda\n'
        'x = torch.arange(97, dtype=torch.float32, device="cuda")\ny = x.clone()\ndevice_lambda.ops.twice(y)\n'
        'torch.testing.assert_close(y, 2 * x)\nprint("TWICE OK")\n'
    )
    check = in_new_process(code, project)
    assert check.returncode == 0 and "TWICE OK" in check.stdout, check.stdout + check.stderr


KERNELS_SCALED_ADD_CHECK = """
import torch, kernels
from pathlib import Path
module = kernels.get_local_kernel(Path("."), backend=BACKEND)
assert Path(module.__file__).parent.parent.name == VARIANT, module.__file__
device = "cuda" if VARIANT.split("-")[-3].startswith("cu") else "cpu"
for n in (1, 97, 4099):
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    torch.testing.assert_close(module.scaled_add(x, y, 0.75), x + 0.75 * y)
try:
    module.scaled_add(torch.randn(4, device=device, dtype=torch.float64), torch.randn(4, device=device, dtype=torch.float64))
    raise SystemExit("no error for float64")
except RuntimeError as exc:
    assert "scaled_add: takes float32 tensors" in str(exc), exc
print("KERNELS OK", VARIANT)
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_stable_abi_project_builds_for_every_torch_from_its_target(tmp_path, device):
    """[torch.stable-abi]: the build goes by opforge's stable-ABI route (libtorch_cpu
    alone, the CUDA runtime static) into build/torch-stable-abi210-.../, which
    kernels takes for every torch from 2.10 on."""
    need_kernels()
    project = copy_fixture(tmp_path, "hub_kernel_stable")
    cuda = device == "cuda"
    res = run_build(project, tmp_path / "cache", cuda=cuda)
    assert res.returncode == 0, res.stdout + res.stderr
    cpu_variant = variant_name("cpu", stable="2.10")
    assert "(CPU kernels; stable ABI, torch 2.10 and later)" in res.stdout
    assert f"get_local_kernel(backend='cpu') loads build/{cpu_variant}/: _scaled_add_cpu_" in res.stdout
    seconds = {"cpu": built_seconds(res, "scaled_add_cpu")}
    kernels_check(project, KERNELS_SCALED_ADD_CHECK, "cpu", cpu_variant)
    if cuda:
        seconds["cuda"] = built_seconds(res, "scaled_add_cuda")
        cuda_variant = next(d.name for d in (project / "build").iterdir() if d.name.startswith("torch-stable-abi210-cu"))
        assert f"get_local_kernel(backend='cuda') loads build/{cuda_variant}/: _scaled_add_cuda_" in res.stdout
        kernels_check(project, KERNELS_SCALED_ADD_CHECK, None, cuda_variant)
    print(f"hub_kernel_stable ({device}): built in " + ", ".join(f"{b} {s:.1f} s" for b, s in seconds.items()))
