"""Chunked PyTorch selective scan: the CPU path, and a correct fallback on any device.

Time is cut into chunks of ``CHUNK`` steps. For one chunk the decays exp(delta * A) and the
inputs delta * u * B of every (step, batch, channel, state) are computed at once into
(T, batch, dim, dstate) buffers; a short in-place loop over the chunk's steps then runs the
recurrence. The scan's memory is O(batch * dim * dstate * CHUNK), never (batch, dim, seqlen,
dstate). The state entering each chunk is saved (``checkpoints``) so the backward recomputes the
states one chunk at a time, last chunk first, and runs the adjoint recurrence
dh_{t-1} = C_{t-1} dy_{t-1} + exp(delta_t A) dh_t alongside.

Tensors over time are kept time-major, (seqlen, batch, dim), so each chunk is a contiguous slice.
"""

from __future__ import annotations

import bisect
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_cu_seqlens_values, check_scan_inputs, compute_dtype

CHUNK = 64  # time steps per chunk; also the checkpoint interval of this backend


def num_chunks(seqlen):
    """Number of checkpoints for a sequence of ``seqlen`` steps (works on SymInts)."""
    return (seqlen + CHUNK - 1) // CHUNK


class _BC:
    """B or C seen per chunk as (T or 1, batch or 1, groups, 1, dstate).

    A (T, batch, dim, ...) buffer is viewed as (T, batch, groups, dim // groups, ...) to meet it.
    Constant (dim, dstate) is the case groups = dim; variable (batch, dstate, seqlen) is groups = 1.
    """

    def __init__(self, t: Tensor, dim: int, cdt: torch.dtype):
        self.cdt = cdt
        self.constant = t.dim() == 2
        if self.constant:
            self.t = t.to(cdt)
            self.groups = dim
        else:
            self.t = t.unsqueeze(1) if t.dim() == 3 else t  # (batch, groups, dstate, seqlen)
            self.groups = self.t.shape[1]

    def chunk(self, t0: int, t1: int) -> Tensor:
        if self.constant:
            return self.t[None, None, :, None, :]
        return self.t[..., t0:t1].permute(3, 0, 1, 2).unsqueeze(3).to(self.cdt)

    def split(self, buf: Tensor) -> Tensor:
        T, batch, dim = buf.shape[:3]
        return buf.view(T, batch, self.groups, dim // self.groups, *buf.shape[3:])

    def times(self, w: Tensor, bc: Tensor) -> Tensor:
        """w (T, batch, dim) times this B/C chunk -> (T, batch, dim, dstate)."""
        out = self.split(w.unsqueeze(-1)) * bc
        return out.view(*w.shape, bc.shape[-1])

    def contract(self, buf: Tensor, bc: Tensor) -> Tensor:
        """sum_n buf[t, b, d, n] * B[t, b, group(d), n] -> (T, batch, dim)."""
        if self.constant:
            return torch.einsum("tbdn,dn->tbd", buf, bc[0, 0, :, 0])
        return (self.split(buf) @ bc.transpose(-1, -2)).view(buf.shape[:3])

    def reduce(self, buf: Tensor, w: Tensor) -> Tensor:
        """Gradient of this B/C from the chunk: sum over the channels of each group (and over
        steps and batch when constant) of buf[t, b, d, n] * w[t, b, d]."""
        if self.constant:
            return torch.einsum("tbdn,tbd->dn", buf, w)
        return (self.split(w).unsqueeze(-2) @ self.split(buf)).squeeze(3)  # (T, batch, groups, n)


class _Segments:
    """Boundaries of packed sequences (cu_seqlens read to the host once)."""

    def __init__(self, cu_seqlens: Tensor, seqlen: int):
        bounds = check_cu_seqlens_values(cu_seqlens, seqlen)
        spans = [(s, e, i) for i, (s, e) in enumerate(itertools.pairwise(bounds))]
        self.num_seqs = len(spans)
        self.starts = [(s, i) for s, e, i in spans if e > s]
        self.ends = [(e - 1, i) for s, e, i in spans if e > s]
        self.empty = [i for s, e, i in spans if e == s]

    @staticmethod
    def _within(points: list[tuple[int, int]], t0: int, t1: int) -> list[tuple[int, int]]:
        lo = bisect.bisect_left(points, (t0, -1))
        hi = bisect.bisect_left(points, (t1, -1))
        return [(p - t0, i) for p, i in points[lo:hi]]

    def starts_in(self, t0: int, t1: int) -> list[tuple[int, int]]:
        """(local position, sequence index) of every sequence starting in [t0, t1)."""
        return self._within(self.starts, t0, t1)

    def ends_in(self, t0: int, t1: int) -> list[tuple[int, int]]:
        """(local position, sequence index) of every sequence ending in [t0, t1)."""
        return self._within(self.ends, t0, t1)


class _Problem:
    """Everything the forward and the backward derive from the inputs, time-major in float32
    (float64 when any input is)."""

    def __init__(self, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, softplus):
        check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
        self.cdt = cdt = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
        self.batch, self.dim, self.seqlen = u.shape
        self.dstate = A.shape[1]
        self.A = A.to(cdt)
        self.B = _BC(B, self.dim, cdt)
        self.C = _BC(C, self.dim, cdt)
        self.u = _time_major(u, cdt)
        dt = _time_major(delta, cdt)
        if delta_bias is not None:
            dt += delta_bias.to(cdt)
        self.dt_raw = dt  # before softplus, for its derivative
        self.dt = F.softplus(dt) if softplus else dt
        self.dtu = self.dt * self.u
        self.segments = None if cu_seqlens is None else _Segments(cu_seqlens, self.seqlen)
        self.num_states = self.batch if cu_seqlens is None else self.segments.num_seqs
        self.init = None if initial_state is None else initial_state.to(cdt)

    def chunks(self):
        for c in range(num_chunks(self.seqlen)):
            yield c, c * CHUNK, min(self.seqlen, (c + 1) * CHUNK)

    def decay_and_input(self, t0: int, t1: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(a, x, B chunk, C chunk), a = exp(delta A) and x = delta u B (T, batch, dim, dstate)."""
        a = torch.exp(self.dt[t0:t1, :, :, None] * self.A)
        bc, cc = self.B.chunk(t0, t1), self.C.chunk(t0, t1)
        return a, self.B.times(self.dtu[t0:t1], bc), bc, cc

    def start_states(self, a: Tensor, x: Tensor, t0: int, t1: int) -> list[tuple[int, int, Tensor]]:
        """Make packed sequences start fresh: at each start, add exp(delta A) * initial_state to x
        and zero the decay so that no state flows in from the previous sequence.

        Returns (local position, sequence index, original decay row) per start in the chunk."""
        if self.segments is None:
            return []
        starts = []
        for p, i in self.segments.starts_in(t0, t1):
            starts.append((p, i, a[p].clone()))
            if self.init is not None:
                x[p] += a[p] * self.init[i]
            a[p] = 0
        return starts


def _time_major(t: Tensor, cdt: torch.dtype) -> Tensor:
    return t.permute(2, 0, 1).to(cdt).contiguous()


def _scan_in_place(a: Tensor, x: Tensor, h: Tensor) -> None:
    """x[t] <- a[t] * x[t-1] + x[t] along dim 0, starting from state h: x becomes the states."""
    xs, as_ = x.unbind(0), a.unbind(0)
    xs[0].addcmul_(as_[0], h)
    for t in range(1, len(xs)):
        xs[t].addcmul_(as_[t], xs[t - 1])


def _scan_back_in_place(a: Tensor, g: Tensor, carry: Tensor) -> None:
    """g[t] <- g[t] + a[t+1] * g[t+1], last step first, with a[T] * g[T] = carry."""
    gs, as_ = g.unbind(0), a.unbind(0)
    gs[-1].add_(carry)
    for t in range(len(gs) - 2, -1, -1):
        gs[t].addcmul_(as_[t + 1], gs[t + 1])


def _gate(y: Tensor, z: Tensor | None) -> Tensor:
    return y if z is None else y * F.silu(z)


def scan_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward scan. Returns out (batch, dim, seqlen) in u's dtype, last_state (batch or
    num_seqs, dim, dstate) and checkpoints (batch, dim, num_chunks(seqlen), dstate), the state
    entering each chunk; both float32 (float64 when any input is)."""
    p = _Problem(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus)
    batch, dim, dstate, cdt = p.batch, p.dim, p.dstate, p.cdt
    y = torch.empty(p.seqlen, batch, dim, dtype=cdt, device=u.device)
    checkpoints = u.new_empty((batch, dim, num_chunks(p.seqlen), dstate), dtype=cdt)
    last = u.new_zeros((p.num_states, dim, dstate), dtype=cdt)
    if p.init is not None and p.segments is not None:
        last[p.segments.empty] = p.init[p.segments.empty]
    h = u.new_zeros((batch, dim, dstate), dtype=cdt)
    if p.init is not None and p.segments is None:
        h = p.init
    for c, t0, t1 in p.chunks():
        checkpoints[:, :, c] = h
        a, x, _, cc = p.decay_and_input(t0, t1)
        p.start_states(a, x, t0, t1)
        _scan_in_place(a, x, h)
        y[t0:t1] = p.C.contract(x, cc)
        h = x[-1]
        if p.segments is not None:
            for e, i in p.segments.ends_in(t0, t1):
                last[i] = x[e, 0]
    if p.segments is None:
        last.copy_(h)
    if D is not None:
        y += p.u * D.to(cdt)
    out = u.new_empty(u.shape)
    out.copy_(_gate(y.permute(1, 2, 0), None if z is None else z.to(cdt)))
    return out, last, checkpoints


def scan_bwd(
    dout: Tensor,
    dlast_state: Tensor | None,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    checkpoints: Tensor,
    delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward scan from the forward's checkpoints.

    Returns (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in its input's
    dtype and shape; the gradients of absent optional inputs are empty tensors."""
    p = _Problem(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus)
    batch, dim, dstate, cdt, L = p.batch, p.dim, p.dstate, p.cdt, p.seqlen
    zc = None if z is None else _time_major(z, cdt)
    dout_t = _time_major(dout, cdt)
    dy = _gate(dout_t, zc)  # gradient of y = C h + D u
    y = torch.empty_like(dy) if z is not None else None
    ddt, du = torch.empty_like(dy), torch.empty_like(dy)
    dA = torch.zeros_like(p.A)
    dB = _bc_grad_buffer(p.B, batch, dstate, L, u)
    dC = _bc_grad_buffer(p.C, batch, dstate, L, u)
    dinit = None if p.init is None else torch.zeros_like(p.init)
    dlast = None if dlast_state is None else dlast_state.to(cdt)
    carry = u.new_zeros((batch, dim, dstate), dtype=cdt)
    if dlast is not None and p.segments is None:
        carry = carry + dlast
    if dlast is not None and dinit is not None and p.segments is not None:
        dinit[p.segments.empty] = dlast[p.segments.empty]
    for c, t0, t1 in reversed(list(p.chunks())):
        a, x, bc, cc = p.decay_and_input(t0, t1)
        states = x.clone()
        starts = p.start_states(a, states, t0, t1)
        _scan_in_place(a, states, checkpoints[:, :, c].to(cdt))
        g = p.C.times(dy[t0:t1], cc)  # C dy, becomes dh in place
        if dlast is not None and p.segments is not None:
            for e, i in p.segments.ends_in(t0, t1):
                g[e, 0] += dlast[i]
        _scan_back_in_place(a, g, carry)
        carry = a[0] * g[0]
        for s, i, a_row in starts:
            if dinit is not None:
                dinit[i] = a_row[0] * g[s, 0]
        dhb = p.B.contract(g, bc)  # sum_n dh B
        decayed = torch.sub(states, x, out=x).mul_(g)  # dh * exp(delta A) h_{t-1}
        dt = p.dt[t0:t1]
        ddt[t0:t1] = p.u[t0:t1] * dhb + torch.einsum("tbdn,dn->tbd", decayed, p.A)
        du[t0:t1] = dt * dhb
        dA += torch.einsum("tbdn,tbd->dn", decayed, dt)
        _store_bc_grad(dB, p.B, p.B.reduce(g, p.dtu[t0:t1]), t0, t1)
        _store_bc_grad(dC, p.C, p.C.reduce(states, dy[t0:t1]), t0, t1)
        if y is not None:
            y[t0:t1] = p.C.contract(states, cc)
    if dinit is not None and p.segments is None:
        dinit = carry
    dD = _empty(u)
    if D is not None:
        du += dy * D.to(cdt)
        dD = torch.einsum("tbd,tbd->d", dy, p.u).to(D.dtype)
        if y is not None:
            y += p.u * D.to(cdt)
    dz = _empty(u)
    if zc is not None:
        sig = torch.sigmoid(zc)
        dz = _batch_major(dout_t * y * sig * (1 + zc * (1 - sig)), z.dtype)
    if delta_softplus:
        ddt *= torch.where(p.dt_raw <= 20, torch.sigmoid(p.dt_raw), 1.0)
    ddelta_bias = _empty(u)
    if delta_bias is not None:
        ddelta_bias = ddt.sum((0, 1)).to(delta_bias.dtype)
    return (
        _batch_major(du, u.dtype),
        _batch_major(ddt, delta.dtype),
        dA.to(A.dtype),
        dB.to(B.dtype).view(B.shape),
        dC.to(C.dtype).view(C.shape),
        dD,
        dz,
        ddelta_bias,
        _empty(u) if dinit is None else dinit.to(initial_state.dtype),
    )


def _empty(like: Tensor) -> Tensor:
    """Placeholder gradient of an absent optional input (the op's outputs have fixed arity)."""
    return like.new_empty((0,))


def _batch_major(t: Tensor, dtype: torch.dtype) -> Tensor:
    """(seqlen, batch, dim) -> contiguous (batch, dim, seqlen) in dtype."""
    out = t.new_empty((t.shape[1], t.shape[2], t.shape[0]), dtype=dtype)
    out.copy_(t.permute(1, 2, 0))
    return out


def _bc_grad_buffer(bc: _BC, batch: int, dstate: int, seqlen: int, like: Tensor) -> Tensor:
    """Zeroed (dim, dstate) accumulator for constant B/C; (batch, groups, dstate, seqlen) else."""
    shape = bc.t.shape if bc.constant else (batch, bc.groups, dstate, seqlen)
    return like.new_zeros(shape, dtype=bc.cdt)


def _store_bc_grad(grad: Tensor, bc: _BC, chunk_grad: Tensor, t0: int, t1: int) -> None:
    if bc.constant:
        grad += chunk_grad
    else:
        grad[..., t0:t1] = chunk_grad.permute(1, 2, 3, 0)
