"""Operators on DTensor: the strategies each spec declares (opforge.sharding_strategies), the sharding
check on a simulated mesh (opforge.check.sharding), users' declarations, and tensor-parallel
QQQLinear (opforge.tensor_parallel), all on the CPU in this process (LocalTensorMode). The same
through real processes (gloo, and NCCL on two GPUs) is in test_distributed.py."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import opforge
from opforge import sharding_strategies
from opforge.check.run import CHECKS, check_op
from opforge.check.sharding import check_sharding, simulated_mesh
from opforge.nn import QQQLinear
from opforge.opspec import OpSpec, Sample
from opforge.registry import all_specs, get_specs

from .conftest import SRC, opforge_process

FIXTURE = Path(__file__).parent / "fixtures" / "sharding"
CPU = torch.device("cpu")
NS = "opforge_test_sharding"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def gathered(d) -> Tensor:
    """A DTensor's global value as a plain tensor (LocalTensorMode: every rank's must agree)."""
    full = d.full_tensor()
    return full.reconcile() if hasattr(full, "reconcile") else full


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC, **env}, capture_output=True, text=True, timeout=600
    )


# --- users' operators, registered here through torch.library ---


@torch.library.custom_op(f"{NS}::softsign", mutates_args=())
def softsign(x: Tensor) -> Tensor:
    return x / (1 + x.abs())


softsign.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op(f"{NS}::square", mutates_args=())
def square(x: Tensor) -> Tensor:
    return x * x


square.register_fake(lambda x: torch.empty_like(x))


# For the sharding functions that are wrong: an operator of their own, whose strategy each replaces.
@torch.library.custom_op(f"{NS}::halve", mutates_args=())
def halve(x: Tensor) -> Tensor:
    return x / 2


halve.register_fake(lambda x: torch.empty_like(x))


# A keyword-only tensor (custom_op refuses those; torch.library.define does not).
torch.library.define(f"{NS}::scale", "(Tensor x, *, Tensor w) -> Tensor")
torch.library.impl(f"{NS}::scale", "CPU")(lambda x, *, w: x * w)
torch.library.register_fake(f"{NS}::scale")(lambda x, *, w: torch.empty_like(x))


def _registered(op, **fields) -> OpSpec:
    """A spec whose strategies DTensor has (as registering it gives them), kept out of opforge's
    registry: other tests list every registered operator."""
    made = opforge.spec(op, **fields)
    sharding_strategies.register(made)
    return made


SOFTSIGN = _registered(torch.ops.opforge_test_sharding.softsign.default, reference=lambda x: x / (1 + x.abs()), sharding="pointwise")
# Planted: square declared linear, so that Partial would pass through it (it must not).
WRONG_SQUARE = _registered(torch.ops.opforge_test_sharding.square.default, reference=lambda x: x * x, sharding="pointwise-linear")
SCALE = _registered(torch.ops.opforge_test_sharding.scale.default, reference=lambda x, *, w: x * w, sharding="pointwise")


# --- registration: lazy, at op library load, and nothing without distributed ---


def test_import_opforge_leaves_dtensor_unimported_and_dtensor_gets_the_strategies_on_import():
    res = run_python(
        "import sys, opforge\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'import opforge imported DTensor'\n"
        "from torch.distributed.tensor import DTensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "print(sorted(str(op) for op in funcs if str(op).startswith('opforge.')))\n"
    )
    assert res.returncode == 0, res.stderr
    got = res.stdout.strip().splitlines()[-1]
    for spec in all_specs():
        if spec.namespace == "opforge":
            assert f"'opforge.{spec.name}.default'" in got


def test_dtensor_imported_before_opforge_gets_the_strategies_at_once():
    res = run_python(
        "import torch, torch.distributed.tensor as dt, opforge\n"
        "assert torch.ops.opforge.gemm.default in dt.DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
    )
    assert res.returncode == 0, res.stderr


def test_a_torch_without_distributed_gets_no_strategies_and_the_check_says_so(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    spec = opforge.spec(torch.ops.opforge_test_sharding.softsign.default, reference=lambda x: x, sharding="pointwise")
    sharding_strategies.register(spec)  # nothing to register with: no error
    assert spec not in sharding_strategies._pending
    r = check_sharding(spec, CPU, 0)
    assert (r.status, r.note) == ("n/a", "torch built without distributed")


def test_a_sharding_that_is_neither_a_word_nor_a_function_is_refused_naming_the_operator():
    spec = opforge.spec(torch.ops.opforge_test_sharding.softsign.default, reference=lambda x: x, sharding="elementwise")
    with pytest.raises(
        ValueError, match=r"opforge_test_sharding::softsign: sharding must be 'pointwise' or 'pointwise-linear'.*'elementwise'"
    ):
        sharding_strategies.validate(spec)


# --- the sharding check ---


def test_the_sharding_check_is_a_column_of_opforge_check():
    assert "sharding" in CHECKS


@pytest.mark.parametrize("name", [s.qualname for s in all_specs() if s.namespace == "opforge"])
def test_every_library_operator_matches_its_reference_in_every_declared_placement_on_2_and_4_ranks(name, seed):
    spec = get_specs([name])[0]
    assert spec.sharding is not None, f"{name} declares no sharding"
    r = check_sharding(spec, CPU, seed)
    assert r.status == "pass", "\n".join(r.failures)
    assert r.count >= 4


def test_a_planted_wrong_strategy_fails_naming_its_placements(seed):
    r = check_sharding(WRONG_SQUARE, CPU, seed)
    assert r.status == "fail"
    # Partial in, Partial out: sum of squares is not the square of the sum; the other strategies hold.
    assert r.failures and all("declared x P -> P: output 0:" in f for f in r.failures), r.failures
    assert any(", 2 ranks:" in f for f in r.failures) and any(", 4 ranks:" in f for f in r.failures)


def test_valid_strategies_nobody_declared_are_listed(seed):
    # sigmoid_backward is linear in grad alone: Partial grad with replicated y is valid, not declared.
    r = check_sharding(get_specs(["opforge::sigmoid_backward"])[0], CPU, seed)
    assert r.status == "pass"
    assert "valid, not declared: grad P, y R -> P" in r.note
    # gemm declares every strategy the search finds.
    assert "valid, not declared" not in check_sharding(get_specs(["opforge::gemm"])[0], CPU, seed).note


def test_an_operator_without_strategies_is_not_applicable(seed):
    spec = opforge.spec(torch.ops.opforge_test_sharding.softsign.default, reference=lambda x: x / (1 + x.abs()))
    r = check_op(spec, CPU, seed, ["sharding"])[0]
    assert (r.status, r.note) == ("n/a", "no strategies declared")


def _raises(x):
    raise ValueError("no strategy for this shape")


def _shard_7(x):
    from torch.distributed.tensor import Shard

    return [([Shard(7)], [Shard(7)])]


_PLACEMENTS = r"placements are torch.distributed.tensor's Shard\(dim\), Replicate\(\) and Partial\(\)"
WRONG_FUNCTIONS = {
    "raises": (_raises, r"the sharding function raised ValueError: no strategy for this shape$"),
    "returns None": (
        lambda x: None,
        r"the sharding function returned None; it must return a list of \(output placements, input placements\)$",
    ),
    "Shard(7) of a 2-d tensor": (
        _shard_7,
        r"sharding strategy 0 gives Shard\(7\) for argument x, which has 2 dimensions \(shape \[5, 6\]\)$",
    ),
    "strings": (lambda x: [(["S"], ["S"])], rf"the sharding function returned 'S' among strategy 0's output placements; {_PLACEMENTS}$"),
}


@pytest.mark.parametrize("kind", WRONG_FUNCTIONS)
def test_a_wrong_sharding_function_is_one_line_naming_the_operator_in_the_check_and_on_dtensor(kind, seed):
    from torch.distributed.tensor import Shard, distribute_tensor

    function, message = WRONG_FUNCTIONS[kind]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
    samples = lambda device, dtype, gen: [Sample((x.to(device, dtype),), desc="5x6")]  # noqa: E731
    spec = _registered(torch.ops.opforge_test_sharding.halve.default, reference=lambda x: x / 2, samples=samples, sharding=function)
    r = check_sharding(spec, CPU, seed)
    assert (r.status, r.tag, len(r.failures)) == ("fail", "spec", 1), r.failures
    assert re.match(f"opforge_test_sharding::halve: {message}", r.failures[0]), r.failures[0]
    # DTensor calls the same function as the operator runs: its error names the operator too.
    with simulated_mesh(2) as mesh, pytest.raises(RuntimeError, match=f"opforge_test_sharding::halve: {message.rstrip('$')}"):
        torch.ops.opforge_test_sharding.halve(distribute_tensor(x, mesh, [Shard(0)]))


def test_a_keyword_only_tensor_keeps_its_placement_and_the_others_come_to_it(seed):
    # DTensor never redistributes a keyword argument: a strategy that moved w would compute on
    # w's old shards. Only the strategies keeping w where it is are offered.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(9, 5, generator=gen), torch.randn(9, 5, generator=gen)
    with simulated_mesh(2) as mesh:
        for px, pw in ((Replicate(), Shard(0)), (Shard(1), Replicate()), (Shard(0), Shard(1))):
            out = torch.ops.opforge_test_sharding.scale(distribute_tensor(x, mesh, [px]), w=distribute_tensor(w, mesh, [pw]))
            assert out.placements == (pw,)
            torch.testing.assert_close(gathered(out), x * w)


def test_add_out_writes_into_out_where_it_is(seed):
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    a, b, o = (torch.randn(7, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    with simulated_mesh(2) as mesh:
        for pa, po in ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(1), Shard(0))):
            out = distribute_tensor(o.clone(), mesh, [po])
            assert torch.ops.opforge.add_out(distribute_tensor(a, mesh, [pa]), distribute_tensor(b, mesh, [pa]), out) is None
            assert out.placements == (po,)
            torch.testing.assert_close(gathered(out), a + b, rtol=0, atol=0)
        # A partial out stays partial: each rank writes its piece of a + b.
        pieces = LocalTensor({0: o / 4, 1: 3 * o / 4})
        p = DTensor.from_local(pieces, mesh, [Partial()], run_check=False)
        pa, pb = (DTensor.from_local(LocalTensor({0: t / 2, 1: t / 2}), mesh, [Partial()], run_check=False) for t in (a, b))
        torch.ops.opforge.add_out(pa, pb, p)
        assert p.placements == (Partial(),)
        torch.testing.assert_close(gathered(p), a + b)


def test_lltm_backward_output_mask_is_part_of_dtensors_cache_key(seed):
    # The masked-out gradients are empty tensors: the same input placements with another mask must
    # not reuse the first call's output shapes.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from opforge.ops.lltm import backward_args, make_cell

    gen = torch.Generator().manual_seed(seed)
    args = backward_args(make_cell(6, 5, 4, torch.float64, CPU, gen), gen, grad_gates=True)
    places = [Shard(0)] * 7 + [Replicate()]
    with simulated_mesh(2) as mesh:
        dargs = [distribute_tensor(t, mesh, [p]) for t, p in zip(args, places, strict=True)]
        for mask in ([True] * 5, [False, True, False, True, False], [True] * 5):
            want = torch.ops.opforge.lltm_backward(*args, mask)
            got = torch.ops.opforge.lltm_backward(*dargs, mask)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(gathered(g), w)


# --- a user's operator, declared in one word ---


def test_a_user_operator_declared_pointwise_runs_on_dtensor_forward_and_backward(seed):
    from torch.distributed.tensor import Shard, distribute_tensor

    assert sharding_strategies.registered(SOFTSIGN.qualname) or "torch.distributed.tensor" not in sys.modules
    r = check_sharding(SOFTSIGN, CPU, seed)
    assert r.status == "pass", r.failures
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(seed))
    with simulated_mesh(2) as mesh:
        out = torch.ops.opforge_test_sharding.softsign(distribute_tensor(x, mesh, [Shard(1)]))
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(gathered(out), x / (1 + x.abs()))


def test_a_five_line_spec_file_with_pointwise_sharding_passes_the_check_and_a_planted_one_fails(tmp_path, seed, opforge_here):
    spec_file = str(FIXTURE / "softsign_spec.py")
    code, out, err = opforge_here("check", spec_file, "--checks", "reference,sharding", "--seed", str(seed), cwd=tmp_path)
    assert code == 0, out + err
    assert "sharding" in out and out.strip().endswith("2 passed, 0 failed")
    # In a process of its own: a spec named square registered here would be what the other tests
    # of this process get for opforge's square.
    res = opforge_process(
        "check", str(FIXTURE / "wrong_square_spec.py"), "--checks", "sharding", "--seed", str(seed), cwd=tmp_path, autoload=False
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "x sharding: square [" in res.stdout and "declared x P -> P: output 0:" in res.stdout
    assert res.stdout.strip().endswith("0 passed, 1 failed")


def test_opforge_new_gets_a_commented_sharding_line():
    template = Path(opforge.__file__).parent / "templates" / "new" / "package" / "ops" / "op.py.j2"
    assert '# sharding="pointwise",' in template.read_text()


# --- tensor-parallel QQQLinear ---


def _qqq_mlp(group_size: int, bias: bool, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        QQQLinear.from_linear(torch.nn.Linear(256, 512, bias=bias), group_size=group_size, out_dtype=torch.float16),
        QQQLinear.from_linear(torch.nn.Linear(512, 128, bias=bias), group_size=group_size, out_dtype=torch.float16),
    )


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_column_then_row_parallel_pair_of_qqq_linears_equals_one_device(group_size, ranks, bias, seed):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

    one = _qqq_mlp(group_size, bias, seed)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(seed), dtype=torch.float16)
    with torch.no_grad():
        want = one(x)
        hidden = one[0](x)
    with simulated_mesh(ranks) as mesh:
        tp = parallelize_module(copy.deepcopy(one), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel(use_local_output=False)})
        assert tp[0].w_packed.placements == (Shard(0),) and tp[1].w_packed.placements == (Shard(1),)
        with torch.no_grad():
            got = gathered(tp(x))
            up = parallelize_module(copy.deepcopy(one[0]), mesh, ColwiseParallel(output_layouts=Replicate(), use_local_output=False))
            got_hidden = gathered(up(x))
    # Column-parallel: the one device's columns, bit for bit.
    torch.testing.assert_close(got_hidden, hidden, rtol=0, atol=0)
    # Row-parallel: float32 partial sums of the same int8 activations (scales over the whole row),
    # reduced, then rounded to float16 once as on one device: an ulp of float16 apart at most where the
    # float32 sums round to the other side; with a bias, an ulp of the product before it is added.
    rtol, atol = (2**-9, 2**-14) if bias else (2**-10, 2**-24)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert (got != want).float().mean() < 0.01


def test_row_parallel_quantises_with_the_whole_rows_scales(seed):
    # The scales of each rank's own share of the row would give other int8 activations: the
    # result would then differ from one device's beyond float16's rounding.
    from opforge.quant import quantize_act_int8

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed))
    _, s_whole = quantize_act_int8(x)
    _, s_half = quantize_act_int8(x[:, :128])
    assert not torch.equal(s_whole, s_half)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with simulated_mesh(2) as mesh:
        a, s = quantize_act_int8(distribute_tensor(x, mesh, [Shard(1)]))
        assert s.placements == (Replicate(),)
        torch.testing.assert_close(gathered(s), s_whole, rtol=0, atol=0)
        torch.testing.assert_close(gathered(a), quantize_act_int8(x)[0], rtol=0, atol=0)


def test_qqq_linears_that_do_not_split_evenly_are_refused_naming_the_sizes():
    from torch.distributed.tensor.parallel import parallelize_module

    from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

    layer = QQQLinear(96, 96)
    with simulated_mesh(2) as mesh:
        with pytest.raises(ValueError, match=r"column-parallel over 2 ranks needs out_features / 32 divisible by 2 .* out_features = 96"):
            parallelize_module(copy.deepcopy(layer), mesh, ColwiseParallel())
        with pytest.raises(ValueError, match=r"row-parallel over 2 ranks needs in_features / 32 divisible by 2 .* in_features = 96"):
            parallelize_module(copy.deepcopy(layer), mesh, RowwiseParallel())


# A user's training script: an operator of its own, its spec declared and registered in the script,
# then called on DTensors at once (no spec file, no package import to register the strategy).
USER_SCRIPT = """
import torch, torch.distributed as dist, opforge
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

@torch.library.custom_op("userop::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x

cube.register_fake(lambda x: torch.empty_like(x))
spec = opforge.register(opforge.spec(torch.ops.userop.cube.default, reference=lambda x: x**3, sharding="pointwise"))
assert opforge.register(spec) is spec  # the same spec again: nothing more to do
dist.init_process_group("fake", rank=0, world_size=2)
with LocalTensorMode(2):
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(7, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    out = torch.ops.userop.cube(d)
    full = out.full_tensor()
    full = full.reconcile() if hasattr(full, "reconcile") else full
print("placements:", out.placements, "equal:", torch.allclose(full, x**3))
dist.destroy_process_group()
"""


def test_a_spec_registered_in_a_users_script_shards_at_once():
    res = run_python(USER_SCRIPT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "placements: (Shard(dim=0),) equal: True" in res.stdout, res.stdout


def test_register_refuses_what_is_not_a_spec():
    with pytest.raises(TypeError, match=r"opforge.register: expected an OpSpec .*got str: 'cube'"):
        opforge.register("cube")


def test_the_older_import_path_opforge_parallel_gives_the_same_styles():
    # lazy: importing the styles imports DTensor, which the tests above want unimported at first
    from opforge import parallel, tensor_parallel

    assert (parallel.ColwiseParallel, parallel.RowwiseParallel) == (tensor_parallel.ColwiseParallel, tensor_parallel.RowwiseParallel)
