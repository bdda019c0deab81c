"""W4A8 quantisation for ``opforge::qqq_gemm`` (the QQQ method: 4-bit weights,
8-bit per-token activations, integer tensor-core arithmetic).

The packed layout and the schemes are described in
``csrc/ops/qqq_gemm/LAYOUT.md``; in short:

* ``quantize_act_int8(x)``: per-token int8, ``x ~= a * s_tok[:, None]``;
* ``quantize_weight_w4(w, group_size)``: ``w [K, N]`` to int4 ``q`` packed for the
  kernel, ``w ~= s_ch[None, :] * s_group[k // group_size, :] * q`` (``s_group``
  an int8 in [1, 16], absent per channel);
* ``dequantize_weight_w4(...)``: that product, the exact inverse of the packing.

Everything here is plain PyTorch on whatever device the tensors are on.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: Rows and columns of one packed unit (512 bytes): K and N must be multiples of it.
UNIT = 32
#: Largest K whose int32 accumulation cannot overflow: |a * q * s| <= 2^14 per product.
MAX_K = (2**31 - 1) // 2**14 // UNIT * UNIT
#: Integer group scales lie in [1, GROUP_SCALE_MAX]: q * s must fit an int8 for q in [-8, 7].
GROUP_SCALE_MAX = 16
Q_MIN, Q_MAX = -8, 7


class QuantizedWeight(NamedTuple):
    """What ``quantize_weight_w4`` returns: the kernel's arguments."""

    w_packed: torch.Tensor  # int32 [K // 8, N], tiled as LAYOUT.md says
    s_ch: torch.Tensor  # float32 [N]
    s_group: torch.Tensor | None  # int8 [K // group_size, N] in [1, 16], or None per channel
    group_size: int  # -1 per channel


def _check_sizes(where: str, K: int, N: int, group_size: int) -> None:
    if K % UNIT or N % UNIT:
        raise ValueError(f"{where}: K and N must be multiples of {UNIT} (the packed unit), got K = {K}, N = {N}")
    if K > MAX_K:
        raise ValueError(f"{where}: K must be at most {MAX_K} so that the int32 accumulator cannot overflow, got {K}")
    if group_size != -1 and (group_size <= 0 or group_size % UNIT or K % group_size):
        raise ValueError(f"{where}: group_size must be -1 or a positive multiple of {UNIT} that divides K = {K}, got {group_size}")


# --- packing: q [K, N] int4 values <-> w_packed [K // 8, N] int32 ---


def _unit_view(K: int, N: int) -> tuple[int, ...]:
    # k = kb*32 + h*16 + t*4 + i, n = nb*32 + g*4 + j
    return (K // 32, 2, 4, 4, N // 32, 8, 4)


# Axes of _unit_view reordered to the storage order (nb, kb, g, t, j, i, h):
# word ((nb*KB + kb)*32 + g*4 + t)*4 + j, nibble 2*i + h.
_TO_STORAGE = (4, 0, 5, 2, 6, 3, 1)
_FROM_STORAGE = tuple(_TO_STORAGE.index(d) for d in range(7))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``q [K, N]`` (any integer dtype, each in [-8, 7]) -> ``w_packed [K // 8, N]`` int32."""
    if q.dim() != 2 or q.is_floating_point() or q.is_complex():
        raise ValueError(f"pack_int4: q must be a 2-D integer tensor [K, N], got {q.dtype} of shape {list(q.shape)}")
    K, N = q.shape
    _check_sizes("pack_int4", K, N, -1)
    if q.numel() and (int(q.min()) < Q_MIN or int(q.max()) > Q_MAX):
        raise ValueError(f"pack_int4: values must lie in [{Q_MIN}, {Q_MAX}], got [{int(q.min())}, {int(q.max())}]")
    nib = (q.to(torch.int64) & 0xF).reshape(_unit_view(K, N)).permute(_TO_STORAGE)  # (nb, kb, g, t, j, i, h)
    nib = nib.reshape(N // 32, K // 32, 8, 4, 4, 8)  # last axis: nibble p = 2*i + h
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (nib << shifts).sum(-1)  # disjoint bits: the sum is the OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).reshape(K // 8, N)


def unpack_int4(w_packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: ``w_packed [K // 8, N]`` int32 -> ``q [K, N]`` int8 in [-8, 7]."""
    if w_packed.dim() != 2 or w_packed.dtype != torch.int32:
        raise ValueError(
            f"unpack_int4: w_packed must be a 2-D int32 tensor [K // 8, N], got {w_packed.dtype}, shape {list(w_packed.shape)}"
        )
    K, N = 8 * w_packed.shape[0], w_packed.shape[1]
    _check_sizes("unpack_int4", K, N, -1)
    words = w_packed.contiguous().reshape(N // 32, K // 32, 8, 4, 4, 1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=w_packed.device, dtype=torch.int64)
    nib = (words >> shifts) & 0xF  # (nb, kb, g, t, j, p)
    q = torch.where(nib >= 8, nib - 16, nib).reshape(N // 32, K // 32, 8, 4, 4, 4, 2)  # p -> (i, h)
    return q.permute(_FROM_STORAGE).reshape(K, N).to(torch.int8)


def stripe_view(w_packed: torch.Tensor) -> torch.Tensor:
    """``w_packed [K // 8, N]`` viewed as ``[N // 32, K // 32, 128]``: the same memory (no copy),
    by stripes of 32 output columns, each a run of units of 32 k (128 words). Both are
    dimensions of their own here, so that tensor parallelism shards the packed weight as it
    is: ``Shard(0)`` gives each rank whole stripes (columns, column-parallel), ``Shard(1)``
    whole units of K (row-parallel). ``qqq_gemm`` takes either view."""
    if w_packed.dim() != 2 or w_packed.dtype != torch.int32 or not w_packed.is_contiguous():
        raise ValueError(
            f"stripe_view: w_packed must be a contiguous 2-D int32 tensor [K // 8, N], got {w_packed.dtype} of shape "
            f"{list(w_packed.shape)}{'' if w_packed.is_contiguous() else ', not contiguous'}"
        )
    K, N = 8 * w_packed.shape[0], w_packed.shape[1]
    _check_sizes("stripe_view", K, N, -1)
    return w_packed.view(N // UNIT, K // UNIT, 4 * UNIT)


def packed_view(w: torch.Tensor) -> torch.Tensor:
    """The inverse of ``stripe_view``: ``[N // 32, K // 32, 128]`` -> ``[K // 8, N]`` (a view);
    a 2-D ``w_packed`` is returned as it is."""
    if w.dim() == 2:
        return w
    if w.dim() != 3 or w.shape[2] != 4 * UNIT:
        raise ValueError(f"packed_view: w must be [N // 32, K // 32, 128] (stripe_view), got shape {list(w.shape)}")
    return w.reshape(w.shape[1] * UNIT // 8, w.shape[0] * UNIT)


# --- weights ---


def quantize_weight_w4(w: torch.Tensor, group_size: int = -1) -> QuantizedWeight:
    """Symmetric int4 quantisation of a float weight ``w [K, N]`` (in_features x
    out_features, i.e. ``linear.weight.t()``), packed for the kernel.

    ``group_size=-1``: one float32 scale per output channel, ``max |w[:, n]| / 7``.
    ``group_size=128`` (or any multiple of 32 dividing K): QQQ's two-level scheme,
    a float32 per-channel scale and an int8 scale in [1, 16] per group of rows,
    so that the kernel dequantises to int8 (``q * s_group``) and accumulates in
    int32 over all of K.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_w4: w must be a 2-D floating tensor [K, N], got {w.dtype} of shape {list(w.shape)}")
    K, N = w.shape
    _check_sizes("quantize_weight_w4", K, N, group_size)
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().amax(dim=0) if K else torch.zeros(N, device=w.device)
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_weight_w4: w has NaN or Inf entries")
    if group_size == -1:
        s_ch = torch.where(amax > 0, amax / Q_MAX, torch.ones_like(amax))
        q = torch.round(w32 / s_ch).clamp_(Q_MIN, Q_MAX)
        return QuantizedWeight(pack_int4(q.to(torch.int8)), s_ch, None, -1)
    s_ch = torch.where(amax > 0, amax / (Q_MAX * GROUP_SCALE_MAX), torch.ones_like(amax))
    groups = w32.reshape(K // group_size, group_size, N)
    g_amax = groups.abs().amax(dim=1)  # [G, N]
    s_group = torch.ceil(g_amax / (Q_MAX * s_ch)).clamp_(1, GROUP_SCALE_MAX)
    step = (s_ch * s_group).unsqueeze(1)  # [G, 1, N]
    q = torch.round(groups / step).clamp_(Q_MIN, Q_MAX).reshape(K, N)
    return QuantizedWeight(pack_int4(q.to(torch.int8)), s_ch, s_group.to(torch.int8), group_size)


def dequantize_weight_w4(
    w_packed: torch.Tensor,
    s_ch: torch.Tensor,
    s_group: torch.Tensor | None = None,
    group_size: int = -1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``s_ch[n] * s_group[k // group_size, n] * q[k, n]`` as a ``[K, N]`` tensor
    of ``dtype`` (default: ``s_ch``'s dtype), computed in that dtype."""
    q = unpack_int4(w_packed)
    K, N = q.shape
    dtype = dtype or s_ch.dtype
    scale = s_ch.to(dtype).reshape(1, N)
    if s_group is None:
        if group_size != -1:
            raise ValueError(f"dequantize_weight_w4: group_size = {group_size} needs s_group")
        return q.to(dtype) * scale
    _check_sizes("dequantize_weight_w4", K, N, group_size)
    if group_size == -1 or tuple(s_group.shape) != (K // group_size, N):
        raise ValueError(
            f"dequantize_weight_w4: s_group must have shape [K // group_size, N] = [{K // max(group_size, 1)}, {N}] with group_size > 0, "
            f"got {list(s_group.shape)} and group_size {group_size}"
        )
    qs = q.to(torch.int32) * s_group.to(torch.int32).repeat_interleave(group_size, dim=0)
    return qs.to(dtype) * scale


# --- activations ---


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: ``x [..., K]`` -> ``(a [M, K] int8, s_tok [M] float32)``
    with M the product of the leading dimensions and ``x ~= a * s_tok[:, None]``.
    A row of zeros gets scale 1.

    A row holding a NaN or an infinity gets scale NaN and zeros in ``a``, so
    that every output of that row of ``qqq_gemm`` is NaN, as a float layer's
    output is non-finite there: the non-finite input is not quantised away into
    finite numbers."""
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"quantize_act_int8: x must be a floating tensor [..., K], got {x.dtype} of shape {list(x.shape)}")
    x2 = x.detach().reshape(math.prod(x.shape[:-1]), x.shape[-1]).to(torch.float32)
    finite = torch.isfinite(x2).all(dim=1)
    x2 = torch.where(finite.unsqueeze(1), x2, torch.zeros_like(x2))
    amax = x2.abs().amax(dim=1) if x2.shape[1] else torch.zeros(x2.shape[0], device=x.device)
    s_tok = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    a = torch.round(x2 / s_tok.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return a, torch.where(finite, s_tok, torch.full_like(s_tok, math.nan))


__all__ = [
    "GROUP_SCALE_MAX",
    "MAX_K",
    "UNIT",
    "QuantizedWeight",
    "dequantize_weight_w4",
    "pack_int4",
    "packed_view",
    "quantize_act_int8",
    "quantize_weight_w4",
    "stripe_view",
    "unpack_int4",
]
