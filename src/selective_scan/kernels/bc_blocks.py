"""Pre-blocking of variable B and C for the scan kernels, in one launch for both.

A source (batch, [groups,] dstate, seqlen) with any strides becomes contiguous (batch, groups,
tiles, NP, T) blocks in the compute dtype, zero past seqlen and past dstate: the layout whose
(state, tile) rows the scan kernels load as whole aligned vectors (see kernels/layout.py,
bc_blocks). Program (row, k, which) writes the k-th TILES tiles of row batch * G + group (G
the larger group count of the two sources) of B (which = 0) or C (which = 1). Rows lie on the
grid's first axis, whose limit is 2^31 - 1 programs (65535 on the others).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def _block_rows(
    src_ptr, dst_ptr, row, G, groups, s_b, s_g, s_n, s_t, seqlen, dstate, tiles,
    NP: tl.constexpr, T: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    batch = (row // G).to(tl.int64)
    group = (row % G).to(tl.int64)
    tile = (tl.program_id(1) * TILES + tl.arange(0, TILES))[:, None, None]
    n = tl.arange(0, NP)[None, :, None]
    step = tl.arange(0, T)[None, None, :]
    t = tile * T + step
    ok = (group < groups) & (tile < tiles)  # rows past this source's groups: nothing
    src = src_ptr + batch * s_b + group * s_g + n * s_n + t.to(tl.int64) * s_t
    x = tl.load(src, mask=ok & (n < dstate) & (t < seqlen), other=0.0)
    dst = dst_ptr + (((batch * groups + group) * tiles + tile) * NP + n) * T + step
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bc_blocks_kernel(
    Bsrc_ptr, Csrc_ptr, Bb_ptr, Cb_ptr,
    seqlen, dstate, tiles, G, B_groups, s_Bb, s_Bg, s_Bn, s_Bt, C_groups, s_Cb, s_Cg, s_Cn, s_Ct,
    NP: tl.constexpr, T: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the scan launched after this one may start (see kernels/plan.py, ScanPlan.pdl)
        gdc_launch_dependents()
    row = tl.program_id(0)
    if tl.program_id(2) == 0:
        _block_rows(Bsrc_ptr, Bb_ptr, row, G, B_groups, s_Bb, s_Bg, s_Bn, s_Bt, seqlen, dstate,
                    tiles, NP, T, TILES)  # fmt: skip
    else:
        _block_rows(Csrc_ptr, Cb_ptr, row, G, C_groups, s_Cb, s_Cg, s_Cn, s_Ct, seqlen, dstate,
                    tiles, NP, T, TILES)  # fmt: skip
