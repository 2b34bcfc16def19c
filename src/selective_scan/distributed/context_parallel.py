"""Context parallelism of the selective scan: one sequence split along its length across ranks.

Rank r of the group holds piece r of the sequence (pieces in rank order, any lengths). The
state entering piece r is an affine function of the state entering piece r - 1:

    h_in[r + 1] = a[r] * h_in[r] + s[r],   a[r] = exp(A * sum of delta over piece r),

where s[r] is the state piece r ends in when it starts from zero. So each rank

1. scans its piece from zero (``selective_scan_fn(..., return_last_state=True)``, without D and
   z, which do not touch the state) for s[r], and computes its decays a[r];
2. all-gathers (s, a): 2 * world tensors of (rows, dim, dstate), rows being the batch or the
   packed sequences;
3. combines them in rank order into its entering state h_in[r] (and the final state);
4. scans its piece again from h_in[r] (``initial_state=``) for its output.

Autograd runs this backward: step 4's backward gives the gradient of h_in[r]; the combine's
backward turns every rank's into gradients of the (s, a) of each rank, summed over the group in
one all-reduce of the same size as the forward's all-gather; step 1's backward receives its
share as the gradient of its last_state. Only states and decays cross ranks, never activations.

Packed sequences (``cu_seqlens`` over the whole sequence, batch 1): each rank scans the parts of
the sequences that fall in its piece (empty parts included, whose decay is 1 and whose end
state is their entering state), so a sequence spanning several pieces carries its state across
them, and one starting inside a piece starts from its own initial state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..interface import selective_scan_fn

Group = dist.ProcessGroup | DeviceMesh | None


def process_group(group: Group, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
    """The process group of ``group``: a ProcessGroup, a DeviceMesh (one dimension, or the
    dimension ``mesh_dim`` of it), or None for the default group."""
    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(
                f"selective_scan.distributed: a {group.ndim}-D mesh needs mesh_dim to say which "
                "of its dimensions splits the sequence"
            )
        return group.get_group(mesh_dim if mesh_dim is not None else 0)
    if mesh_dim is not None:
        raise ValueError("selective_scan.distributed: mesh_dim applies to a DeviceMesh only")
    return group if group is not None else dist.group.WORLD


class _StateExchange(torch.autograd.Function):
    """(s, a, h0) of this rank -> (h_in of this rank, the final state), combining every rank's
    (s, a) in rank order from h0; see the module docstring."""

    @staticmethod
    def forward(ctx, s: Tensor, a: Tensor, h0: Tensor, group: dist.ProcessGroup):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = torch.stack([s, a]).contiguous()
        pieces = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(pieces, mine, group=group)
        states = [h0]  # states[k]: the state entering piece k; states[world]: the final state
        for s_k, a_k in pieces:
            states.append(a_k * states[-1] + s_k)
        ctx.group, ctx.rank = group, rank
        ctx.save_for_backward(*(p[1] for p in pieces), *states[:-1])
        return states[rank].clone(), states[-1]

    @staticmethod
    def backward(ctx, grad_in: Tensor, grad_last: Tensor):
        group, rank = ctx.group, ctx.rank
        saved = ctx.saved_tensors
        world = len(saved) // 2
        decays, states = saved[:world], saved[world:]
        # Reverse of the combine for this rank's share of the loss: lam is the gradient of the
        # state entering piece k + 1; (ds_k, da_k) = (lam, lam * h_k), then lam <- a_k * lam.
        grads = grad_in.new_empty((world, 2, *grad_in.shape))
        lam = grad_last
        for k in range(world - 1, -1, -1):
            grads[k, 0] = lam
            grads[k, 1] = lam * states[k]
            lam = decays[k] * lam
            if k == rank:
                lam = lam + grad_in
        # Every rank's gradients of the (s, a) of rank k are summed on rank k.
        dist.all_reduce(grads, group=group)
        return grads[rank, 0], grads[rank, 1], lam, None


def _piece_offsets(seqlen: int, device: torch.device, group: dist.ProcessGroup) -> int:
    """Where this rank's piece starts in the whole sequence (an all-gather of the lengths)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([seqlen], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(lengths, mine, group=group)
    return int(sum(int(n) for n in lengths[:rank]))


def _piece_decays(
    delta: Tensor, A: Tensor, delta_bias: Tensor | None, softplus: bool, cu: Tensor | None
) -> Tensor:
    """exp(A * the sum of delta over each row's part of the piece): (rows, dim, dstate), rows
    being the batch, or the packed sequences (cu: their boundaries within the piece)."""
    cdt = torch.float64 if torch.float64 in (delta.dtype, A.dtype) else torch.float32
    dt = delta.to(cdt)
    if delta_bias is not None:
        dt = dt + delta_bias.to(cdt)[:, None]
    if softplus:
        dt = F.softplus(dt)  # threshold 20, as in the scan
    if cu is None:
        total = dt.sum(-1)  # (batch, dim)
    else:
        # Sum per sequence with index_add (no cumsum differences: exact for long pieces).
        positions = torch.arange(dt.shape[-1], device=dt.device)
        seq = torch.bucketize(positions, cu.long(), right=True) - 1
        total = dt.new_zeros((cu.shape[0] - 1, dt.shape[1])).index_add(0, seq, dt[0].T)
    return torch.exp(A.to(cdt) * total[..., None])


def context_parallel_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    group: Group = None,
    mesh_dim: int | str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``selective_scan_fn`` of a sequence split along its length across the ranks of
    ``group`` (a ProcessGroup, a DeviceMesh with ``mesh_dim``, or None for the default group).

    This rank's piece: u, delta, z (batch, dim, L_r); B, C variable (batch, dstate, L_r) or
    grouped (batch, groups, dstate, L_r), or constant (dim, dstate), the same on every rank.
    Pieces follow the group's rank order and may differ in length. A (dim, dstate), D and
    delta_bias (dim,), initial_state (rows, dim, dstate), the state entering the whole
    sequence, and cu_seqlens (num_seqs + 1,), boundaries of packed sequences over the whole
    sequence (batch 1), are the same on every rank.

    Returns this rank's piece of out (batch, dim, L_r) and, with return_last_state, the state
    the whole sequence ends in (rows, dim, dstate), the same on every rank.

    Gradients: those of the pieces are this rank's pieces of the whole gradient; those of the
    inputs every rank holds (A, D, delta_bias, constant B/C, initial_state) are this rank's
    share, to be summed over the group (as data parallelism sums parameter gradients). A
    returned last_state is a replicated value: the gradient reaching the inputs is the sum of
    what each rank's loss puts on it (use it in one rank's loss for the plain gradient). Every
    rank must run the backward (it holds one collective).
    """
    pg = process_group(group, mesh_dim)
    if dist.get_world_size(pg) == 1:
        return selective_scan_fn(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
            initial_state, cu_seqlens,
        )  # fmt: skip
    local_cu = None
    if cu_seqlens is not None:
        offset = _piece_offsets(u.shape[-1], u.device, pg)
        local_cu = (cu_seqlens - offset).clamp(0, u.shape[-1]).to(cu_seqlens.dtype)
    _, s = selective_scan_fn(
        u, delta, A, B, C, None, None, delta_bias, delta_softplus, True, None, local_cu
    )
    a = _piece_decays(delta, A, delta_bias, delta_softplus, local_cu).to(s.dtype)
    h0 = torch.zeros_like(s) if initial_state is None else initial_state.to(s.dtype)
    h_in, last = _StateExchange.apply(s, a, h0, pg)
    out = selective_scan_fn(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, False, h_in, local_cu
    )
    return (out, last) if return_last_state else out
