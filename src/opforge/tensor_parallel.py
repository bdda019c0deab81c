"""Tensor parallelism for opforge's layers: ``ColwiseParallel`` and ``RowwiseParallel``, torch's
own styles (``torch.distributed.tensor.parallel``) that also take ``opforge.nn.QQQLinear``.

Use them in ``parallelize_module``'s plan where torch's would go; an ``nn.Linear`` or
``nn.Embedding`` is sharded exactly as torch's styles shard it::

    from torch.distributed.tensor.parallel import parallelize_module
    from opforge.tensor_parallel import ColwiseParallel, RowwiseParallel

    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

A ``QQQLinear`` is sharded as serving engines shard their quantised linears, on the stripe view
of its packed weight (``opforge.quant.stripe_view``, the same memory: LAYOUT.md):

* column-parallel: whole stripes of 32 output columns per rank (``Shard(0)`` of the view), with
  their per-channel scales, group scales and bias; input replicated, output sharded on its last
  dimension; bit for bit the one-device layer's columns;
* row-parallel: whole units of 32 input features per rank (``Shard(1)``) and their group scales;
  input sharded on its last dimension. The int8 activations are quantised with per-token scales
  over the whole row (DTensor reduces the maximum across the ranks: one small all-reduce), so each
  rank's activations are exactly its slice of the one-device ones, and the ranks' products are
  float32 partial sums, reduced in float32 and rounded once to the layer's dtype, then the bias
  added, as on one device: the one-device result but for the float32 rounding of the partial sums
  (where it falls on the other side of a float16 rounding, an ulp of the product apart).
  Scales per rank (each over its own share of the row) would save that all-reduce and give another
  quantisation than the layer that was validated on one device.

The sizes must split evenly: out_features / 32 stripes (column), in_features / 32 units and the
groups of group_size (row) divisible by the mesh's size; anything else is refused, naming the layer.

Importing this module imports DTensor (a second or more); ``import opforge`` does not.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor import parallel as _tp

from opforge.nn import QQQLinear
from opforge.quant import UNIT, stripe_view

__all__ = ["ColwiseParallel", "RowwiseParallel"]


def _shard(module: QQQLinear, name: str, mesh: DeviceMesh, placement: Any, src_data_rank: int | None) -> None:
    t = getattr(module, name)
    if t is not None:
        setattr(module, name, distribute_tensor(t, mesh, [placement], src_data_rank=src_data_rank))


def _distribute_qqq(style: Any, module: QQQLinear, mesh: DeviceMesh) -> nn.Module:
    """``module`` distributed by ``style`` (either style below): its ``_partition_qqq`` on the
    parameters, torch's own input and output preparation around the forward."""
    return distribute_module(
        module,
        mesh,
        style._partition_qqq,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class ColwiseParallel(_tp.ColwiseParallel):
    """torch's ``ColwiseParallel``; for a ``QQQLinear``, its packed weight's stripes (output
    columns), per-channel scales, group scales' columns and bias sharded across the mesh."""

    def _partition_qqq(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, QQQLinear):
            return
        stripes = module.out_features // UNIT
        if stripes % mesh.size():
            raise ValueError(
                f"QQQLinear{f' {name}' if name else ''}: column-parallel over {mesh.size()} ranks needs out_features / 32 "
                f"divisible by {mesh.size()} (whole stripes of 32 columns per rank), got out_features = {module.out_features}"
            )
        module.w_packed = distribute_tensor(stripe_view(module.w_packed), mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        _shard(module, "s_ch", mesh, Shard(0), self.src_data_rank)
        _shard(module, "s_group", mesh, Shard(1), self.src_data_rank)
        _shard(module, "bias", mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, QQQLinear):
            return super()._apply(module, device_mesh)
        return _distribute_qqq(self, module, device_mesh)


class RowwiseParallel(_tp.RowwiseParallel):
    """torch's ``RowwiseParallel``; for a ``QQQLinear``, its packed weight's units of K (input
    features) and group scales' rows sharded across the mesh, per-channel scales and bias
    replicated; the input sharded on its last dimension."""

    def _partition_qqq(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, QQQLinear):
            return
        ranks = mesh.size()
        units = module.in_features // UNIT
        groups = module.in_features // module.group_size if module.group_size > 0 else ranks
        if units % ranks or groups % ranks:
            what = "in_features / 32" if units % ranks else f"in_features / group_size ({module.group_size})"
            raise ValueError(
                f"QQQLinear{f' {name}' if name else ''}: row-parallel over {ranks} ranks needs {what} divisible by {ranks} "
                f"(whole units of 32 input features and whole groups per rank), got in_features = {module.in_features}"
            )
        module.w_packed = distribute_tensor(stripe_view(module.w_packed), mesh, [Shard(1)], src_data_rank=self.src_data_rank)
        _shard(module, "s_ch", mesh, Replicate(), self.src_data_rank)
        _shard(module, "s_group", mesh, Shard(0), self.src_data_rank)
        _shard(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, QQQLinear):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_qqq(self, module, device_mesh)
