"""Triton kernels of the selective scan with complex A: what the ``scan_fwd`` / ``scan_bwd``
ops run for complex A on CUDA tensors (complex_scan.py chooses them as interface.use_triton
does).

Semantics and gradient conventions are complex_scan.py's: h_t = exp(delta_t A) h_{t-1} +
delta_t u_t B_t, y_t = 2 Re(sum_n C_t h_t) + D u_t, out = y silu(z). Complex tensors reach the
kernels as ``torch.view_as_real`` views (real and imaginary parts adjacent); variable B/C are
real already, their parts interleaved in time. Arithmetic in float32 (float64 for float64 or
complex128 inputs).

A program scans BD channels of one sequence over all states, a step at a time. Its backward
walks the chunks of ``chunk`` steps from the last: it recomputes the chunk's states from the
chunk's checkpoint into a scratch buffer of its own, then runs the adjoint recurrence back
through the chunk. Sums over channels (variable dB, dC) are a program's partials over channels
of one group, summed by torch in a fixed order; sums over time (dA, constant dB/dC, dD,
ddelta_bias) are kept per sequence and summed over the batch afterwards: deterministic.
Written for correctness, not speed: no tiling in time, no lanes. Memory while the backward
runs: the variable dB/dC partials, batch * ceil(dim / BD) * NP * seqlen * 2 values each in the
compute dtype (BD channels a program, 1 where a group has an odd number of channels), and the
scratch, batch * dim * (chunk + 1) * NP * 2.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._checks import checkpoint_slots, compute_dtype, state_dtype
from ..scan_args import ScanArgs
from .common import cdiv, softplus_and_grad, tl_dtype
from .launch import launch_kernel, on_device_of

# Elements of a program's [BD, NP] state tile at most.
TILE = 1024


@triton.jit
def _load_pair(ptr, off, im, mask, ACC: tl.constexpr):
    """(real, imaginary) parts at ptr + off and ptr + off + im."""
    re = tl.load(ptr + off, mask=mask, other=0.0).to(ACC)
    return re, tl.load(ptr + off + im, mask=mask, other=0.0).to(ACC)


@triton.jit
def _pair_or_zeros(ptr, off, mask, PRESENT: tl.constexpr, ACC: tl.constexpr):
    """A complex state's (real, imaginary) parts at ptr + off (adjacent), or zeros where absent."""
    if PRESENT:
        re, im = _load_pair(ptr, off, 1, mask, ACC)
    else:
        re = tl.zeros(mask.shape, ACC)
        im = tl.zeros(mask.shape, ACC)
    return re, im


@triton.jit
def _program_tile(dim, BD: tl.constexpr, NP: tl.constexpr, DSTATE: tl.constexpr):
    """(block, sequence, channels [BD], states [1, NP], channels in range [BD], elements in
    range [BD, NP]) of this program. Sequences share axis 0 with the blocks of channels: no
    65,535-program limit on the batch."""
    blocks = tl.cdiv(dim, BD)
    pid = tl.program_id(0).to(tl.int64)
    blk, b = pid % blocks, pid // blocks
    ch = blk * BD + tl.arange(0, BD)
    n = tl.arange(0, NP)[None, :].to(tl.int64)
    row = ch < dim
    return blk, b, ch, n, row, row[:, None] & (n < DSTATE)


@triton.jit
def _store_pair(ptr, off, re, im, mask):
    tl.store(ptr + off, re, mask=mask)
    tl.store(ptr + off + 1, im, mask=mask)


@triton.jit
def _decay(dt, Ar, Ai):
    """exp(delta_t A) as (real, imaginary), [BD, NP]."""
    mag = tl.exp(dt[:, None] * Ar)
    angle = dt[:, None] * Ai
    return mag * tl.cos(angle), mag * tl.sin(angle)


@triton.jit
def _step(u_ptr, delta_ptr, B_ptr, bias, Ar, Ai, row_u, row_d, B_off, t, s_ut, s_dt, s_Bt, s_Bi,
          row, mask, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
          ACC: tl.constexpr):  # fmt: skip
    """Step t of the tile's rows, what the forward and both passes of the backward read: u_t,
    delta_t after bias and softplus, softplus' derivative [BD]; exp(delta_t A) (real,
    imaginary), B_t (real, imaginary) [BD, NP]; delta_t u_t [BD, 1]."""
    uu = tl.load(u_ptr + row_u + t * s_ut, mask=row, other=0.0).to(ACC)
    dt = tl.load(delta_ptr + row_d + t * s_dt, mask=row, other=0.0).to(ACC)
    if HAS_BIAS:
        dt += bias
    dsoft = tl.full(dt.shape, 1.0, ACC)
    if SOFTPLUS:
        dt, dsoft = softplus_and_grad(dt, False)
    ar, ai = _decay(dt, Ar, Ai)
    Br, Bi = _load_pair(B_ptr, B_off + t * s_Bt, s_Bi, mask, ACC)
    return uu, dt, dsoft, ar, ai, Br, Bi, (dt * uu)[:, None]


@triton.jit
def _advance(hr, hi, ar, ai, Br, Bi, x):
    """h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, as (real, imaginary) [BD, NP]."""
    return ar * hr - ai * hi + x * Br, ar * hi + ai * hr + x * Bi


@triton.jit
def _channel_constants(A_ptr, D_ptr, bias_ptr, b, ch, n, row, mask, B_group, C_group, s_Ad,
                       s_An, s_Bb, s_Bg, s_Bd, s_Bn, s_Cb, s_Cg, s_Cd, s_Cn, s_D, s_bias,
                       HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """What stays fixed along the sequence for channels ch ([BD]) of sequence b: A (real,
    imaginary) [BD, NP]; the offsets of B_t and C_t at step 0 [BD, NP] (step t adds t * s_t:
    variable ones by sequence, group and state, constant ones by channel and state, s_t = 0);
    delta_bias and D [BD]."""
    rows = ch[:, None]
    Ar, Ai = _load_pair(A_ptr, rows * s_Ad + n * s_An, 1, mask, ACC)
    B_off = b * s_Bb + (ch // B_group)[:, None] * s_Bg + rows * s_Bd + n * s_Bn
    C_off = b * s_Cb + (ch // C_group)[:, None] * s_Cg + rows * s_Cd + n * s_Cn
    bias = tl.load(bias_ptr + ch * s_bias, mask=row, other=0.0).to(ACC) if HAS_BIAS else 0.0
    Dv = tl.load(D_ptr + ch * s_D, mask=row, other=0.0).to(ACC) if HAS_D else 0.0
    return Ar, Ai, B_off, C_off, bias, Dv


@triton.jit
def _complex_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr,
    out_ptr, last_ptr, ckpt_ptr,
    dim, seqlen, B_group, C_group,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_Ad, s_An,
    s_Bb, s_Bg, s_Bd, s_Bn, s_Bt, s_Bi, s_Cb, s_Cg, s_Cd, s_Cn, s_Ct, s_Ci,
    s_D, s_bias, s_hb, s_hd, s_hn, s_ob, s_od, s_ot, s_lb, s_ld, s_ln, s_kb, s_kd, s_kc, s_kn,
    DSTATE: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    _blk, b, ch, n, row, mask = _program_tile(dim, BD, NP, DSTATE)
    rows = ch[:, None]
    Ar, Ai, B_off, C_off, bias, Dv = _channel_constants(
        A_ptr, D_ptr, bias_ptr, b, ch, n, row, mask, B_group, C_group, s_Ad, s_An, s_Bb, s_Bg,
        s_Bd, s_Bn, s_Cb, s_Cg, s_Cd, s_Cn, s_D, s_bias, HAS_D, HAS_BIAS, ACC,
    )  # fmt: skip
    hr, hi = _pair_or_zeros(h0_ptr, b * s_hb + rows * s_hd + n * s_hn, mask, HAS_H0, ACC)
    row_u, row_d, row_z, row_o = (
        b * s_ub + ch * s_ud,
        b * s_db + ch * s_dd,
        b * s_zb + ch * s_zd,
        b * s_ob + ch * s_od,
    )
    ckpt_off = b * s_kb + rows * s_kd + n * s_kn
    # int64 steps: a step times a stride passes 2^31 in long channels-last rows.
    for t in tl.range(b * 0, b * 0 + seqlen):
        if t % CHUNK == 0:  # the state entering each chunk
            _store_pair(ckpt_ptr, ckpt_off + (t // CHUNK) * s_kc, hr, hi, mask)
        uu, _, _, ar, ai, Br, Bi, x = _step(
            u_ptr, delta_ptr, B_ptr, bias, Ar, Ai, row_u, row_d, B_off, t, s_ut, s_dt, s_Bt,
            s_Bi, row, mask, HAS_BIAS, SOFTPLUS, ACC,
        )  # fmt: skip
        hr, hi = _advance(hr, hi, ar, ai, Br, Bi, x)
        Cr, Ci = _load_pair(C_ptr, C_off + t * s_Ct, s_Ci, mask, ACC)
        y = 2.0 * tl.sum(Cr * hr - Ci * hi, axis=1)
        if HAS_D:
            y += Dv * uu
        if HAS_Z:
            zz = tl.load(z_ptr + row_z + t * s_zt, mask=row, other=0.0).to(ACC)
            y = y * zz / (1.0 + tl.exp(-zz))
        tl.store(out_ptr + row_o + t * s_ot, y.to(out_ptr.dtype.element_ty), mask=row)
    _store_pair(last_ptr, b * s_lb + rows * s_ld + n * s_ln, hr, hi, mask)


@triton.jit
def _complex_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, dlast_ptr,
    ckpt_ptr, scratch_ptr, du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr,
    dbias_ptr, dh0_ptr,
    dim, seqlen, B_group, C_group,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_Ad, s_An,
    s_Bb, s_Bg, s_Bd, s_Bn, s_Bt, s_Bi, s_Cb, s_Cg, s_Cd, s_Cn, s_Ct, s_Ci,
    s_D, s_bias, s_gb, s_gd, s_gt, s_lb, s_ld, s_ln, s_kb, s_kd, s_kc, s_kn,
    DSTATE: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_DLAST: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    # Outputs (contiguous, ACC unless said): du, ddelta, dz (batch, dim, seqlen) in their
    # inputs' dtypes; dA and constant dB/dC (batch, dim, NP, 2) per sequence; variable dB/dC
    # (batch, blocks, NP, seqlen, 2) per block of BD channels (of one group); dD, ddelta_bias
    # (batch, dim); dh0 (batch, dim, NP, 2). Scratch: (batch, blocks, CHUNK + 1, BD, NP, 2).
    blk, b, ch, n, row, mask = _program_tile(dim, BD, NP, DSTATE)
    blocks = tl.cdiv(dim, BD)
    rows = ch[:, None]
    Ar, Ai, B_off, C_off, bias, Dv = _channel_constants(
        A_ptr, D_ptr, bias_ptr, b, ch, n, row, mask, B_group, C_group, s_Ad, s_An, s_Bb, s_Bg,
        s_Bd, s_Bn, s_Cb, s_Cg, s_Cd, s_Cn, s_D, s_bias, HAS_D, HAS_BIAS, ACC,
    )  # fmt: skip
    gr, gi = _pair_or_zeros(dlast_ptr, b * s_lb + rows * s_ld + n * s_ln, mask, HAS_DLAST, ACC)
    zero = tl.zeros((BD, NP), ACC)
    dAr, dAi, dBr, dBi, dCr, dCi = zero, zero, zero, zero, zero, zero
    dD = tl.zeros((BD,), ACC)
    dbias = tl.zeros((BD,), ACC)
    row_u, row_d, row_z = b * s_ub + ch * s_ud, b * s_db + ch * s_dd, b * s_zb + ch * s_zd
    row_g, row_out = b * s_gb + ch * s_gd, b * dim * seqlen + ch * seqlen
    ckpt_off = b * s_kb + rows * s_kd + n * s_kn
    # Slot s of the scratch holds the state after step t0 + s - 1 of the chunk at t0.
    tile = (tl.arange(0, BD)[:, None] * NP + n) * 2
    scratch = scratch_ptr + (b * blocks + blk) * (CHUNK + 1) * BD * NP * 2
    per_sequence = (b * dim + rows) * NP * 2 + n * 2  # dA, constant dB/dC, dh0
    part_row = ((b * blocks + blk) * NP + tl.arange(0, NP).to(tl.int64)) * seqlen * 2  # [NP]
    state_ok = tl.arange(0, NP) < DSTATE
    n_chunks = tl.cdiv(seqlen, CHUNK)
    for c_rev in range(n_chunks):
        c = n_chunks - 1 - c_rev
        t0 = b * 0 + c * CHUNK  # int64, as the forward's steps
        steps = tl.minimum(seqlen - t0, CHUNK)
        hr, hi = _load_pair(ckpt_ptr, ckpt_off + c * s_kc, 1, mask, ACC)
        _store_pair(scratch, tile, hr, hi, mask)
        for s in range(steps):
            t = t0 + s
            _, _, _, ar, ai, Br, Bi, x = _step(
                u_ptr, delta_ptr, B_ptr, bias, Ar, Ai, row_u, row_d, B_off, t, s_ut, s_dt, s_Bt,
                s_Bi, row, mask, HAS_BIAS, SOFTPLUS, ACC,
            )  # fmt: skip
            hr, hi = _advance(hr, hi, ar, ai, Br, Bi, x)
            _store_pair(scratch, tile + (s + 1) * BD * NP * 2, hr, hi, mask)
        tl.debug_barrier()  # the states are read back by other threads of the program
        for s_rev in range(steps):
            s = steps - 1 - s_rev
            t = t0 + s
            pr, pi = _load_pair(scratch, tile + s * BD * NP * 2, 1, mask, ACC)
            hr, hi = _load_pair(scratch, tile + (s + 1) * BD * NP * 2, 1, mask, ACC)
            uu, dt, dsoft, ar, ai, Br, Bi, x = _step(
                u_ptr, delta_ptr, B_ptr, bias, Ar, Ai, row_u, row_d, B_off, t, s_ut, s_dt, s_Bt,
                s_Bi, row, mask, HAS_BIAS, SOFTPLUS, ACC,
            )  # fmt: skip
            Cr, Ci = _load_pair(C_ptr, C_off + t * s_Ct, s_Ci, mask, ACC)
            dpre = tl.load(dout_ptr + row_g + t * s_gt, mask=row, other=0.0).to(ACC)
            if HAS_Z:
                pre = 2.0 * tl.sum(Cr * hr - Ci * hi, axis=1)
                if HAS_D:
                    pre += Dv * uu
                zz = tl.load(z_ptr + row_z + t * s_zt, mask=row, other=0.0).to(ACC)
                sig = 1.0 / (1.0 + tl.exp(-zz))
                dz = dpre * pre * sig * (1.0 + zz * (1.0 - sig))
                tl.store(dz_ptr + row_out + t, dz.to(dz_ptr.dtype.element_ty), mask=row)
                dpre = dpre * zz * sig
            two_dpre = 2.0 * dpre[:, None]
            gr += two_dpre * Cr  # g += 2 dpre conj(C_t)
            gi -= two_dpre * Ci
            # dC_t = 2 dpre conj(h_t), dB_t = delta_t u_t g
            if C_VAR:
                off = part_row + t * 2
                tl.store(dC_ptr + off, tl.sum(two_dpre * hr, axis=0), mask=state_ok)
                tl.store(dC_ptr + off + 1, -tl.sum(two_dpre * hi, axis=0), mask=state_ok)
            else:
                dCr += two_dpre * hr
                dCi -= two_dpre * hi
            if B_VAR:
                off = part_row + t * 2
                tl.store(dB_ptr + off, tl.sum(x * gr, axis=0), mask=state_ok)
                tl.store(dB_ptr + off + 1, tl.sum(x * gi, axis=0), mask=state_ok)
            else:
                dBr += x * gr
                dBi += x * gi
            ddtu = tl.sum(Br * gr + Bi * gi, axis=1)  # Re(conj(B_t) g)
            dar, dai = pr * gr + pi * gi, pr * gi - pi * gr  # conj(h_{t-1}) g
            dtc = dt[:, None]
            dAr += dtc * (ar * dar + ai * dai)  # conj(delta_t a_t) da
            dAi += dtc * (ar * dai - ai * dar)
            qr, qi = Ar * ar - Ai * ai, Ar * ai + Ai * ar  # A a_t
            ddt = tl.sum(qr * dar + qi * dai, axis=1) + ddtu * uu
            du = ddtu * dt
            if HAS_D:
                du += Dv * dpre
                dD += dpre * uu
            ddt = ddt * dsoft
            dbias += ddt
            tl.store(du_ptr + row_out + t, du.to(du_ptr.dtype.element_ty), mask=row)
            tl.store(ddelta_ptr + row_out + t, ddt.to(ddelta_ptr.dtype.element_ty), mask=row)
            gr, gi = ar * gr + ai * gi, ar * gi - ai * gr  # conj(a_t) g
        tl.debug_barrier()  # the next chunk overwrites the scratch
    _store_pair(dA_ptr, per_sequence, dAr, dAi, mask)
    if not B_VAR:
        _store_pair(dB_ptr, per_sequence, dBr, dBi, mask)
    if not C_VAR:
        _store_pair(dC_ptr, per_sequence, dCr, dCi, mask)
    if HAS_D:
        tl.store(dD_ptr + b * dim + ch, dD, mask=row)
    if HAS_BIAS:
        tl.store(dbias_ptr + b * dim + ch, dbias, mask=row)
    if HAS_H0:
        _store_pair(dh0_ptr, per_sequence, gr, gi, mask)


def _real(t: Tensor) -> Tensor:
    """A complex tensor as its real view (..., 2); real ones as they are."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _bc_arguments(t: Tensor, dim: int) -> tuple[Tensor, int, tuple]:
    """(tensor, channels per group, strides (sequence, group, channel, state, step, imaginary
    part)) of B or C as the kernels read it: a constant one complex (dim, dstate) by channel,
    a variable one real (batch, [groups,] dstate, 2 * seqlen) by group."""
    if t.dim() == 2:
        r = _real(t)
        return r, dim, (0, 0, r.stride(0), r.stride(1), 0, 1)
    g = t if t.dim() == 4 else t.unsqueeze(1)
    s_b, s_g, s_n, s_t = g.stride()
    return g, dim // g.shape[1], (s_b, s_g, 0, s_n, 2 * s_t, s_t)


def _tiles(args: ScanArgs) -> tuple[int, int]:
    """(NP, BD): the states padded to a power of two, and channels a program: a power of two
    dividing the channels of a group of each variable B/C (a program's partial sums over its
    channels then belong to one group), at most TILE / NP."""
    dim, dstate = args.u.shape[1], args.A.shape[1]
    NP = triton.next_power_of_2(dstate)
    groups = [t.shape[1] if t.dim() == 4 else 1 for t in (args.B, args.C) if t.dim() > 2]
    per_group = math.gcd(*(dim // g for g in groups)) if groups else 0
    BD = max(1, min(16, TILE // NP))
    while per_group and per_group % BD:
        BD //= 2
    return NP, BD


def _common(args: ScanArgs, BD: int) -> tuple[dict, dict, dict]:
    """The tensors, scalars and options both kernels take."""
    u, delta, A, B, C, D, z, bias, _, _ = args.tensors
    dim = u.shape[1]
    Bv, B_group, s_B = _bc_arguments(B, dim)
    Cv, C_group, s_C = _bc_arguments(C, dim)
    Ar = _real(A)
    unused = u.new_empty((0,))
    tensors = dict(u_ptr=u, delta_ptr=delta, A_ptr=Ar, B_ptr=Bv, C_ptr=Cv,
                   D_ptr=unused if D is None else D, z_ptr=unused if z is None else z,
                   bias_ptr=unused if bias is None else bias)  # fmt: skip
    s_z = (0, 0, 0) if z is None else z.stride()
    scalars = dict(
        dim=dim, seqlen=u.shape[2], B_group=B_group, C_group=C_group,
        **dict(zip(("s_ub", "s_ud", "s_ut"), u.stride(), strict=True)),
        **dict(zip(("s_db", "s_dd", "s_dt"), delta.stride(), strict=True)),
        **dict(zip(("s_zb", "s_zd", "s_zt"), s_z, strict=True)),
        s_Ad=Ar.stride(0), s_An=Ar.stride(1),
        **dict(zip(("s_Bb", "s_Bg", "s_Bd", "s_Bn", "s_Bt", "s_Bi"), s_B, strict=True)),
        **dict(zip(("s_Cb", "s_Cg", "s_Cd", "s_Cn", "s_Ct", "s_Ci"), s_C, strict=True)),
        s_D=0 if D is None else D.stride(0), s_bias=0 if bias is None else bias.stride(0),
    )  # fmt: skip
    options = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=bias is not None,
                   SOFTPLUS=args.delta_softplus, BD=BD, num_warps=4)  # fmt: skip
    return tensors, scalars, options


# Launchers of eager calls (launch.Launcher: direct launches on CUDA tensors), by kernel, the
# tensors' dtypes (a Launcher tells its compiled kernels apart by device and alignment only) and
# every other argument; emptied when 256 are held, as the plan cache is.
_LAUNCHERS: dict[tuple, object] = {}


def _launch(kernel, grid: tuple, tensors: dict, scalars: dict, options: dict) -> None:
    if len(_LAUNCHERS) >= 256:
        _LAUNCHERS.clear()
    dtypes = [t.dtype for t in tensors.values()]
    key = (kernel, grid, *dtypes, *scalars.values(), *options.values())
    with on_device_of(tensors["u_ptr"]):
        launch_kernel(_LAUNCHERS, kernel, grid, tensors, scalars, options, key=key)


def scan_fwd(args: ScanArgs, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """complex_scan.scan_fwd on the Triton kernels: (out (batch, dim, seqlen) in u's dtype,
    last_state (batch, dim, dstate) complex, checkpoints (batch, dim, ceil(seqlen / chunk) + 1,
    dstate) complex, the spare slot zero)."""
    u, A, h0 = args.u, args.A, args.initial_state
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    cdt = compute_dtype(*args.floats)
    sdt = state_dtype(A, cdt)
    NP, BD = _tiles(args)
    out = u.new_empty(u.shape)
    last = u.new_empty((batch, dim, dstate), dtype=sdt)
    ckpt = u.new_zeros((batch, dim, checkpoint_slots(seqlen, chunk), dstate), dtype=sdt)
    last_r, ckpt_r = _real(last), _real(ckpt)
    h0_r = None if h0 is None else _real(h0.to(sdt))
    tensors, scalars, options = _common(args, BD)
    tensors |= dict(h0_ptr=u.new_empty((0,)) if h0_r is None else h0_r, out_ptr=out,
                    last_ptr=last_r, ckpt_ptr=ckpt_r)  # fmt: skip
    s_h = (0, 0, 0) if h0_r is None else h0_r.stride()[:3]
    scalars |= dict(
        **dict(zip(("s_hb", "s_hd", "s_hn"), s_h, strict=True)),
        **dict(zip(("s_ob", "s_od", "s_ot"), out.stride(), strict=True)),
        **dict(zip(("s_lb", "s_ld", "s_ln"), last_r.stride()[:3], strict=True)),
        **dict(zip(("s_kb", "s_kd", "s_kc", "s_kn"), ckpt_r.stride()[:4], strict=True)),
    )  # fmt: skip
    options |= dict(DSTATE=dstate, NP=NP, CHUNK=chunk, HAS_H0=h0 is not None, ACC=tl_dtype(cdt))
    _launch(_complex_scan_fwd_kernel, (cdiv(dim, BD) * batch, 1, 1), tensors, scalars, options)
    return out, last, ckpt


def _per_sequence_sum(part: Tensor, like: Tensor, dstate: int) -> Tensor:
    """(batch, dim, NP, 2) partials summed over the batch: like's (dim, dstate) complex."""
    return torch.view_as_complex(part.sum(0)[:, :dstate].contiguous()).to(like.dtype)


def _bc_grad(part: Tensor, t: Tensor, dstate: int) -> Tensor:
    """The gradient of B or C from the backward kernel's partials: per sequence (batch, dim,
    NP, 2) for a constant t, per block of channels (batch, blocks, NP, seqlen, 2) for a
    variable one, whose blocks are summed by group, parts interleaved in time."""
    if t.dim() == 2:
        return _per_sequence_sum(part, t, dstate)
    batch, blocks, NP, seqlen, _ = part.shape
    groups = 1 if t.dim() == 3 else t.shape[1]
    sums = part.view(batch, groups, blocks // groups, NP, seqlen * 2).sum(2)[:, :, :dstate]
    return sums.reshape(t.shape).to(t.dtype).contiguous()


def scan_bwd(dout: Tensor, dlast_state: Tensor | None, args: ScanArgs, checkpoints: Tensor,
             chunk: int) -> tuple:  # fmt: skip
    """complex_scan.scan_bwd on the Triton kernels, from the forward's checkpoints (every
    ``chunk`` steps): (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in
    its input's shape and dtype, an empty tensor for absent optional inputs."""
    u, delta, A, B, C, D, z, bias, h0, _ = args.tensors
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    cdt = compute_dtype(*args.floats)
    sdt = state_dtype(A, cdt)
    NP, BD = _tiles(args)
    blocks = cdiv(dim, BD)

    def acc(*shape):
        return u.new_empty(shape, dtype=cdt)

    def bc_part(t):
        return acc(batch, blocks, NP, seqlen, 2) if t.dim() > 2 else acc(batch, dim, NP, 2)

    du, ddelta = u.new_empty(u.shape), delta.new_empty(u.shape)
    dz = u.new_empty((0,)) if z is None else z.new_empty(u.shape)
    dA, dB, dC, dh0 = acc(batch, dim, NP, 2), bc_part(B), bc_part(C), acc(batch, dim, NP, 2)
    dD, dbias = acc(batch, dim), acc(batch, dim)
    scratch = acc(batch, blocks, chunk + 1, BD, NP, 2)
    dlast = None if dlast_state is None else _real(dlast_state.to(sdt))
    ckpt = _real(checkpoints)
    tensors, scalars, options = _common(args, BD)
    tensors |= dict(
        dout_ptr=dout, dlast_ptr=ckpt if dlast is None else dlast, ckpt_ptr=ckpt,
        scratch_ptr=scratch, du_ptr=du, ddelta_ptr=ddelta, dz_ptr=dz, dA_ptr=dA, dB_ptr=dB,
        dC_ptr=dC, dD_ptr=dD, dbias_ptr=dbias, dh0_ptr=dh0,
    )  # fmt: skip
    s_l = (0, 0, 0) if dlast is None else dlast.stride()[:3]
    scalars |= dict(
        **dict(zip(("s_gb", "s_gd", "s_gt"), dout.stride(), strict=True)),
        **dict(zip(("s_lb", "s_ld", "s_ln"), s_l, strict=True)),
        **dict(zip(("s_kb", "s_kd", "s_kc", "s_kn"), ckpt.stride()[:4], strict=True)),
    )  # fmt: skip
    options |= dict(DSTATE=dstate, NP=NP, CHUNK=chunk, HAS_H0=h0 is not None,
                    HAS_DLAST=dlast is not None, B_VAR=B.dim() > 2, C_VAR=C.dim() > 2,
                    ACC=tl_dtype(cdt))  # fmt: skip
    _launch(_complex_scan_bwd_kernel, (blocks * batch, 1, 1), tensors, scalars, options)

    def empty():
        return u.new_empty((0,))

    dinit = None if h0 is None else torch.view_as_complex(dh0[..., :dstate, :].contiguous())
    return (
        du, ddelta, _per_sequence_sum(dA, A, dstate), _bc_grad(dB, B, dstate),
        _bc_grad(dC, C, dstate), empty() if D is None else dD.sum(0).to(D.dtype), dz,
        empty() if bias is None else dbias.sum(0).to(bias.dtype),
        empty() if h0 is None else dinit.to(h0.dtype),
    )  # fmt: skip
