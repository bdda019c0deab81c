"""Forward-mode AD: operators with a cheap tangent formula (the spec's jvp)
give the reference's tangents through every entry point (the public function,
torch.ops, torch.func.jvp); every other operator, and every derivative an
operator lacks, raises an error naming the operator instead of dropping the
tangent or the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwad

import opforge
from opforge.check.run import check_gradcheck, generator
from opforge.registry import all_specs, get_specs

from .conftest import DEVICES

WITH_JVP = ["add", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward", "gemm"]


def test_the_operators_with_a_tangent_formula():
    assert sorted(s.name for s in all_specs() if s.namespace == "opforge" and s.jvp is not None) == sorted(WITH_JVP)


def _samples(name, device, seed, count=3):
    (spec,) = get_specs([name])
    gen = generator(torch.device(device), seed)
    samples = [s for s in spec.samples(torch.device(device), torch.float64, gen)
               if all(a.numel() > 0 for a in s.args if isinstance(a, torch.Tensor))][:count]  # fmt: skip
    assert samples
    return spec, samples


def _tensor_positions(args):
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _over_tensors(fn, args, positions):
    """fn as a function of the tensors at ``positions`` alone (the others fixed)."""

    def f(*tensors):
        full = list(args)
        for i, t in zip(positions, tensors, strict=True):
            full[i] = t
        return fn(*full)

    return f


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["public", "torch.ops"])
@pytest.mark.parametrize("name", WITH_JVP)
def test_jvp_matches_the_reference(name, entry, device, seed):
    spec, samples = _samples(name, device, seed)
    call = spec.function if entry == "public" else spec.overload
    gen = generator(torch.device(device), seed + 1)
    for sample in samples:
        positions = _tensor_positions(sample.args)
        primals = tuple(sample.args[i] for i in positions)
        tangents = tuple(torch.randn(p.shape, dtype=p.dtype, device=p.device, generator=gen) for p in primals)
        out, got = torch.func.jvp(_over_tensors(call, sample.args, positions), primals, tangents)
        want_out, want = torch.func.jvp(_over_tensors(spec.reference, sample.args, positions), primals, tangents)
        torch.testing.assert_close(out, want_out, msg=sample.desc)
        torch.testing.assert_close(got, want, msg=sample.desc)
        assert not all(torch.equal(g, torch.zeros_like(g)) for g in (got if isinstance(got, tuple) else (got,)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["add", "axpby", "gemm", "sigmoid_backward"])
def test_a_tangent_on_one_input_only(name, device, seed):
    """Inputs without a tangent count as zero (the formulas skip their term)."""
    spec, samples = _samples(name, device, seed, count=1)
    (sample,) = samples
    positions = _tensor_positions(sample.args)
    gen = generator(torch.device(device), seed + 1)
    for k in positions:
        t = torch.randn(sample.args[k].shape, dtype=torch.float64, device=device, generator=gen)
        with fwad.dual_level():
            args = [fwad.make_dual(a, t) if i == k else a for i, a in enumerate(sample.args)]
            got = fwad.unpack_dual(spec.function(*args)).tangent
        _, want = torch.func.jvp(_over_tensors(spec.reference, sample.args, [k]), (sample.args[k],), (t,))
        torch.testing.assert_close(got, want)


def _lltm_args(device, requires_grad=False):
    gen = generator(torch.device(device), 7)
    b, f, s = 2, 3, 4
    shapes = [(b, f), (3 * s, f + s), (3 * s,), (b, s), (b, s)]
    return [torch.randn(sh, dtype=torch.float64, device=device, generator=gen).requires_grad_(requires_grad) for sh in shapes]


@pytest.mark.parametrize("device", DEVICES)
def test_a_tangent_where_there_is_no_formula_raises(device):
    args = _lltm_args(device)
    with fwad.dual_level():
        dual = [fwad.make_dual(args[0], torch.randn_like(args[0])), *args[1:]]
        for call in (opforge.lltm_forward, torch.ops.opforge.lltm_forward):
            with pytest.raises(
                NotImplementedError, match=r"^opforge::lltm_forward: forward-mode AD is not supported \(a tangent .* for input\)"
            ):
                call(*dual)
    with pytest.raises(NotImplementedError, match=r"^opforge::lltm_forward: forward-mode AD"):
        torch.func.jvp(lambda x: opforge.lltm_forward(x, *args[1:])[0], (args[0],), (torch.randn_like(args[0]),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["public", "torch.ops"])
def test_out_forms_refuse_a_tangent(entry, device):
    x, y = torch.randn(5, device=device), torch.randn(5, device=device)
    out = torch.empty(5, device=device)
    call = opforge.add_out if entry == "public" else torch.ops.opforge.add_out
    with fwad.dual_level():
        for args in ((fwad.make_dual(x, torch.randn_like(x)), y, out), (x, fwad.make_dual(y, torch.randn_like(y)), out)):
            name = "a" if fwad.unpack_dual(args[0]).tangent is not None else "b"
            with pytest.raises(NotImplementedError, match=rf"^opforge::add_out: {name} has a tangent, but forward-mode AD is not"):
                call(*args)
    call(x, y, out)
    torch.testing.assert_close(out, x + y)


@pytest.mark.parametrize("device", DEVICES)
def test_lltm_double_backward_raises_naming_the_operator(device):
    args = _lltm_args(device, requires_grad=True)
    h, _, _ = opforge.lltm_forward(*args)
    (g,) = torch.autograd.grad(h.sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match=r"^opforge::lltm_backward: has no derivative \(it is lltm_forward's gradient"):
        g.sum().backward()
    # The first derivative alone still works, with or without create_graph.
    h, _, _ = opforge.lltm_forward(*args)
    (g2,) = torch.autograd.grad(h.sum(), args[0])
    torch.testing.assert_close(g2, g.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_a_gradient_through_an_operator_without_one_raises(device):
    (spec,) = get_specs(["qqq_gemm"])
    gen = generator(torch.device(device), 3)
    sample = next(iter(spec.samples(torch.device(device), torch.float16 if device == "cuda" else torch.float32, gen)))
    k = next(i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.is_floating_point())  # a scale
    args = [a.detach().clone().requires_grad_() if i == k else a for i, a in enumerate(sample.args)]
    out = spec.function(*args)
    with pytest.raises(RuntimeError, match=r"^opforge::qqq_gemm: has no derivative \(an inference kernel on quantised weights"):
        out.float().sum().backward()
    # Without a gradient wanted, the same call runs.
    with torch.no_grad():
        torch.testing.assert_close(spec.function(*args), out.detach())


def test_check_compares_the_tangent_formula_with_the_numerical_jacobian(monkeypatch, seed):
    (spec,) = get_specs(["square"])
    cpu = torch.device("cpu")
    assert check_gradcheck(spec, cpu, seed).status == "pass"
    monkeypatch.setattr(spec, "jvp", lambda inputs, tangents, output: tangents[0] * 3 * inputs[0])
    res = check_gradcheck(spec, cpu, seed)
    assert res.status == "fail"
    assert "Jacobian computed with forward mode mismatch" in res.failures[0]
