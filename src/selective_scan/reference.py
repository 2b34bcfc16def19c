"""The plain-PyTorch selective scan: a readable sequential loop, used as the oracle in tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import (
    check_cu_seqlens_values,
    check_flag,
    check_scan_inputs,
    compute_dtype,
    state_dtype,
)
from .scan_args import ScanArgs


def expand_bc(t: Tensor, batch: int, dim: int, seqlen: int) -> Tensor:
    """B or C in any accepted form -> (batch, dim, dstate, seqlen), broadcast without copying."""
    if t.dim() == 2:  # constant (dim, dstate)
        return t[None, :, :, None].expand(batch, dim, t.shape[1], seqlen)
    if t.dim() == 3:  # variable (batch, dstate, seqlen)
        t = t.unsqueeze(1)
    groups = t.shape[
        1
    ]  # grouped (batch, groups, dstate, seqlen): channel c uses group c // (dim // groups)
    return t.repeat_interleave(dim // groups, dim=1)


def as_state_values(t: Tensor, sdt: torch.dtype) -> Tensor:
    """B or C in the states' dtype: complex states (complex A) take a constant complex one as it
    is and a variable one, real with real and imaginary parts interleaved along time (mamba_ssm's
    convention), as complex values (..., seqlen)."""
    if not sdt.is_complex or t.dim() == 2:
        return t.to(sdt)
    real = torch.float64 if sdt == torch.complex128 else torch.float32
    return torch.view_as_complex(t.to(real).unflatten(-1, (-1, 2)).contiguous())


def _scan_one(u, delta, A, B, C, h):
    """Sequential recurrence; u, delta: (batch, dim, L); B, C: (batch, dim, dstate, L); A, B, C
    and h real or complex. Returns y = sum_n C h (complex for complex states) and the last h."""
    decay = torch.exp(delta.unsqueeze(-1) * A[:, None, :])  # (batch, dim, L, dstate)
    inputs = (delta * u).unsqueeze(-1) * B.transpose(-1, -2)
    ys = [h.new_zeros((*u.shape[:2], 0))]  # keeps torch.cat valid for empty sequences
    # unbind rather than indexing step t: autograd then stacks the per-step gradients once,
    # where indexing scatters each into a zero tensor of the full size (O(seqlen^2) backward).
    for a_t, x_t, c_t in zip(decay.unbind(2), inputs.unbind(2), C.unbind(-1), strict=True):
        h = a_t * h + x_t
        ys.append((h * c_t).sum(-1, keepdim=True))
    return torch.cat(ys, dim=-1), h


def selective_scan_ref(
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
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference selective scan, same signature and semantics as :func:`selective_scan_fn`.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate),
    (batch, dstate, seqlen) or (batch, groups, dstate, seqlen); D, delta_bias: (dim,);
    initial_state: (batch, dim, dstate), or (num_seqs, dim, dstate) with packed sequences
    delimited by cu_seqlens (num_seqs + 1,).

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t;  y_t = sum_n C_t h_t + D u_t;
    out = y * silu(z). Computes in float32 (float64 if any input is float64) and returns out in
    u's dtype, plus last_state (batch or num_seqs, dim, dstate) when return_last_state.
    Differentiable by autograd through every input.

    Complex A (mamba_ssm's convention): complex states; constant B/C complex (dim, dstate),
    variable B/C real with real and imaginary parts interleaved along time, (batch, [groups,]
    dstate, 2 * seqlen); y_t = 2 Re(sum_n C_t h_t) + D u_t; last_state (and initial_state)
    complex.
    """
    args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    check_scan_inputs(args)
    check_flag("selective_scan_ref", "delta_softplus", delta_softplus)
    check_flag("selective_scan_ref", "return_last_state", return_last_state)
    cdt = compute_dtype(*args.floats)
    sdt = state_dtype(A, cdt)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    uc, dt = u.to(cdt), delta.to(cdt)
    if delta_bias is not None:
        dt = dt + delta_bias.to(cdt)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)  # threshold 20, as in the CUDA kernel
    Bx = expand_bc(as_state_values(B, sdt), batch, dim, seqlen)
    Cx = expand_bc(as_state_values(C, sdt), batch, dim, seqlen)
    A = A.to(sdt)
    zeros = uc.new_zeros((batch, dim, dstate), dtype=sdt)

    if cu_seqlens is None:
        h0 = zeros if initial_state is None else initial_state.to(sdt)
        y, last = _scan_one(uc, dt, A, Bx, Cx, h0)
    else:
        bounds = check_cu_seqlens_values(cu_seqlens, seqlen)
        ys, lasts = [], []
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            h0 = zeros[:1] if initial_state is None else initial_state[i : i + 1]
            piece = slice(start, end)
            y_i, h_i = _scan_one(
                uc[..., piece], dt[..., piece], A, Bx[..., piece], Cx[..., piece], h0.to(sdt)
            )
            ys.append(y_i)
            lasts.append(h_i)
        y, last = torch.cat(ys, dim=-1), torch.cat(lasts, dim=0)

    if y.is_complex():
        y = 2 * y.real
    out = y if D is None else y + uc * D.to(cdt)[:, None]
    if z is not None:
        out = out * F.silu(z.to(cdt))
    out = out.to(u.dtype)
    return (out, last) if return_last_state else out
