"""The ``sharding`` check of ``opforge check``: every sharding strategy a spec declares,
run through DTensor on a simulated mesh, against the reference on the global tensors.

On the CPU, in this process: a mesh of 2 and then 4 ranks simulated by
``torch.distributed._local_tensor.LocalTensorMode`` (each rank's shard is a real tensor and the
operator's CPU kernel runs once per rank; collectives are computed on the shards), on a few of
the spec's own samples, whose sizes mostly do not divide evenly. Per sample and strategy:

* forward: the inputs distributed with the strategy's input placements (a ``Partial`` input as
  random pieces that sum to it), the operator called on the DTensors; the output must come out
  with the declared placements and, gathered, equal the reference on the global inputs (the
  reference check's tolerance; a ``Partial`` output's also allows for each piece's own rounding);
* backward (differentiable operators): gradients through DTensor, gathered, equal to the
  reference's own gradients (torch.autograd on the reference, float64).

A strategy that gives a wrong answer fails, named by its placements
(``a S(1), b S(0) -> P``: Shard on dim 1 and 0, Partial). Then the placements nobody declared
are tried directly (each rank's shard through the operator, no DTensor): the input placements
that give the reference, in some output placement, on two samples, are listed in the result's
note as valid but not declared, so that a user learns what to declare.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._mode_utils import no_dispatch

from opforge import sharding_strategies
from opforge.check.steps import CheckResult
from opforge.check.values import compare, self_overlapping, small, tensors
from opforge.opspec import OpSpec, Sample

RANKS: tuple[int, ...] = (2, 4)
# Samples per operator, and the largest tensor of one (every rank runs it, in Python's dispatch).
_N_SAMPLES = 3
_MAX_NUMEL = 4096
# Input placements tried in the search for undeclared strategies, at most.
_SEARCH_MAX = 1024


class Unavailable(Exception):
    """Why the check cannot run here (the result is n/a, with this as its note)."""


class _TooMany(Exception):  # too many combinations of input placements to try them all
    pass


# --- placements in a few characters ---


def short(p: Any) -> str:
    """``R``, ``S(d)``, ``P`` (``P(avg)`` for another reduction), ``-`` for None."""
    if p is None:
        return "-"
    if p.is_replicate():
        return "R"
    if p.is_shard():
        return f"S({p.dim})"
    return ("P" if p.reduce_op == "sum" else f"P({p.reduce_op})") if p.is_partial() else str(p)


def describe_strategy(spec: OpSpec, outs: Sequence[Any], ins: Sequence[Any], positions: Sequence[int]) -> str:
    """``a S(1), b S(0) -> P``: the tensor arguments' placements, then the outputs'."""
    names = [a.name for a in spec.schema.arguments]
    left = ", ".join(f"{names[i]} {short(ins[i])}" for i in positions)
    right = ", ".join(short(p) for p in outs) or "()"
    return f"{left} -> {right}"


# --- the simulated mesh ---


@contextlib.contextmanager
def simulated_mesh(ranks: int) -> Iterator[Any]:
    """A 1-D mesh of ``ranks`` ranks in this process: a fake process group and LocalTensorMode."""
    if dist.is_initialized():
        raise Unavailable("a process group is initialised in this process already")
    try:
        # lazy: optional dependency (LocalTensorMode, absent from older torch)
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as exc:  # pragma: no cover - torch without LocalTensorMode
        raise Unavailable(f"this torch has no LocalTensorMode ({exc})") from None
    dist.init_process_group("fake", rank=0, world_size=ranks)
    try:
        with LocalTensorMode(ranks):
            yield init_device_mesh("cpu", (ranks,))
    finally:
        dist.destroy_process_group()


def _local(pieces: Sequence[torch.Tensor]) -> Any:
    from torch.distributed._local_tensor import LocalTensor  # lazy: optional dependency (not in older torch)

    return LocalTensor({r: p for r, p in enumerate(pieces)})


def split(t: torch.Tensor, placement: Any, ranks: int, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each rank's piece of ``t`` under ``placement``, as DTensor cuts it (torch.chunk, empty
    shards past the end), and the global tensor they stand for: ``t``, or for ``Partial``
    the sum of random pieces (as DTensor's reduction adds them, rank by rank)."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: import time (torch.distributed.tensor, 0.75 s)

    if isinstance(placement, Replicate):
        return [t.clone() for _ in range(ranks)], t
    if isinstance(placement, Shard):
        chunks = [c.contiguous() for c in torch.chunk(t, ranks, dim=placement.dim)]
        chunks += [t.narrow(placement.dim, 0, 0).contiguous() for _ in range(ranks - len(chunks))]
        return chunks, t
    if isinstance(placement, Partial):
        pieces = [torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) for _ in range(ranks - 1)]
        pieces.append(t - sum(pieces))
        total = pieces[0].clone()
        for p in pieces[1:]:
            total = total + p
        return pieces, total
    raise ValueError(f"no simulated split for placement {placement}")


def _to_dtensor(pieces: Sequence[torch.Tensor], mesh: Any, placement: Any, global_t: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor  # lazy: import time (torch.distributed.tensor, 0.75 s)

    return DTensor.from_local(_local(pieces), mesh, [placement], run_check=False, shape=global_t.shape, stride=global_t.stride())


def assemble(pieces: Sequence[torch.Tensor], placement: Any, like: torch.Tensor) -> torch.Tensor | None:
    """The global tensor ``pieces`` stand for under ``placement`` (``like``: the reference, for
    its shape), or None where they cannot be that (a shard of another size than DTensor's)."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: import time (torch.distributed.tensor, 0.75 s)

    if any(p.dtype != pieces[0].dtype for p in pieces):
        return None
    if isinstance(placement, Replicate):
        return pieces[0] if all(p.shape == pieces[0].shape and torch.equal(p, pieces[0]) for p in pieces) else None
    if isinstance(placement, Shard):
        if placement.dim >= like.dim():
            return None
        want = [c.shape for c in torch.chunk(torch.empty(like.shape, device="meta"), len(pieces), dim=placement.dim)]
        got = (
            [p.shape for p in pieces if p.shape[placement.dim] > 0] if like.shape[placement.dim] else [p.shape for p in pieces][: len(want)]
        )
        if got != want:
            return None
        return torch.cat(list(pieces), dim=placement.dim)
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum" or any(p.shape != like.shape for p in pieces) or not pieces[0].is_floating_point():
            return None
        total = pieces[0].clone()
        for p in pieces[1:]:
            total = total + p
        return total
    return None


# --- samples and the reference ---


def sharding_dtype(spec: OpSpec) -> torch.dtype:
    return torch.float64 if torch.float64 in spec.dtypes else (torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0])


def sharding_samples(spec: OpSpec, seed: int, dtype: torch.dtype) -> list[Sample]:
    """A few of the spec's own samples (CPU): small, no shared-memory inputs, and every tensor with
    a dimension of at least 4 elements, so that 2 and 4 ranks both have something to shard."""
    picked = []
    for s in spec.samples(torch.device("cpu"), dtype, torch.Generator().manual_seed(seed)):
        ts = tensors(s.args) + tensors(list(s.kwargs.values()))
        if not ts or not small(s, _MAX_NUMEL) or self_overlapping(s) or any(t.dim() == 0 or max(t.shape) < 4 for t in ts):
            continue
        picked.append(s)
        if len(picked) == _N_SAMPLES:
            break
    return picked


def _as64(a: Any) -> Any:
    """As the reference check gives the reference its arguments: every tensor in float64."""
    return a.detach().to(torch.float64) if isinstance(a, torch.Tensor) else a


def _out_list(out: Any) -> list[Any]:
    return [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]


# --- the check ---


def check_sharding(spec: OpSpec, device: torch.device, seed: int) -> CheckResult:
    """The ``sharding`` check: every declared sharding strategy on a simulated mesh, against the
    reference (on the CPU whatever ``device`` is: the mesh is simulated there)."""
    if spec.sharding is None:
        return CheckResult(spec.name, "sharding", "n/a", note="no strategies declared")
    if not sharding_strategies.available():
        return CheckResult(spec.name, "sharding", "n/a", note="torch built without distributed")
    if not torch._C._dispatch_has_kernel_for_dispatch_key(
        spec.overload.name(), "CPU"
    ) and not torch._C._dispatch_has_kernel_for_dispatch_key(spec.overload.name(), "CompositeExplicitAutograd"):
        return CheckResult(spec.name, "sharding", "n/a", note="no CPU kernel (the mesh is simulated on the CPU)")
    res = CheckResult(spec.name, "sharding", "pass")
    dtype = sharding_dtype(spec)
    samples = sharding_samples(spec, seed, dtype)
    if not samples:
        return CheckResult(spec.name, "sharding", "n/a", note="no sample small enough with a dimension of 4 or more")
    sharding_strategies.ensure_registered()
    gen = torch.Generator().manual_seed(seed)
    try:
        for ranks in RANKS:
            with simulated_mesh(ranks) as mesh:
                for sample in samples:
                    _check_sample(res, spec, sample, dtype, mesh, ranks, gen)
        undeclared = search_undeclared(spec, samples, gen)
    except Unavailable as exc:
        return CheckResult(spec.name, "sharding", "n/a", note=str(exc))
    except sharding_strategies.DeclarationError as exc:  # the declaration itself is wrong: one line, whatever the sample
        return CheckResult(spec.name, "sharding", "fail", count=1, failures=[str(exc)], tag="spec")
    except _TooMany as exc:
        res.note = f"undeclared strategies not searched ({exc.args[0]} combinations of input placements)"
    else:
        if undeclared:
            res.note = "valid, not declared: " + "; ".join(undeclared)
    res.status = "fail" if res.failures else "pass"
    return res


def _arg_specs(spec: OpSpec, sample: Sample, mesh: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments as DTensor shows them to a strategy function: tensors as specs."""
    # lazy: import time (torch.distributed.tensor, 0.75 s)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(a.shape, a.stride(), a.dtype))
        return a

    return tuple(one(a) for a in sample.args), {k: one(v) for k, v in sample.kwargs.items()}


def _shardable(spec_args: Sequence[Any], ins: Sequence[Any], positions: Sequence[int], ranks: int) -> bool:
    """DTensor's own rule (is_tensor_shardable): a dimension it shards has at least one element per rank."""
    from torch.distributed.tensor import Shard  # lazy: import time (torch.distributed.tensor, 0.75 s)

    return all(not isinstance(ins[i], Shard) or spec_args[i].shape[ins[i].dim] >= ranks for i in positions)


def _check_sample(res: CheckResult, spec: OpSpec, sample: Sample, dtype: torch.dtype, mesh: Any, ranks: int, gen: torch.Generator) -> None:
    spec_args, spec_kwargs = _arg_specs(spec, sample, mesh)
    by_pos = sharding_strategies.by_position(spec, sample.args, dict(sample.kwargs))
    positions = sharding_strategies.tensor_positions(spec, spec_args, spec_kwargs)
    spec_by_pos = sharding_strategies.by_position(spec, spec_args, spec_kwargs)
    where = f"{spec.name} [{sample.desc}], {ranks} ranks"
    for outs, ins in sharding_strategies.declared_rows(spec, spec_args, spec_kwargs):
        if not _shardable(spec_by_pos, ins, positions, ranks):
            continue  # DTensor does not offer it at this size
        res.count += 1
        label = describe_strategy(spec, outs, ins, positions)
        try:
            problem = _run_strategy(spec, sample, by_pos, positions, outs, ins, dtype, mesh, ranks, gen)
        except Exception as exc:  # noqa: BLE001 - report, keep checking
            msg = str(exc).strip().splitlines()
            problem = f"raised {type(exc).__name__}: {msg[0] if msg else ''}"
        if problem:
            res.failures.append(f"{where}: declared {label}: {problem}")


def _run_strategy(
    spec: OpSpec,
    sample: Sample,
    by_pos: list[Any],
    positions: Sequence[int],
    outs: Sequence[Any],
    ins: Sequence[Any],
    dtype: torch.dtype,
    mesh: Any,
    ranks: int,
    gen: torch.Generator,
) -> str | None:
    """One declared strategy on one sample: None if DTensor's result (and gradients) match the reference."""
    names = [a.name for a in spec.schema.arguments]
    n_pos = len(sample.args)
    mutated = set(spec.mutated_args)
    backward = spec.differentiable and not mutated
    # Plain tensors are cut, drawn and compared outside LocalTensorMode (which would make each a
    # LocalTensor): under no_dispatch; only the DTensors go through the mode.
    with no_dispatch():
        cut = {i: split(by_pos[i], ins[i], ranks, gen) for i in positions}
    global_args = list(by_pos)
    dargs = list(by_pos)
    leaves: dict[int, Any] = {}
    for i in positions:
        pieces, global_t = cut[i]
        global_args[i] = global_t
        d = _to_dtensor(pieces, mesh, ins[i], global_t)
        if backward and global_t.is_floating_point():
            d = d.detach().requires_grad_()
            leaves[i] = d
        dargs[i] = d
    call_args = dargs[:n_pos]
    call_kwargs = {k: dargs[names.index(k)] for k in sample.kwargs}
    out = spec.overload(*call_args, **call_kwargs)
    outputs = _out_list(out) + [dargs[i] for i in sorted(mutated)]
    want_places = list(outs) + [ins[i] for i in sorted(mutated)]
    fulls = [None if o is None else o.full_tensor() for o in outputs]

    with no_dispatch():
        # The reference on the global tensors, in float64 (with its gradients).
        ref_args = [_as64(a) for a in global_args]
        ref_leaves = {i: ref_args[i].requires_grad_() for i in leaves}
        for i in mutated:
            ref_args[i] = ref_args[i].clone()
        expected = spec.reference(*ref_args[:n_pos], **{k: ref_args[names.index(k)] for k in sample.kwargs})
        expected_list = tensors(expected) + [ref_args[i] for i in sorted(mutated)]
    if len(expected_list) != len(outputs):
        return f"returned {len(outputs)} tensors, the reference {len(expected_list)}"
    atol, rtol = spec.tolerance(dtype, sample)
    problems = []
    for k, (o, full, want, ref) in enumerate(zip(outputs, fulls, want_places, expected_list, strict=True)):
        if o is None:
            continue
        got_place = tuple(o.placements)
        if got_place != (want,):
            problems.append(f"output {k} came out {', '.join(short(p) for p in got_place)}, declared {short(want)}")
        got = full.reconcile() if hasattr(full, "reconcile") else full
        slack = _partial_slack(o, rtol)
        with no_dispatch():
            if problem := compare(
                got.detach(), ref.detach() if got.is_floating_point() else ref.detach().to(got.dtype), atol + slack, rtol
            ):
                problems.append(f"output {k}: {problem}")
    if problems or not backward or not leaves:
        return "; ".join(problems) or None

    # Backward: a random gradient for each floating output, through DTensor and through the reference.
    with no_dispatch():
        grads = [torch.randn(r.shape, generator=gen, dtype=torch.float64) if r.requires_grad else None for r in expected_list]
    pairs = [(f, g) for f, g in zip(fulls, grads, strict=True) if f is not None and g is not None and f.requires_grad]
    if not pairs:
        return None
    loss = sum((f * _local([g.to(f.dtype)] * ranks)).sum() for f, g in pairs)
    loss.backward()
    with no_dispatch():
        ref_outs = [r for r, g in zip(expected_list, grads, strict=True) if g is not None]
        ref_grads = torch.autograd.grad(ref_outs, list(ref_leaves.values()), [g for g in grads if g is not None], allow_unused=True)
    for (i, leaf), want in zip(leaves.items(), ref_grads, strict=True):
        if leaf.grad is None:
            if want is not None and bool(want.abs().max() > 0):
                problems.append(f"no gradient for {names[i]} through DTensor")
            continue
        full = leaf.grad.full_tensor()
        got = full.reconcile() if hasattr(full, "reconcile") else full
        slack = _partial_slack(leaf.grad, rtol)
        with no_dispatch():
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
            if problem := compare(got, want, atol + slack, rtol):
                problems.append(f"gradient of {names[i]} ({short(leaf.grad.placements[0])}): {problem}")
    return "; ".join(problems) or None


def _partial_slack(o: Any, rtol: float) -> float:
    """A Partial output is a sum of pieces, each rounded on its rank: rtol of the pieces' sizes more."""
    from torch.distributed.tensor import Partial  # lazy: import time (torch.distributed.tensor, 0.75 s)

    if not isinstance(o.placements[0], Partial) or not o.is_floating_point():
        return 0.0
    local = o.to_local()
    pieces = [local._local_tensors[r] for r in sorted(local._local_tensors)] if hasattr(local, "_local_tensors") else [local]
    with no_dispatch():  # the pieces are plain tensors, each rank's: no LocalTensorMode for this sum
        return _pieces_slack(pieces, rtol)


def _pieces_slack(pieces: Sequence[torch.Tensor], rtol: float) -> float:
    if not pieces[0].numel() or any(p.shape != pieces[0].shape for p in pieces):
        return 0.0
    total = pieces[0].abs().to(torch.float64)
    for p in pieces[1:]:
        total = total + p.abs().to(torch.float64)
    return rtol * float(total.max())


# --- the search for strategies not declared ---


def _candidates(t: torch.Tensor) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: import time (torch.distributed.tensor, 0.75 s)

    out: list[Any] = [Replicate(), *(Shard(d) for d in range(t.dim()))]
    if t.is_floating_point():
        out.append(Partial())
    return out


def _try_placements(
    spec: OpSpec, sample: Sample, by_pos: list[Any], positions: Sequence[int], ins: dict[int, Any], ranks: int, gen: torch.Generator
) -> tuple[Any, ...] | None:
    """Runs the operator on each rank's shards under ``ins``, without DTensor; the output
    placements under which the pieces make the reference, or None."""
    names = [a.name for a in spec.schema.arguments]
    n_pos = len(sample.args)
    mutated = sorted(spec.mutated_args)
    per_rank: list[list[Any]] = [list(by_pos) for _ in range(ranks)]
    global_args = list(by_pos)
    for i in positions:
        pieces, global_t = split(by_pos[i], ins[i], ranks, gen)
        global_args[i] = global_t
        for r in range(ranks):
            per_rank[r][i] = pieces[r]
    outs_per_rank = []
    for r in range(ranks):
        a = per_rank[r]
        try:
            with torch.no_grad():
                out = spec.overload(*a[:n_pos], **{k: a[names.index(k)] for k in sample.kwargs})
        except Exception:  # noqa: BLE001 - the kernel refuses these shards: not a strategy
            return None
        outs_per_rank.append(_out_list(out) + [a[i] for i in mutated])
    ref_args = [_as64(a) for a in global_args]
    expected = spec.reference(*ref_args[:n_pos], **{k: ref_args[names.index(k)] for k in sample.kwargs})
    expected_list = tensors(expected) + [ref_args[i] for i in mutated]
    atol, rtol = spec.tolerance(sharding_dtype(spec), sample)
    found = []
    n_out = len(expected_list) - len(mutated)
    for k, ref in enumerate(expected_list):
        pieces = [outs[k] for outs in outs_per_rank]
        # A written argument keeps its placement; an output may come out in any.
        options = [ins[mutated[k - n_out]]] if k >= n_out else _candidates(ref)
        for p in options:
            whole = assemble(pieces, p, ref)
            slack = _pieces_slack(pieces, rtol) if short(p) == "P" else 0.0
            if (
                whole is not None
                and whole.shape == ref.shape
                and compare(whole, ref.to(whole.dtype) if not whole.is_floating_point() else ref, atol + slack, rtol) is None
            ):
                found.append(p)
                break
        else:
            return None
    return tuple(found[:n_out])


def search_undeclared(spec: OpSpec, samples: Sequence[Sample], gen: torch.Generator) -> list[str]:
    """Input placements (one mesh dimension) that nobody declared but that give the reference on
    the first sample at 2 ranks and on the next sample at 2 and 4 ranks (where it fits)."""
    from torch.distributed.tensor import Replicate  # lazy: import time (torch.distributed.tensor, 0.75 s)

    names = [a.name for a in spec.schema.arguments]
    sample = samples[0]
    by_pos = sharding_strategies.by_position(spec, sample.args, dict(sample.kwargs))
    positions = [i for i, a in enumerate(by_pos) if isinstance(a, torch.Tensor)]
    options = [_candidates(by_pos[i]) for i in positions]
    mutated = set(spec.mutated_args)
    n = 1
    for o in options:
        n *= len(o)
    if n > _SEARCH_MAX:
        raise _TooMany(n)
    with simulated_mesh(2) as mesh:
        spec_args, spec_kwargs = _arg_specs(spec, sample, mesh)
        declared = {tuple(short(ins[i]) for i in positions) for _, ins in sharding_strategies.declared_rows(spec, spec_args, spec_kwargs)}
    found = []
    for combo in itertools.product(*options):
        ins = dict(zip(positions, combo, strict=True))
        key = tuple(short(p) for p in combo)
        if key in declared or all(isinstance(p, Replicate) for p in combo):
            continue
        if any(i in mutated and short(ins[i]) == "P" for i in positions):
            continue
        outs = _try_placements(spec, sample, by_pos, positions, ins, 2, gen)
        if outs is None or not _confirm(spec, samples[1:], positions, ins, gen):
            continue
        found.append(describe_strategy(spec, outs, [ins.get(i) for i in range(len(names))], positions))
    return found


def _confirm(spec: OpSpec, samples: Sequence[Sample], positions: Sequence[int], ins: dict[int, Any], gen: torch.Generator) -> bool:
    """The same placements on the other samples (same tensor arguments and ranks), at 2 and 4 ranks where they shard."""
    from torch.distributed.tensor import Shard  # lazy: import time (torch.distributed.tensor, 0.75 s)

    for sample in samples:
        by_pos = sharding_strategies.by_position(spec, sample.args, dict(sample.kwargs))
        if [i for i, a in enumerate(by_pos) if isinstance(a, torch.Tensor)] != list(positions):
            continue
        if any(isinstance(ins[i], Shard) and ins[i].dim >= by_pos[i].dim() for i in positions):
            return False
        for ranks in RANKS:
            if _try_placements(spec, sample, by_pos, positions, ins, ranks, gen) is None:
                return False
    return True
