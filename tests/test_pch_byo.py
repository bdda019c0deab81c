"""Precompiled torch headers for users' folders (opforge.builder.pch).

Which sources get one is read from how each begins, with no compiler: those
tests run in milliseconds. One slow test compiles: two folders that begin
with the same torch header share one precompiled header from the cache, a
source that includes no torch header compiles without it, and a header the
entry was made from that changed (as a reinstalled torch changes them) makes
the next build precompile it again.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from opforge.builder import folder_config
from opforge.builder.inline import pybind_folder_config
from opforge.builder.jit import build_library
from opforge.builder.pch import is_torch_header, plan, torch_prefix, with_torch_pch

from .conftest import write

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _header_on(monkeypatch):
    # The suite turns users' precompiled headers off (tests/conftest.py); these are its tests.
    monkeypatch.setenv("OPFORGE_PCH", "1")


@pytest.mark.parametrize(
    ("text", "prefix"),
    [
        ("#include <torch/extension.h>\nint f();\n", ("<torch/extension.h>",)),
        (
            "// a comment\n#pragma once\n/* more */\n#include <ATen/ATen.h>\n#include <torch/library.h>\n",
            ("<ATen/ATen.h>", "<torch/library.h>"),
        ),
        # Python.h first, as it must be: the header begins the same way.
        ("#include <Python.h>\n#include <torch/library.h>\n#include <vector>\n", ("<Python.h>", "<torch/library.h>")),
        ('#  include  <c10/util/Exception.h>   // why\n#include "mine.h"\n#include <torch/torch.h>\n', ("<c10/util/Exception.h>",)),
        # Nothing that could change what torch's headers mean may come before them.
        ("#define TORCH_ASSERT_ONLY_METHOD_OPERATORS\n#include <ATen/core/Tensor.h>\n", ()),
        ('#include "my_op.h"\n#include <torch/extension.h>\n', ()),
        ("#ifdef WITH_TORCH\n#include <torch/extension.h>\n#endif\n", ()),
        ("#include <vector>\nint f();\n#include <torch/extension.h>\n", ()),
        ('#pragma GCC optimize("O0")\n#include <torch/extension.h>\n', ()),
        ("#include <cstdint>\n\nvoid add2_cpu(float* c);\n", ()),
        # A CUDA header needs the toolkit's headers: the host compiler alone cannot precompile it.
        ("#include <torch/extension.h>\n#include <c10/cuda/CUDAGuard.h>\n", ("<torch/extension.h>",)),
        ("#include <ATen/cuda/CUDAContext.h>\n#include <torch/extension.h>\n", ()),
    ],
)
def test_the_header_is_the_run_of_system_includes_a_source_begins_with_up_to_its_last_torch_one(text, prefix):
    assert torch_prefix(text) == prefix


def test_torch_headers_are_torch_aten_and_c10_but_not_their_device_ones():
    assert all(map(is_torch_header, ["torch/extension.h", "ATen/ATen.h", "c10/core/ScalarType.h", "torch/csrc/stable/library.h"]))
    assert not any(map(is_torch_header, ["pybind11/pybind11.h", "c10/cuda/CUDAStream.h", "ATen/CUDAGeneratorImpl.h", "vector"]))


def test_only_the_sources_that_begin_with_torch_headers_get_the_header():
    folder = FIXTURES / "add2_pybind"
    cfg = pybind_folder_config(folder)
    assert cfg.pch_headers == ("<torch/extension.h>",)
    # kernel/add2_kernel.cpp includes add2.h and no torch header: compiled as it is.
    assert [p.relative_to(folder).as_posix() for p in cfg.pch_units] == ["pytorch/add2_bind.cpp"]
    # Those sources get only the headers they begin with: the same library with or without the
    # header, one cache entry (a folder imported, then built by `opforge build`, is found in the cache).
    assert dataclasses.replace(cfg, pch_headers=(), pch_units=()).key() == cfg.key()
    # Headers put in front of every source (no units named) change what each compiles: another library.
    assert dataclasses.replace(cfg, pch_units=()).key() != cfg.key()


def test_the_most_common_beginning_wins_and_the_others_compile_without(tmp_path):
    root = write(
        tmp_path / "mixed",
        {
            "a.cpp": "#include <torch/library.h>\n",
            "b.cpp": "#include <torch/library.h>\nint b();\n",
            "c.cpp": "#include <torch/extension.h>\n",
            "plain.cpp": "int plain() { return 1; }\n",
            "k.cu": "#include <torch/library.h>\n",
        },
    )
    p = plan(sorted(root.iterdir()), [root])
    assert p.headers == ("<torch/library.h>",) and [u.name for u in p.units] == ["a.cpp", "b.cpp"]
    assert p.summary(root, 4) == "<torch/library.h> for 2 of 4 C++ sources (a.cpp, b.cpp); built once, shared through the cache"


def test_a_folder_with_torch_headers_of_its_own_gets_none_and_is_told_why(tmp_path):
    root = write(tmp_path / "shadow", {"op.cpp": "#include <torch/library.h>\n", "include/torch/library.h": "#pragma once\n"})
    cfg, p = with_torch_pch(folder_config(root, with_cuda=False))
    assert cfg.pch_headers == () and cfg.pch_units == ()
    assert p.summary(root, 1) == f"none: {root / 'include'} has its own torch/library.h, which the sources would include instead of torch's"


def test_opforge_kit_counts_as_a_torch_header_where_it_is_opforges_own(tmp_path):
    # What `opforge new` writes: a standard header, then opforge's ATen kit (quoted, on the include path).
    kit = '#include <cmath>\n\n#include "opforge/aten/common.h"\n#include "my_op_kernel.h"\n'
    assert torch_prefix(kit) == ("<cmath>", '"opforge/aten/common.h"')
    assert torch_prefix('#include "opforge/messages.h"\n#include <torch/library.h>\n') == ()  # not the kit: left alone
    root = write(tmp_path / "kit", {"op.cpp": kit, "my_op_kernel.h": "#pragma once\n"})
    cfg, p = with_torch_pch(folder_config(root, with_cuda=False))
    assert cfg.pch_headers == ("<cmath>", '"opforge/aten/common.h"') and cfg.pch_units == (root / "op.cpp",)
    # A folder with a file of the kit's name would include its own: the kit is not precompiled for it.
    for where in ("opforge/aten/common.h", "include/opforge/aten/common.h"):
        own = write(tmp_path / where.replace("/", "_"), {"op.cpp": kit, where: "#pragma once\n"})
        cfg, p = with_torch_pch(folder_config(own, with_cuda=False))
        assert cfg.pch_headers == () and p.summary(own, 1).startswith("none: ") and "has its own opforge/aten/common.h" in p.summary(own, 1)


def test_no_header_when_turned_off_or_when_nothing_begins_with_torch(tmp_path, monkeypatch):
    root = write(tmp_path / "p", {"op.cpp": "#include <torch/library.h>\n", "k.cpp": '#include "k.h"\n'})
    monkeypatch.setenv("OPFORGE_PCH", "0")
    assert plan([root / "op.cpp"], [root]).summary(root, 1) == "off (OPFORGE_PCH=0)"
    monkeypatch.delenv("OPFORGE_PCH")
    assert plan([root / "k.cpp"], [root]).summary(root, 1) == "none (no C++ source begins with torch's headers)"


def test_the_cli_says_which_sources_get_the_header_before_compiling():
    from opforge.folders.describe import describe
    from opforge.folders.discover import discover

    layout = discover(FIXTURES / "gemm_nested")
    lines = describe(layout, route=layout.route, cuda_reason="no CUDA here")
    assert (
        "  precompiled header: <ATen/core/Tensor.h> <torch/library.h> for 1 of 2 C++ sources (pytorch_wrapper/gemm_op.cpp); "
        "built once, shared through the cache"
    ) in lines


# --------------------------------------------------------------- with a compiler


_OP = """#include <torch/library.h>

#include "helper.h"

at::Tensor {ns}_twice(const at::Tensor& x) {{ return x.mul(helper_two()); }}

TORCH_LIBRARY({ns}, m) {{ m.def("twice(Tensor x) -> Tensor"); }}
TORCH_LIBRARY_IMPL({ns}, CPU, m) {{ m.impl("twice", &{ns}_twice); }}
"""


def _folder(root: Path, ns: str) -> Path:
    return write(
        root / ns,
        {
            "ops/op.cpp": _OP.format(ns=ns),
            "include/helper.h": "#pragma once\ndouble helper_two();\n",
            "kernels/helper.cpp": '#include "helper.h"\ndouble helper_two() { return 2.0; }\n',
        },
    )


def _compile_commands(objects: Path) -> dict[str, str]:
    ninja = shutil.which("ninja") or str(Path(__import__("ninja").BIN_DIR) / "ninja")
    out = subprocess.run([ninja, "-C", str(objects), "-t", "commands"], capture_output=True, text=True, check=True, timeout=60).stdout
    return {Path(shlex.split(c)[shlex.split(c).index("-o") + 1]).name: c for c in out.splitlines() if " -c " in c}


def _gch_used(cmd: str, cwd: Path) -> str:
    """The .gch gcc loads for the compile (-H marks it with "!"), or ""."""
    argv = shlex.split(cmd)
    i = argv.index("-o")
    del argv[i : i + 2]
    res = subprocess.run([*argv, "-H", "-fsyntax-only"], cwd=cwd, capture_output=True, text=True, timeout=300)
    return next((ln[2:] for ln in res.stderr.splitlines() if ln.startswith("! ") and ln.endswith(".gch")), "")


@pytest.mark.slow  # precompiles torch/library.h and compiles three small folders
def test_the_header_is_built_once_shared_by_a_second_folder_and_rebuilt_when_a_header_it_holds_changes(tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(cache))
    monkeypatch.setenv("OPFORGE_BUILD_CUDA", "0")
    monkeypatch.setenv("OPFORGE_PCH", "1")

    def build(ns: str) -> tuple[Path, str]:
        cfg, p = with_torch_pch(folder_config(_folder(tmp_path, ns)))
        assert p.headers == ("<torch/library.h>",) and [u.name for u in p.units] == ["op.cpp"]
        build_library(cfg)
        return next(cache.glob(f"{ns}-*.objects")), capfd.readouterr().err

    objects, err = build("pchbyo_first")
    assert err.count("opforge: precompiling <torch/library.h>") == 1, err
    [entry] = cache.glob("pch-*/pch.h.gch")
    commands = _compile_commands(objects)
    assert _gch_used(commands["op.o"], objects) == str(entry)
    assert " -include " not in commands["helper.o"] and "/pch/" not in commands["helper.o"]  # no torch header: no header

    # Another folder, another include path, the same beginning: the same header, not built again.
    objects, err = build("pchbyo_second")
    assert "precompiling" not in err, err
    assert list(cache.glob("pch-*/pch.h.gch")) == [entry]
    assert _gch_used(_compile_commands(objects)["op.o"], objects) == str(entry)

    # A header it was made from changed (its recorded mtime no longer matches): precompiled again, in place.
    marker = entry.parent / "COMPLETE.json"
    meta = json.loads(marker.read_text())
    library_h = next(d for d in meta["deps"] if d[0].endswith("torch/library.h"))
    library_h[1] -= 1
    marker.write_text(json.dumps(meta))
    objects, err = build("pchbyo_third")
    assert err.count("opforge: precompiling <torch/library.h>") == 1, err
    assert list(cache.glob("pch-*/pch.h.gch")) == [entry]
    assert _gch_used(_compile_commands(objects)["op.o"], objects) == str(entry)
