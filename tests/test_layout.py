"""One operator = one folder under csrc/ops + one spec module of the same name;
every operator the library defines has a spec. Nothing else lists operators."""

from __future__ import annotations

import pkgutil

import torch

import opforge.ops
from opforge.builder import csrc_dir
from opforge.registry import all_specs


def test_every_op_folder_has_a_spec_module_and_back():
    folders = {p.name for p in (csrc_dir() / "ops").iterdir() if p.is_dir()}
    modules = {m.name for m in pkgutil.iter_modules(opforge.ops.__path__) if not m.name.startswith("_")}
    assert folders == modules


def test_every_defined_operator_has_a_spec():
    specs = {s.name for s in all_specs() if s.namespace == "opforge"}
    defined = {name for name in dir(torch.ops.opforge) if isinstance(getattr(torch.ops.opforge, name), torch._ops.OpOverloadPacket)}
    assert defined == specs


def test_kernel_files_include_no_torch_headers():
    for cu in (csrc_dir() / "ops").glob("*/*.cu"):
        text = cu.read_text()
        assert "#include <torch" not in text and "#include <ATen" not in text and "#include <c10" not in text, cu


def test_sources_use_minimal_headers():
    for src in csrc_dir().rglob("*.[ch]*"):
        assert "#include <torch/extension.h>" not in src.read_text(), src
