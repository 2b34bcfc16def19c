"""The selective scan with complex A (mamba_ssm's complex-valued S4D-style scan), on any device.

The ``scan_fwd`` / ``scan_bwd`` ops (cpu.py) run this for complex A; the public functions route
complex A to them on every device. Where the backend is Triton (``interface.use_triton``: CUDA
tensors by default), they run the complex kernels of kernels/complex_scan.py; else the PyTorch
code below. Semantics are selective_scan_ref's: complex states; constant B/C complex, variable
B/C real with real and imaginary parts interleaved along time; y = 2 Re(sum_n C h) + D u.

Forward: the sequence in chunks of cpu.CHUNK steps, each by the reference's recurrence from the
state the chunk before left; the state entering each chunk is kept as a checkpoint, as the real
path keeps them. Backward: the states recomputed from the inputs, then the adjoint recurrence
written out (scan_bwd), with PyTorch's convention for complex gradients, as autograd through
selective_scan_ref gives them: a real loss's gradient with respect to complex w is
dL/dRe w + i dL/dIm w, and a real tensor holding interleaved parts gets the parts of that. A
step at a time in Python, all states kept: this path is for correctness, not speed. Both
write the same checkpoints (the state entering each chunk), so either backward follows either
forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import checkpoint_slots, compute_dtype, state_dtype
from .reference import as_state_values, expand_bc, selective_scan_ref
from .scan_args import ScanArgs


def _steps(t: Tensor | None, t0: int, t1: int, interleaved: bool = False) -> Tensor | None:
    """Steps [t0, t1) of a per-step tensor; a variable B/C of complex A holds 2 values a step."""
    if t is None:
        return None
    return t[..., 2 * t0 : 2 * t1] if interleaved else t[..., t0:t1]


def _kernels(u: Tensor):
    """kernels/complex_scan.py where the Triton backend is chosen for inputs like u, else
    None. (Imported here: interface imports the ops, which import this module.)"""
    from . import ops
    from .interface import use_triton

    if not use_triton(u):
        return None
    ops.triton_ops()  # a clear error where SELECTIVE_SCAN_BACKEND=triton but triton is missing
    from .kernels import complex_scan

    return complex_scan


def scan_fwd(args: ScanArgs, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out (batch, dim, seqlen) in u's dtype, last_state (batch, dim, dstate) complex,
    checkpoints (batch, dim, ceil(seqlen / chunk) + 1, dstate) complex: the state entering each
    chunk, the spare slot last, zero)."""
    kernels = _kernels(args.u)
    if kernels is not None:
        return kernels.scan_fwd(args, chunk)
    u, delta, A, B, C, D, z, bias, h0, _ = args.tensors
    batch, dim, seqlen = u.shape
    sdt = state_dtype(A, compute_dtype(*args.floats))
    ckpt = u.new_zeros((batch, dim, checkpoint_slots(seqlen, chunk), A.shape[1]), dtype=sdt)
    h = u.new_zeros(ckpt[:, :, 0].shape, dtype=sdt) if h0 is None else h0.to(sdt)
    out = u.new_empty(u.shape)
    for c, t0 in enumerate(range(0, seqlen, chunk)):
        t1 = min(seqlen, t0 + chunk)
        ckpt[:, :, c] = h
        bc = [_steps(t, t0, t1, interleaved=True) if t.dim() > 2 else t for t in (B, C)]
        piece, h = selective_scan_ref(
            _steps(u, t0, t1), _steps(delta, t0, t1), A, *bc, D, _steps(z, t0, t1), bias,
            delta_softplus=args.delta_softplus, return_last_state=True, initial_state=h,
        )  # fmt: skip
        out[..., t0:t1] = piece
    return out, h, ckpt


def _bc_grad(g: Tensor, t: Tensor) -> Tensor:
    """The gradient of B or C (t, any form) from its per-(batch, channel, state, step) complex
    gradient g: summed over what the form shares, real and imaginary parts interleaved in time
    for a variable one."""
    if t.dim() == 2:  # constant (dim, dstate), complex
        return g.sum((0, 3))
    groups = 1 if t.dim() == 3 else t.shape[1]
    g = g.unflatten(1, (groups, -1)).sum(2)  # (batch, groups, dstate, seqlen)
    if t.dim() == 3:
        g = g[:, 0]
    return torch.view_as_real(g).flatten(-2)


def scan_bwd(dout: Tensor, dlast_state: Tensor | None, args: ScanArgs, checkpoints: Tensor,
             chunk: int) -> tuple:  # fmt: skip
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in its input's shape
    and dtype, an empty tensor for absent optional inputs. The kernels start from the
    checkpoints (every ``chunk`` steps); the code below recomputes every state.

    The states are recomputed from the inputs, then the adjoint recurrence runs last step first:
    with h_t = a_t h_{t-1} + b_t (a_t = exp(delta_t A), b_t = delta_t u_t B_t, holomorphic) and
    y_t = 2 Re(sum_n C_t h_t), the gradient g_t of h_t takes 2 dy_t conj(C_t), passes
    conj(a_t) g_t to h_{t-1}, and gives dB_t = delta_t u_t g_t, dC_t = 2 dy_t conj(h_t),
    dA = sum_t conj(delta_t a_t) conj(h_{t-1}) g_t; real inputs get the real part of the
    conjugate chain rule (d/dx = Re(conj(dw/dx) g))."""
    kernels = _kernels(args.u)
    if kernels is not None:
        return kernels.scan_bwd(dout, dlast_state, args, checkpoints, chunk)
    u, delta, A, B, C, D, z, bias, h0, _ = args.tensors
    cdt = compute_dtype(*args.floats)
    sdt = state_dtype(A, cdt)
    batch, dim, seqlen = u.shape
    uc = u.to(cdt)
    raw = delta.to(cdt) if bias is None else delta.to(cdt) + bias.to(cdt)[:, None]
    dt = F.softplus(raw) if args.delta_softplus else raw
    Bx = expand_bc(as_state_values(B, sdt), batch, dim, seqlen)  # (batch, dim, dstate, seqlen)
    Cx = expand_bc(as_state_values(C, sdt), batch, dim, seqlen)
    Ac = A.to(sdt)
    a = torch.exp(dt[..., None] * Ac[:, None, :])  # (batch, dim, seqlen, dstate)
    dtu = dt * uc
    states = [u.new_zeros((batch, dim, A.shape[1]), dtype=sdt) if h0 is None else h0.to(sdt)]
    for t in range(seqlen):
        states.append(a[:, :, t] * states[-1] + dtu[:, :, t, None] * Bx[..., t])
    y = torch.stack([2 * (h * Cx[..., t]).sum(-1).real for t, h in enumerate(states[1:])], -1)
    pre = y if D is None else y + uc * D.to(cdt)[:, None]
    dpre = dout.to(cdt)
    dz = None
    if z is not None:
        gate = F.silu(z.to(cdt))
        sig = torch.sigmoid(z.to(cdt))
        dz = dout.to(cdt) * pre * sig * (1 + z.to(cdt) * (1 - sig))
        dpre = dpre * gate
    g = torch.zeros_like(states[0]) if dlast_state is None else dlast_state.to(sdt).clone()
    dB, dC = torch.empty_like(Bx), torch.empty_like(Cx)
    dA = torch.zeros_like(Ac)
    ddtu, ddt = torch.empty_like(dt), torch.empty_like(dt)
    # conj_physical, not conj: the lazy conjugate bit of a conj view was lost where AOTAutograd
    # runs the op (compiled training gave other gradients than eager; opcheck caught it).
    for t in reversed(range(seqlen)):
        g = g + 2 * dpre[..., t, None] * Cx[..., t].conj_physical()
        dC[..., t] = 2 * dpre[..., t, None] * states[t + 1].conj_physical()
        dB[..., t] = dtu[..., t, None] * g
        ddtu[..., t] = (Bx[..., t].conj_physical() * g).real.sum(-1)
        da = states[t].conj_physical() * g  # gradient of a_t
        dA += (dt[..., t, None] * a[:, :, t]).conj_physical().mul(da).sum(0)
        ddt[..., t] = ((Ac * a[:, :, t]).conj_physical() * da).real.sum(-1)
        g = a[:, :, t].conj_physical() * g
    ddt = ddt + ddtu * uc
    du = ddtu * dt + (0 if D is None else D.to(cdt)[:, None] * dpre)
    if args.delta_softplus:
        ddt = ddt * torch.sigmoid(raw)
    grads = (
        du, ddt, dA, _bc_grad(dB, B), _bc_grad(dC, C),
        None if D is None else (dpre * uc).sum((0, 2)), dz,
        None if bias is None else ddt.sum((0, 2)), None if h0 is None else g,
    )  # fmt: skip
    return tuple(
        u.new_empty((0,)) if t is None else grad.to(t.dtype).contiguous().clone()
        for grad, t in zip(grads, args.floats, strict=True)
    )
