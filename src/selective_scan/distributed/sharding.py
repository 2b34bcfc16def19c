"""DTensor sharding rules of the ``selective_scan`` operators.

``register_sharding_rules()`` tells DTensor how each operator runs on sharded inputs, so that
``selective_scan_fn`` and ``selective_state_update`` accept DTensors. Every
rule runs the operator on each rank's local shards with no communication of its own; DTensor
redistributes inputs placed otherwise to the cheapest rule. Per mesh dimension:

* channels: u, delta, z, initial_state Shard(1); A, D, delta_bias Shard(0); B and C
  constant (dim, dstate) Shard(0), variable (batch, dstate, L) Replicate, grouped
  (batch, groups, dstate, L) Replicate with one group, Shard(1) (the groups) with several when
  the mesh size divides them. out, last_state and the checkpoints come back Shard(1). Backward:
  the gradients of replicated B and C are Partial (each shard holds its channels' sum).
* batch (not with cu_seqlens, whose batch is 1): u, delta, z, initial_state, variable and
  grouped B/C Shard(0); A, D, delta_bias, constant B/C Replicate; outputs Shard(0). Backward:
  dA, dD, ddelta_bias and constant dB/dC are Partial.
* everything replicated.

A sequence-sharded (Shard(2)) u, delta or z is rejected: gathering the sequence on every rank
would be silent and costly; ``context_parallel_scan`` splits a sequence across ranks.

``state_update`` writes into ``state``. DTensor runs an operator on redistributed copies of
its inputs, so a write into a redistributed state would be lost; the rules therefore only offer
shardings that keep ``state`` where it is (channels/heads, batch, or replicated, the same on
every mesh dimension), and reject any other state placement with a message saying so. For
other layouts, run ``selective_state_update`` on the local tensors (``DTensor.to_local()``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

_registered = False

# Placement lists: one entry per operator argument (None for non-tensor or absent arguments).
_R = Replicate()


def _spec_ndim(spec) -> int:
    return len(spec.tensor_meta.shape)


def _bc_channel(spec) -> tuple[object, object] | None:
    """(input placement, gradient placement) of B or C under channel sharding, or None when
    the form cannot be channel-sharded on this mesh (groups not divisible by its size)."""
    ndim = _spec_ndim(spec)
    if ndim == 2:
        return Shard(0), Shard(0)
    if ndim == 3:
        return _R, Partial()
    groups = spec.tensor_meta.shape[1]
    if groups == 1:
        return _R, Partial()
    if groups % spec.mesh.size() == 0:
        return Shard(1), Shard(1)
    return None


def _bc_batch(spec) -> tuple[object, object]:
    """(input placement, gradient placement) of B or C under batch sharding."""
    if _spec_ndim(spec) == 2:
        return _R, Partial()
    return Shard(0), Shard(0)


def _reject_sequence_sharding(op: str, **specs) -> None:
    for name, spec in specs.items():
        if spec is not None and any(isinstance(p, Shard) and p.dim == 2 for p in spec.placements):
            raise ValueError(
                f"selective_scan: {op} got {name} sharded along the sequence "
                f"({spec.placements}); the scan runs on channel- or batch-sharded inputs. "
                "Redistribute it, or split the sequence with "
                "selective_scan.distributed.context_parallel_scan"
            )


def _opt(spec, placement):
    """placement for a given optional argument, None for an absent one."""
    return None if spec is None else placement


def _fwd_rules(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, softplus):
    _reject_sequence_sharding("scan_fwd", u=u, delta=delta, z=z)
    rules = []
    b_ch, c_ch = _bc_channel(B), _bc_channel(C)
    if b_ch is not None and c_ch is not None:
        s1, s0 = Shard(1), Shard(0)
        rules.append((
            [s1, s1, s1],
            [s1, s1, s0, b_ch[0], c_ch[0], _opt(D, s0), _opt(z, s1), _opt(delta_bias, s0),
             _opt(initial_state, s1), _opt(cu_seqlens, _R), None],
        ))  # fmt: skip
    if cu_seqlens is None:
        s0 = Shard(0)
        rules.append((
            [s0, s0, s0],
            [s0, s0, _R, _bc_batch(B)[0], _bc_batch(C)[0], _opt(D, _R), _opt(z, s0),
             _opt(delta_bias, _R), _opt(initial_state, s0), None, None],
        ))  # fmt: skip
    args = (u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    rules.append(([_R, _R, _R], [_opt(t, _R) for t in args] + [None]))
    return rules


def _grad(spec, placement):
    """Gradient placement of an input: Replicate for an absent one (an empty tensor)."""
    return _R if spec is None else placement


def _bwd_rules(
    dout, dlast_state, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens,
    checkpoints, softplus,
):  # fmt: skip
    _reject_sequence_sharding("scan_bwd", dout=dout, u=u, delta=delta, z=z)
    rules = []
    b_ch, c_ch = _bc_channel(B), _bc_channel(C)
    if b_ch is not None and c_ch is not None:
        s1, s0 = Shard(1), Shard(0)
        grads = [s1, s1, s0, b_ch[1], c_ch[1], _grad(D, s0), _grad(z, s1),
                 _grad(delta_bias, s0), _grad(initial_state, s1)]  # fmt: skip
        inputs = [s1, _opt(dlast_state, s1), s1, s1, s0, b_ch[0], c_ch[0], _opt(D, s0),
                  _opt(z, s1), _opt(delta_bias, s0), _opt(initial_state, s1),
                  _opt(cu_seqlens, _R), s1, None]  # fmt: skip
        rules.append((grads, inputs))
    if cu_seqlens is None:
        s0, p = Shard(0), Partial()
        b_b, c_b = _bc_batch(B), _bc_batch(C)
        grads = [s0, s0, p, b_b[1], c_b[1], _grad(D, p), _grad(z, s0), _grad(delta_bias, p),
                 _grad(initial_state, s0)]  # fmt: skip
        inputs = [s0, _opt(dlast_state, s0), s0, s0, _R, b_b[0], c_b[0], _opt(D, _R),
                  _opt(z, s0), _opt(delta_bias, _R), _opt(initial_state, s0), None, s0,
                  None]  # fmt: skip
        rules.append((grads, inputs))
    tensors = (dout, dlast_state, u, delta, A, B, C, D, z, delta_bias, initial_state,
               cu_seqlens, checkpoints)  # fmt: skip
    rules.append(([_R] * 9, [_opt(t, _R) for t in tensors] + [None]))
    return rules


def _state_update_rules(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices=None):
    """Channel (plain form) or head (heads form) sharding, batch sharding, or replicated; only
    the rule that leaves ``state`` in its current placement is offered (see the module doc)."""
    heads = _spec_ndim(state) == 4
    s1, s0 = Shard(1), Shard(0)

    def bc_channel(spec):
        # (batch, dstate) or one group: replicated; several groups are sharded with the heads
        # when the mesh size divides them.
        groups = 1 if _spec_ndim(spec) == 2 else spec.tensor_meta.shape[1]
        if groups == 1:
            return _R
        return s1 if groups % spec.mesh.size() == 0 else None

    # Channel/head sharding needs every argument in the state's form: an argument in the other
    # form lacks the axis to shard (mamba_ssm allows it where that axis has size 1).
    ranks = (3, 3, 3, 3, 2, 2) if heads else (2, 2, 2, 2, 1, 1)
    same_form = all(
        t is None or _spec_ndim(t) == want
        for t, want in zip((x, dt, z, A, D, dt_bias), ranks, strict=True)
    )
    rules = {}
    b_ch, c_ch = bc_channel(B), bc_channel(C)
    if b_ch is not None and c_ch is not None and same_form:
        rules[s1] = (
            [s1],
            [s1, s1, s1, s0, b_ch, c_ch, _opt(D, s0), _opt(z, s1), _opt(dt_bias, s0), None,
             _opt(indices, _R)],
        )  # fmt: skip
    if indices is None:  # with indices, the state's rows are slots, not batch rows
        rules[s0] = (
            [s0],
            [s0, s0, s0, _R, s0, s0, _opt(D, _R), _opt(z, s0), _opt(dt_bias, _R), None, None],
        )
    rules[_R] = (
        [_R],
        [_opt(t, _R) for t in (state, x, dt, A, B, C, D, z, dt_bias)] + [None, _opt(indices, _R)],
    )
    placements = set(state.placements)
    placement = next(iter(placements))
    if len(placements) != 1 or placement not in rules:
        raise ValueError(
            "selective_scan: selective_state_update on DTensors writes into state, so state "
            "must already be placed as the step runs: the same placement on every mesh "
            f"dimension, one of {list(rules)}; got {state.placements}. Redistribute state "
            "first (and keep the result), or call it on DTensor.to_local() tensors"
        )
    return [rules[placement]]


def register_sharding_rules() -> None:
    """Register the rules of every ``selective_scan`` operator with DTensor (idempotent)."""
    global _registered
    if _registered:
        return
    from .. import ops, state_update  # defines the operators

    lib = torch.ops.selective_scan
    fwd_ops, bwd_ops, update_ops = (
        [lib.scan_fwd.default],
        [lib.scan_bwd.default],
        [lib.state_update.default],
    )
    if ops.HAS_TRITON:
        fwd_ops.append(lib.scan_fwd_triton.default)
        bwd_ops.append(lib.scan_bwd_triton.default)
    if state_update.state_update_triton is not None:
        update_ops.append(lib.state_update_triton.default)
    register_sharding(fwd_ops)(_fwd_rules)
    register_sharding(bwd_ops)(_bwd_rules)
    register_sharding(update_ops)(_state_update_rules)
    _registered = True
