"""Chunked PyTorch selective scan: the CPU path, and a correct fallback on any device.

Time is cut into chunks of ``CHUNK`` steps, and the state entering each chunk is saved
(``checkpoints``). Steps are processed a block at a time, a block being one chunk, or several
when a step holds few elements (see ``BLOCK_ELEMENTS``): for one block the decays
exp(delta * A) and the inputs delta * u * B of every (step, batch, channel, state) are computed
at once into (T, batch, dim, dstate) work buffers, allocated once per call and reused by every
block; an in-place scan over the block's steps then runs the recurrence. The scan's memory is
O(batch * dim * dstate * CHUNK + BLOCK_ELEMENTS), never (batch, dim, seqlen, dstate). The
backward recomputes the states one block at a time from the checkpoints, last block first, and
runs the adjoint recurrence dh_{t-1} = C_{t-1} dy_{t-1} + exp(delta_t A) dh_t alongside.

Per-step tensors are kept as (batch, seqlen, dim) so that one step's channels are contiguous,
and the work buffers time-major so that each step is one contiguous (batch, dim, dstate) slice.
Every tensor derived from an input is a fresh copy: nothing here writes into a caller's tensor.
"""

from __future__ import annotations

import bisect
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from . import complex_scan
from ._checks import (
    check_cu_seqlens_values,
    check_scan_grads,
    check_scan_inputs,
    checkpoint_slots,
    compute_dtype,
    state_dtype,
)
from .scan_args import ScanArgs

# Time steps per chunk: the checkpoint interval of this backend (ops.py sizes the fake's
# checkpoints from it), and the block length for layer-sized steps. Of 8, 16, 32, 64 and 128,
# 64 was fastest at batch x dim of 2 x 768 to 2 x 1536 (dstate 16) on the 2-core development
# Xeon: shorter blocks pay the per-op overhead more often than they gain from the L2 cache.
CHUNK = 64

# Small steps are processed several chunks at a time, in blocks of up to this many elements per
# (T, batch, dim, dstate) buffer, so that per-op overhead is paid once per block, not per chunk.
BLOCK_ELEMENTS = 1 << 20

# The in-block scan is sequential (one fused multiply-add per step, T Python-level calls) unless
# a step holds at most this many elements (batch * dim * dstate): then the per-call overhead
# dominates and a log-depth scan (log2(T) levels of whole-block operations) is faster.
LOG_SCAN_MAX_STEP = 128


def num_chunks(seqlen):
    """Number of checkpoints for a sequence of ``seqlen`` steps (works on SymInts)."""
    return (seqlen + CHUNK - 1) // CHUNK


def _fresh(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A new contiguous copy of t in dtype (``.to``/``.contiguous`` may return t itself)."""
    out = t.new_empty(t.shape, dtype=dtype)
    out.copy_(t)
    return out


_PANEL = 32  # rows per panel in _transpose: 128-byte float32 runs; 16 and 64 measured slower


def _transpose(t: Tensor, dtype: torch.dtype) -> Tensor:
    """(batch, M, N) -> new contiguous (batch, N, M) in dtype.

    A plain strided copy is slow here (about 6 ns per element at 1 x 1536 x 2048 on the 2-core
    Xeon used for development): each element read or written touches its own cache line. Going
    through panels of 32 rows -- transpose (M/32, 32, N) panels, then move 32-element runs --
    keeps both copies cache-friendly and measured 2-4x faster on layer-sized tensors.
    """
    batch, M, N = t.shape
    out = t.new_empty((batch, N, M), dtype=dtype)
    if M % _PANEL:
        out.copy_(t.transpose(1, 2))
        return out
    panels = t.new_empty((batch, M // _PANEL, N, _PANEL), dtype=dtype)
    panels.copy_(t.view(batch, M // _PANEL, _PANEL, N).transpose(2, 3))
    out.view(batch, N, M // _PANEL, _PANEL).copy_(panels.transpose(1, 2))
    return out


def _steps(t: Tensor, t0: int, t1: int) -> Tensor:
    """Steps [t0, t1) of a (batch, seqlen, dim) tensor, as a (T, batch, dim) view."""
    return t[:, t0:t1].transpose(0, 1)


class _StateWeight:
    """A per-state weight that multiplies (T, batch, dim, dstate) buffers: B, C or A.

    Constant (dim, dstate) -- also used for A -- is seen per block as (1, 1, dim, 1, dstate);
    variable (batch, dstate, seqlen) and grouped (batch, groups, dstate, seqlen) are stored
    time-major (seqlen, batch, groups, dstate) and seen per block as (T, batch, groups, 1, dstate).
    A (T, batch, dim, ...) buffer is viewed as (T, batch, groups, dim // groups, ...) to meet it
    (constant is the case groups = dim, variable the case groups = 1).
    """

    def __init__(self, t: Tensor, dim: int, cdt: torch.dtype):
        self.constant = t.dim() == 2
        if self.constant:
            self.groups = dim
            self.t = _fresh(t, cdt)  # (dim, dstate)
        else:
            t = t.unsqueeze(1) if t.dim() == 3 else t
            self.groups = t.shape[1]
            self.t = _fresh(t.permute(3, 0, 1, 2), cdt)  # (seqlen, batch, groups, dstate)

    def chunk(self, t0: int, t1: int) -> Tensor:
        """This weight for steps [t0, t1), shaped to broadcast against split buffers."""
        if self.constant:
            return self.t[None, None, :, None, :]
        return self.t[t0:t1].unsqueeze(3)

    def split(self, buf: Tensor) -> Tensor:
        """(T, batch, dim, ...) -> (T, batch, groups, dim // groups, ...) view."""
        T, batch, dim = buf.shape[:3]
        return buf.view(T, batch, self.groups, dim // self.groups, *buf.shape[3:])

    def times(self, w: Tensor, wt: Tensor, out: Tensor) -> None:
        """out (T, batch, dim, dstate) <- w (T, batch, dim) times this weight's block ``wt``."""
        torch.mul(self.split(w.unsqueeze(-1)), wt, out=self.split(out))

    def contract(self, buf: Tensor, wt: Tensor | None, out: Tensor, scratch: Tensor) -> None:
        """out (T, batch, dim) <- sum_n buf[t, b, d, n] * weight[t, b, group(d), n].
        wt: this weight's block (unused when constant); scratch: a buffer shaped like buf."""
        if self.constant:
            # Multiply, then sum over dstate as a matrix-vector product with ones: torch's sum
            # over a short innermost axis, and einsum (which copies buf per step), were slower.
            prod = torch.mul(buf, self.t, out=scratch)
            torch.matmul(prod, prod.new_ones(prod.shape[-1]), out=out)
        else:
            torch.matmul(self.split(buf), wt.transpose(-1, -2), out=self.split(out.unsqueeze(-1)))

    def add_grad(
        self, grad: Tensor, buf: Tensor, w: Tensor, t0: int, t1: int, scratch: Tensor
    ) -> None:
        """Add this block's sum_d buf[t, b, d, n] * w[t, b, d] to grad: over the channels of
        each group into grad[t0:t1] (seqlen, batch, groups, dstate), and also over steps and
        batch into grad (dim, dstate) when constant. scratch: a buffer shaped like buf."""
        if self.constant:
            # A multiply and a sum over the leading dims: einsum's batched matmul over dim
            # measured 3.5x slower, as it first copies buf into a dim-major layout.
            grad += torch.mul(buf, w.unsqueeze(-1), out=scratch).sum((0, 1))
        else:
            torch.matmul(self.split(w).unsqueeze(-2), self.split(buf), out=grad[t0:t1].unsqueeze(3))

    def new_grad(self) -> Tensor:
        """Zeroed gradient accumulator in this weight's stored layout."""
        return torch.zeros_like(self.t)

    def grad_as_input(self, grad: Tensor, like: Tensor) -> Tensor:
        """The accumulated gradient as a new contiguous tensor of like's shape and dtype."""
        if self.constant:
            return _fresh(grad, like.dtype)
        return _fresh(grad.permute(1, 2, 3, 0), like.dtype).view(like.shape)


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
    """Everything the forward and the backward derive from the inputs, in float32 (float64 when
    any input is): per-step tensors as (batch, seqlen, dim), so that the dim values of one step
    are contiguous; B and C time-major."""

    def __init__(self, args: ScanArgs):
        check_scan_inputs(args)
        u, delta, A, B, C, _, _, delta_bias, initial_state, cu_seqlens = args.tensors
        self.cdt = cdt = compute_dtype(*args.floats)
        self.batch, self.dim, self.seqlen = u.shape
        self.dstate = A.shape[1]
        self.A = _StateWeight(A, self.dim, cdt)
        self.B = _StateWeight(B, self.dim, cdt)
        self.C = _StateWeight(C, self.dim, cdt)
        self.u = _transpose(u, cdt)
        dt = _transpose(delta, cdt)
        if delta_bias is not None:
            dt += delta_bias.to(cdt)
        self.dt_raw = dt  # before softplus, for its derivative
        # Threshold 20, as in the CUDA kernel.
        self.dt = F.softplus(dt) if args.delta_softplus else dt
        self.dtu = self.dt * self.u
        self.segments = None if cu_seqlens is None else _Segments(cu_seqlens, self.seqlen)
        self.num_states = self.batch if cu_seqlens is None else self.segments.num_seqs
        self.init = None if initial_state is None else initial_state.to(cdt)

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """(c0, c1, t0, t1): the blocks of whole chunks [c0, c1) covering steps [t0, t1)."""
        step = self.batch * self.dim * self.dstate
        per_block = max(1, BLOCK_ELEMENTS // (CHUNK * step))
        n = num_chunks(self.seqlen)
        return [
            (c0, min(n, c0 + per_block), c0 * CHUNK, min(self.seqlen, (c0 + per_block) * CHUNK))
            for c0 in range(0, n, per_block)
        ]

    def buffer(self, *shape: int) -> Tensor:
        """An uninitialized (longest block, *shape) work buffer, sliced per block."""
        _, _, t0, t1 = self.blocks()[0]
        return self.u.new_empty((t1 - t0, *shape))

    def state_buffer(self) -> Tensor:
        return self.buffer(self.batch, self.dim, self.dstate)

    def decay_and_input(self, t0: int, t1: int, a: Tensor, x: Tensor) -> list:
        """Fill a <- exp(delta A) and x <- delta u B for steps [t0, t1) (T, batch, dim, dstate).

        Packed sequences start fresh: at each start, exp(delta A) * initial_state is added to x
        and the decay is zeroed so that no state flows in from the previous sequence. Returns
        (local position, sequence index, original decay row) per start in the block."""
        torch.mul(_steps(self.dt, t0, t1).unsqueeze(-1), self.A.t, out=a)
        a.exp_()
        self.B.times(_steps(self.dtu, t0, t1), self.B.chunk(t0, t1), out=x)
        if self.segments is None:
            return []
        starts = []
        for p, i in self.segments.starts_in(t0, t1):
            starts.append((p, i, a[p].clone()))
            if self.init is not None:
                x[p] += a[p] * self.init[i]
            a[p] = 0
        return starts

    def states(self, t0: int, t1: int, h: Tensor, a: Tensor, x: Tensor) -> list:
        """Fill a with the decays and x with the states h_t of steps [t0, t1), starting from the
        state h entering the block; returns the packed starts (see decay_and_input)."""
        starts = self.decay_and_input(t0, t1, a, x)
        x[0].addcmul_(a[0], h)
        _scan(a, x)
        return starts


def _scan(a: Tensor, x: Tensor, reverse: bool = False) -> None:
    """Linear recurrence along dim 0 of (T, ...) tensors, in place in x; a is not modified.

    Forward: x[t] += a[t] * x[t-1] for t = 1 .. T-1. Reverse: x[t] += a[t+1] * x[t+1] for
    t = T-2 .. 0. In both directions the decay is the later step's.
    """
    T = x.shape[0]
    if x[0].numel() > LOG_SCAN_MAX_STEP or T < 4:
        xs, as_ = x.unbind(0), a.unbind(0)
        for t in range(T - 2, -1, -1) if reverse else range(1, T):
            src = t + 1 if reverse else t - 1
            xs[t].addcmul_(as_[max(t, src)], xs[src])
        return
    # Hillis-Steele: before the level of offset s, x[t] sums the s latest inputs (s next ones
    # when reverse), each with its decay, and P[t] is the product of the decays of the s steps
    # up to t. Right-hand sides are evaluated into temporaries before the overlapping stores.
    P = a.clone()
    s = 1
    while s < T:
        later, earlier = slice(s, None), slice(None, T - s)
        dst, src = (earlier, later) if reverse else (later, earlier)
        x[dst] += P[later] * x[src]
        if 2 * s < T:
            P[later] = P[later] * P[earlier]
        s *= 2


def _silu(z: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """silu(z) in dtype (z: the gate, or None)."""
    return None if z is None else F.silu(z.to(dtype))


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
    num_seqs, dim, dstate) and checkpoints (batch, dim, num_chunks(seqlen) + 1, dstate), the state
    entering each chunk; both float32 (float64 when any input is)."""
    args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus)
    if A.is_complex():
        check_scan_inputs(args)
        return complex_scan.scan_fwd(args, CHUNK)
    p = _Problem(args)
    batch, dim, dstate, cdt = p.batch, p.dim, p.dstate, p.cdt
    y = torch.empty_like(p.u)  # (batch, seqlen, dim)
    checkpoints = u.new_empty((batch, dim, checkpoint_slots(p.seqlen, CHUNK), dstate), dtype=cdt)
    checkpoints[:, :, -1] = 0  # the spare slot (see checkpoint_slots)
    last = u.new_zeros((p.num_states, dim, dstate), dtype=cdt)
    if p.init is not None and p.segments is not None:
        last[p.segments.empty] = p.init[p.segments.empty]
    h = u.new_zeros((batch, dim, dstate), dtype=cdt)
    if p.init is not None and p.segments is None:
        h.copy_(p.init)
    a_buf, x_buf, y_buf = p.state_buffer(), p.state_buffer(), p.buffer(batch, dim)
    for c0, c1, t0, t1 in p.blocks():
        a, x, y_block = a_buf[: t1 - t0], x_buf[: t1 - t0], y_buf[: t1 - t0]
        checkpoints[:, :, c0] = h
        p.states(t0, t1, h, a, x)
        # The state entering each later chunk of the block is the one after the step before it.
        checkpoints[:, :, c0 + 1 : c1] = x[CHUNK - 1 : -1 : CHUNK].permute(1, 2, 0, 3)
        p.C.contract(x, p.C.chunk(t0, t1), out=y_block, scratch=a)
        _steps(y, t0, t1).copy_(y_block)
        h.copy_(x[-1])  # x is overwritten by the next block
        if p.segments is not None:
            for e, i in p.segments.ends_in(t0, t1):
                last[i] = x[e, 0]
    if p.segments is None:
        last.copy_(h)
    if D is not None:
        y.addcmul_(p.u, D.to(cdt))
    y = _transpose(y, cdt)
    out = u.new_empty(u.shape)
    if z is None:
        out.copy_(y)
    else:
        torch.mul(y, _silu(z, cdt), out=out)
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
    args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus)
    if A.is_complex():
        check_scan_inputs(args)
        sdt = state_dtype(A, compute_dtype(*args.floats))
        check_scan_grads(dout, dlast_state, checkpoints, args, CHUNK, sdt)
        return complex_scan.scan_bwd(dout, dlast_state, args, checkpoints, CHUNK)
    p = _Problem(args)
    batch, dim, dstate, cdt = p.batch, p.dim, p.dstate, p.cdt
    check_scan_grads(dout, dlast_state, checkpoints, args, CHUNK, cdt)
    silu_z = _silu(z, cdt)
    # Gradient of y = C h + D u, as (batch, seqlen, dim) like the other per-step tensors.
    dy = _transpose(dout if z is None else dout * silu_z, cdt)
    y = None if z is None else torch.empty_like(dy)  # recomputed for dz
    ddt, du = torch.empty_like(dy), torch.empty_like(dy)
    dA, dB, dC = p.A.new_grad(), p.B.new_grad(), p.C.new_grad()
    dinit = None if p.init is None else torch.zeros_like(p.init)
    dlast = None if dlast_state is None else dlast_state.to(cdt)
    carry = u.new_zeros((batch, dim, dstate), dtype=cdt)  # a[t1] * dh[t1] of the block after
    if dlast is not None and p.segments is None:
        carry.copy_(dlast)
    if dlast is not None and dinit is not None and p.segments is not None:
        dinit[p.segments.empty] = dlast[p.segments.empty]
    a_buf, h_buf, g_buf, q_buf = (p.state_buffer() for _ in range(4))
    dhB_buf, ddt_buf, du_buf = (p.buffer(batch, dim) for _ in range(3))
    for c0, _, t0, t1 in reversed(p.blocks()):
        T = t1 - t0
        a, states, g, q = a_buf[:T], h_buf[:T], g_buf[:T], q_buf[:T]
        dhB, ddt_block, du_block = dhB_buf[:T], ddt_buf[:T], du_buf[:T]
        dt, dy_block = _steps(p.dt, t0, t1), _steps(dy, t0, t1)
        h0 = checkpoints[:, :, c0]
        starts = p.states(t0, t1, h0, a, states)
        p.C.times(dy_block, p.C.chunk(t0, t1), out=g)  # C dy, becomes dh in place
        if dlast is not None and p.segments is not None:
            for e, i in p.segments.ends_in(t0, t1):
                g[e, 0] += dlast[i]
        g[-1] += carry
        _scan(a, g, reverse=True)
        torch.mul(a[0], g[0], out=carry)
        # q = dh * exp(delta A) * h_{t-1}: the gradient through the decay.
        torch.mul(a, g, out=q)
        q[1:] *= states[:-1]
        q[0] *= h0
        for s, i, a_row in starts:  # a packed start decays initial_state[i], not h_{t-1}
            q[s] = 0 if p.init is None else a_row * p.init[i] * g[s]
            if dinit is not None:
                dinit[i] = a_row[0] * g[s, 0]
        scratch = a  # the decays are no longer needed
        p.B.contract(g, p.B.chunk(t0, t1), out=dhB, scratch=scratch)  # sum_n dh B
        p.A.contract(q, None, out=ddt_block, scratch=scratch)
        ddt_block.addcmul_(_steps(p.u, t0, t1), dhB)
        _steps(ddt, t0, t1).copy_(ddt_block)
        torch.mul(dt, dhB, out=du_block)
        _steps(du, t0, t1).copy_(du_block)
        p.A.add_grad(dA, q, dt, t0, t1, scratch)
        p.B.add_grad(dB, g, _steps(p.dtu, t0, t1), t0, t1, scratch)
        p.C.add_grad(dC, states, dy_block, t0, t1, scratch)
        if y is not None:
            y_block = du_block  # du of this block is stored: reuse its buffer
            p.C.contract(states, p.C.chunk(t0, t1), out=y_block, scratch=scratch)
            _steps(y, t0, t1).copy_(y_block)
    if dinit is not None and p.segments is None:
        dinit = carry
    dD = _empty(u)
    if D is not None:
        du.addcmul_(dy, D.to(cdt))
        dD = torch.mul(dy, p.u).sum((0, 1)).to(D.dtype)  # einsum: a slow per-channel bmm
        if y is not None:
            y.addcmul_(p.u, D.to(cdt))
    dz = _empty(u)
    if z is not None:
        # d silu(z) / dz = sigmoid(z) (1 + z (1 - sigmoid(z))), with y back in (batch, dim, seqlen)
        zc = z.to(cdt)
        sig = torch.sigmoid(zc)
        dz = u.new_empty(z.shape, dtype=z.dtype)
        torch.mul(dout * _transpose(y, cdt), sig * (1 + zc * (1 - sig)), out=dz)
    if delta_softplus:
        ddt *= torch.where(p.dt_raw <= 20, torch.sigmoid(p.dt_raw), 1.0)
    ddelta_bias = _empty(u)
    if delta_bias is not None:
        ddelta_bias = ddt.sum((0, 1)).to(delta_bias.dtype)
    return (
        _transpose(du, u.dtype),
        _transpose(ddt, delta.dtype),
        p.A.grad_as_input(dA, A),
        p.B.grad_as_input(dB, B),
        p.C.grad_as_input(dC, C),
        dD,
        dz,
        ddelta_bias,
        _empty(u) if dinit is None else _fresh(dinit, initial_state.dtype),
    )


def _empty(like: Tensor) -> Tensor:
    """Placeholder gradient of an absent optional input (the op's outputs have fixed arity)."""
    return like.new_empty((0,))
