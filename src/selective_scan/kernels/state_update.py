"""Triton decode step (``selective_state_update``): kernel and launcher.

One program = one (block of BD channels, batch row, head). It holds the [BD, NP] tile of the
state (NP = dstate padded to a power of two) in registers: loads it once, applies
state * exp2(A log2(e) dt) + B dt x in float32 (float64 for float64 inputs), stores it back in
state's dtype, and reduces the same registers against C for the output. A memory-bound kernel:
the state is read and written once; A (dim, dstate) is the same for every batch row, so its
reads after the first row come from L2.

With state_batch_indices, batch row b reads and writes slot state_batch_indices[b] of the state;
a row whose index is outside [0, slots) writes no state and out 0.

No autotuning: the kernel overwrites the state, so a tuning run would corrupt it. The tile
sizes were swept on the H200 instead (``block``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from .._state_update_checks import check_state_update_inputs, heads_strides, out_shape
from .common import LOG2E, block_and_sequence, cdiv, fast_math, sigmoid, softplus, tl_dtype
from .launch import Launcher, on_device_of, runtime_params


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, idx_ptr, out_ptr,
    dim, dstate, heads_per_group, slots,
    # Strides, in the argument order (see heads_strides), then state_batch_indices' and out's.
    s_sb, s_sh, s_sd, s_sn, s_xb, s_xh, s_xd, s_tb, s_th, s_td, s_Ah, s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_Dh, s_Dd, s_zb, s_zh, s_zd, s_bh, s_bd,
    s_i, s_ob, s_oh, s_od,
    NP: tl.constexpr, BD: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_IDX: tl.constexpr, ACC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    # 64-bit row offsets: batch * nheads * dim * dstate may exceed 2^31.
    blk, b, _ = block_and_sequence(dim, BD)
    b = b.to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // heads_per_group
    d = blk * BD + tl.arange(0, BD)
    d_ok = d < dim
    d64 = d.to(tl.int64)
    n = tl.arange(0, NP)
    n_ok = n < dstate
    tile_ok = d_ok[:, None] & n_ok[None, :]

    slot = b
    state_ok = tile_ok
    if HAS_IDX:  # the row's slot; a padding row (outside [0, slots)) touches none
        slot = tl.load(idx_ptr + b * s_i).to(tl.int64)
        kept = (slot >= 0) & (slot < slots)
        slot = tl.where(kept, slot, 0)
        state_ok = tile_ok & kept

    # The state tile first: its load is the one whose latency the others should hide behind.
    # Padded states load 0 with A = B = C = 0: they stay 0 and add nothing to the output.
    state_ptrs = state_ptr + slot * s_sb + h * s_sh + d64[:, None] * s_sd + n[None, :] * s_sn
    state = tl.load(state_ptrs, mask=state_ok, other=0.0).to(ACC)
    x = tl.load(x_ptr + b * s_xb + h * s_xh + d64 * s_xd, mask=d_ok, other=0.0).to(ACC)
    dt = tl.load(dt_ptr + b * s_tb + h * s_th + d64 * s_td, mask=d_ok, other=0.0).to(ACC)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h * s_bh + d64 * s_bd, mask=d_ok, other=0.0).to(ACC)
    if SOFTPLUS:
        dt = softplus(dt, FAST)
    A2 = tl.load(
        A_ptr + h * s_Ah + d64[:, None] * s_Ad + n[None, :] * s_An, mask=tile_ok, other=0.0
    ).to(ACC)
    A2 *= tl.full([1, 1], LOG2E, ACC)  # exact in float64 too (a bare literal is float32)
    B = tl.load(B_ptr + b * s_Bb + g * s_Bg + n * s_Bn, mask=n_ok, other=0.0).to(ACC)
    C = tl.load(C_ptr + b * s_Cb + g * s_Cg + n * s_Cn, mask=n_ok, other=0.0).to(ACC)
    if HAS_D:
        D = tl.load(D_ptr + h * s_Dh + d64 * s_Dd, mask=d_ok, other=0.0).to(ACC)
    if HAS_Z:
        z = tl.load(z_ptr + b * s_zb + h * s_zh + d64 * s_zd, mask=d_ok, other=0.0).to(ACC)

    state = state * tl.math.exp2(A2 * dt[:, None]) + B[None, :] * (dt * x)[:, None]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_ok)

    y = tl.sum(state * C[None, :], axis=1)
    if HAS_D:
        y += x * D
    if HAS_Z:
        y *= z * sigmoid(z, FAST)
    if HAS_IDX:
        y = tl.where(kept, y, 0.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d64 * s_od, y.to(out_ptr.dtype.element_ty), mask=d_ok)


# The kernel's tensor parameters, then its scalar ones (each a value of _plan's, in order).
_TENSORS = runtime_params(_state_update_kernel)[:11]
_SCALARS = runtime_params(_state_update_kernel)[11:]


def block(dstate) -> tuple[int, int, int]:
    """(NP = dstate padded to a power of two, BD channels per program, num_warps): a tile of
    2048 states per 4-warp program, 16 per thread, the best of bench/tune_decode.py's sweep on
    the H200 at dstate 16 (design §8). Plain comparisons: for a symbolic dstate they
    become guards, so the tile sizes are always Python ints."""
    NP = 1
    while dstate > NP:
        NP *= 2
    return NP, max(2048 // NP, 1), 4


def _plan(
    state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices=None
) -> tuple[tuple, tuple, dict]:
    """Check the arguments and derive the launch from them: (grid, the integer arguments after
    out, the compile-time options). Reads only the arguments' shapes, strides, dtypes and
    devices (see ``_layout``)."""
    idx = state_batch_indices
    batch, nheads, dim, dstate, ngroups, cdt = check_state_update_inputs(
        state, x, dt, A, B, C, D, z, dt_bias, idx
    )
    NP, BD, num_warps = block(dstate)
    values = (
        dim, dstate, nheads // ngroups, state.shape[0],
        *heads_strides(state, x, dt, A, B, C, D, z, dt_bias), 0 if idx is None else idx.stride(0),
        nheads * dim, dim, 1,  # out: fresh and contiguous, in either form
    )  # fmt: skip
    scalars = dict(zip(_SCALARS, values, strict=True))
    options = dict(
        NP=NP, BD=BD,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus, HAS_IDX=idx is not None, ACC=tl_dtype(cdt),
        FAST=fast_math(x, cdt), num_warps=num_warps,
    )  # fmt: skip
    # Batch rows share the first axis with the blocks of channels (common.block_and_sequence):
    # the other axes allow 65535 programs, fewer than a batch may have rows.
    return (cdiv(dim, BD) * batch, nheads, 1), scalars, options


def _new_out(state: Tensor, x: Tensor) -> Tensor:
    return x.new_empty(out_shape(state, x))  # contiguous


def state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """Triton decode step, the body of ``selective_scan::state_update_triton``: updates state in
    place and returns out (x's dtype, the state's form); see ``selective_state_update``.
    Traceable: the kernel goes through ``wrap_triton``."""
    grid, scalars, options = _plan(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices
    )
    out = _new_out(state, x)
    tensors = (state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out)
    with on_device_of(x):
        wrap_triton(_state_update_kernel)[grid](**dict(zip(_TENSORS, tensors, strict=True)),
                                                **scalars, **options)  # fmt: skip
    return out


# Launchers of plain eager calls by ``_layout``, each with its plan. A decode loop repeats a
# handful of layouts; checking and planning again for every token was half of a call's Python
# time, and Triton's argument binding most of the rest (see launch.py). Emptied when full, to
# stay small. A plan keeps the FAST option it was made with (it reads TRITON_INTERPRET; both
# are correct).
_PLANS: dict[tuple, Launcher] = {}
_MAX_PLANS = 256


def _layout(tensors: tuple, dt_softplus: bool) -> tuple:
    """Everything ``_plan`` reads: each tensor's shape, strides, dtype and device (None for an
    absent one), and dt_softplus. Data pointers are not part of a plan (the launcher keeps a
    compiled kernel per alignment of the pointers, as Triton specializes on it)."""
    return (
        dt_softplus,
        *[None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors],
    )


def state_update_eager(*args) -> Tensor:
    """``state_update`` for plain eager calls (every argument a real Tensor or None): launches
    the compiled kernel directly, without the dispatcher, the tracing wrapper and Triton's
    argument binding, with the launcher of an earlier call of the same layout (see
    ``selective_state_update``). A call whose arguments fail the checks raises in ``_plan`` and
    leaves no launcher behind."""
    *tensors, dt_softplus, state_batch_indices = args
    tensors = (*tensors, state_batch_indices)  # the kernel's order
    key = _layout(tensors, dt_softplus)
    launcher = _PLANS.get(key)
    if launcher is None:
        launcher = Launcher(_state_update_kernel, *_plan(*args))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = launcher
    out = _new_out(tensors[0], tensors[1])
    with on_device_of(out):
        launcher(dict(zip(_TENSORS, (*tensors, out), strict=True)))
    return out
