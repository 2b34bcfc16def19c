"""Tensor parallelism of the Mamba layer: its d_inner channels split across the ranks of a mesh.

``parallelize_mamba(model, mesh)`` turns every ``Mamba`` layer of ``model`` into a
``TensorParallelMamba``: its parameters become DTensors on the mesh (so that optimizers,
``fully_shard`` and ``torch.distributed.checkpoint`` see the whole parameters under their
usual names), and its forward runs on the local shards:

* in_proj, column-wise: each rank computes its channels of x and of z (the weight's x rows and
  z rows are each split across the ranks: placement ``_StridedShard(0, split_factor=2)``);
* the causal conv and the scan on each rank's channels (A_log, D, conv1d, dt_proj.bias
  Shard(0)), with no communication;
* x_proj, row-wise over the channels: each rank's partial (dt, B, C) products are summed once
  (an all-reduce of (batch, seqlen, dt_rank + 2 d_state)), so dt, B and C are whole on every
  rank; in the backward their gradients, partial per rank, are summed the same way;
* dt_proj column-wise (Shard(0)); out_proj row-wise (Shard(1)): one all-reduce of
  (batch, seqlen, d_model) in the forward; out_proj.bias replicated.

The input hidden_states must be the same on every rank of the mesh (replicated); its gradient is
summed over the ranks (one all-reduce of (batch, seqlen, d_model) in the backward). Outputs and
returned states: the output is replicated; conv and ssm states hold this rank's channels,
(rows, d_inner / world, d_conv) and (rows, d_inner / world, d_state), and ``d_inner`` of a
parallelized layer is its local channel count. Decoding (``step``, ``allocate_inference_cache``,
``MambaLMHeadModel.generate``) works on those local states.

Parameters outside the Mamba layers (embedding, norms, LM head) stay plain tensors, replicated:
every rank of the mesh computes them alike from the same inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..modules.mamba_simple import Mamba


def _local(t: Tensor | None) -> Tensor | None:
    """This rank's shard of a DTensor parameter (differentiable), a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (the input feeds every
    rank's channels, each contributing its part of the gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Sum of the ranks' partial products forward; the gradient of a replicated result used
    alike on every rank passes through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _ReduceBoth(torch.autograd.Function):
    """Sum over the group forward and backward: a sum of partial products whose result each
    rank then uses for its own channels (x_proj's dt, B and C)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TensorParallelMamba(Mamba):
    """A ``Mamba`` layer whose channels are split across the ranks of ``tp_mesh`` (made by
    ``parallelize_mamba``; see the module docstring). Same forward, prefill, step and state
    API as ``Mamba``, with states holding this rank's channels."""

    tp_mesh: DeviceMesh
    d_inner_total: int

    @property
    def _group(self) -> dist.ProcessGroup:
        return self.tp_mesh.get_group()

    def _param(self, t: Tensor | None) -> Tensor | None:
        """This rank's shard of a parameter."""
        return _local(t)

    def _in_proj(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """(x, z), this rank's channels: (..., d_inner / world) each."""
        h = _CopyToParallel.apply(hidden_states, self._group)
        xz = F.linear(h, _local(self.in_proj.weight), _local(self.in_proj.bias))
        return xz.chunk(2, dim=-1)

    def _x_proj(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(dt, B, C), whole on every rank, from this rank's channels x (..., d_inner / world)."""
        x_dbl = _ReduceBoth.apply(F.linear(x, _local(self.x_proj.weight)), self._group)
        return x_dbl.split([self.dt_rank, self.d_state, self.d_state], dim=-1)

    def _out_proj(self, y: Tensor) -> Tensor:
        out = _ReduceFromParallel.apply(F.linear(y, _local(self.out_proj.weight)), self._group)
        bias = _local(self.out_proj.bias)
        return out if bias is None else out + bias

    def _fast_forward(self, hidden_states: Tensor) -> Tensor:
        # mamba_inner_fn reads whole parameters; the sharded layer runs the conv and the scan
        # as separate ops on its channels (the conv output is kept for the backward).
        return self._forward_with_states(hidden_states, None, None)[0]


def _x_and_z_rows(weight: Tensor, rank: int, world: int) -> Tensor:
    """in_proj's rows of this rank: its part of the x rows, then its part of the z rows."""
    x_rows, z_rows = weight.chunk(2, dim=0)
    return torch.cat([x_rows.chunk(world)[rank], z_rows.chunk(world)[rank]])


# Placement of each parameter of a Mamba layer on the tensor-parallel mesh dimension.
_PLACEMENTS = {
    "in_proj.weight": _StridedShard(0, split_factor=2),
    "in_proj.bias": _StridedShard(0, split_factor=2),
    "conv1d.weight": Shard(0),
    "conv1d.bias": Shard(0),
    "x_proj.weight": Shard(1),
    "dt_proj.weight": Shard(0),
    "dt_proj.bias": Shard(0),
    "A_log": Shard(0),
    "D": Shard(0),
    "out_proj.weight": Shard(1),
    "out_proj.bias": Replicate(),
}


def _distribute(param: Tensor, name: str, mesh: DeviceMesh) -> nn.Parameter:
    """The parameter as a DTensor on mesh, each rank keeping its shard (no communication: every
    rank holds the same whole parameter)."""
    placement = _PLACEMENTS[name]
    rank, world = mesh.get_local_rank(), mesh.size()
    data = param.detach()
    if isinstance(placement, _StridedShard):
        local = _x_and_z_rows(data, rank, world)
    elif isinstance(placement, Shard):
        local = data.chunk(world, dim=placement.dim)[rank]
    else:
        local = data
    dtensor = DTensor.from_local(
        local.contiguous(), mesh, [placement], run_check=False, shape=data.shape,
        stride=data.stride(),
    )  # fmt: skip
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    for attr in ("_no_weight_decay", "_no_reinit"):  # the layer's initialization markers
        if hasattr(param, attr):
            setattr(new, attr, getattr(param, attr))
    return new


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """``fully_shard(..., shard_placement_fn=fsdp_shard_placement)`` for models with
    tensor-parallel layers: FSDP2 shards in_proj's weight (and bias-free 2-D parameters placed
    like it) on dim 1 rather than 0, as its rows are already split in two interleaved halves
    (``_StridedShard``) that FSDP's own dim-0 sharding does not compose with; every other
    parameter keeps FSDP's default (None: dim 0)."""
    if isinstance(param, DTensor) and any(
        isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements
    ):
        if param.dim() < 2:
            raise ValueError(
                "fsdp_shard_placement: in_proj.bias of a tensor-parallel layer cannot be "
                "sharded by FSDP2 (its only dimension is split in interleaved halves); use "
                "Mamba(bias=False), mamba_ssm's default"
            )
        return Shard(1)
    return None


def _interleaved(model: nn.Module) -> dict[str, int]:
    """State-dict keys of in_proj's weight and bias in tensor-parallel layers -> the index of
    the tensor-parallel dimension in their mesh (FSDP2 puts its own dimension first)."""
    keys = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, TensorParallelMamba):
            continue
        tp_names = module.tp_mesh.mesh_dim_names or ()
        for name, param in module.in_proj.named_parameters():
            if not isinstance(param, DTensor):
                continue
            names = param.device_mesh.mesh_dim_names or ()
            found = tp_names and tp_names[0] in names
            index = names.index(tp_names[0]) if found else param.device_mesh.ndim - 1
            keys[f"{prefix}.in_proj.{name}" if prefix else f"in_proj.{name}"] = index
    return keys


def checkpoint_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` in a form torch.distributed.checkpoint stores: in_proj's weight
    of tensor-parallel layers, whose shards are two separate row blocks (DCP stores one block
    per shard), gathered over the tensor-parallel ranks (other mesh dimensions, FSDP's, keep
    their sharding). Save with ``dcp.save(checkpoint_state_dict(model), ...)``; load with
    ``load_checkpoint``."""
    state = model.state_dict()
    for key, tp_dim in _interleaved(model).items():
        value = state[key]
        placements = list(value.placements)
        placements[tp_dim] = Replicate()
        state[key] = value.redistribute(value.device_mesh, placements)
    return state


@torch.no_grad()
def load_checkpoint(model: nn.Module, checkpoint_id: str) -> None:
    """Load a checkpoint saved from ``checkpoint_state_dict`` (of a model parallelized the
    same way) into ``model``, a collective over every rank."""
    import torch.distributed.checkpoint as dcp

    state = checkpoint_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint_id)
    params = dict(model.named_parameters())
    for key, tp_dim in _interleaved(model).items():
        param, value = params[key], state.pop(key)
        mesh = param.device_mesh
        rows = _x_and_z_rows(value.to_local(), mesh.get_local_rank(tp_dim), mesh.size(tp_dim))
        param.to_local().copy_(rows)
    model.load_state_dict(state, strict=False)


def parallelize_mamba(
    model: nn.Module, mesh: DeviceMesh, mesh_dim: int | str | None = None
) -> nn.Module:
    """Split the channels of every ``Mamba`` layer of ``model`` (``model`` itself may be one)
    across the ranks of ``mesh`` (1-D, or its dimension ``mesh_dim``); returns ``model``,
    changed in place. Every rank must hold the same parameters (same seed or a loaded
    checkpoint) and feed the same inputs; see the module docstring for the layout."""
    if mesh_dim is not None:
        mesh = mesh[mesh_dim] if isinstance(mesh_dim, str) else mesh[mesh.mesh_dim_names[mesh_dim]]
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_mamba: the mesh must be 1-D, or name its tensor-parallel dimension "
            f"with mesh_dim; got a {mesh.ndim}-D mesh"
        )
    world = mesh.size()
    for module in model.modules():
        if not isinstance(module, Mamba) or isinstance(module, TensorParallelMamba):
            continue
        if module.d_inner % world:
            raise ValueError(
                f"parallelize_mamba: d_inner={module.d_inner} must be divisible by the mesh "
                f"size {world}"
            )
        for name, param in list(module.named_parameters()):
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            owner.register_parameter(name.rpartition(".")[2], _distribute(param, name, mesh))
        module.__class__ = TensorParallelMamba
        module.tp_mesh = mesh
        module.d_inner_total = module.d_inner
        module.d_inner = module.d_inner // world
    return model
