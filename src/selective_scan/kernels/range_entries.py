"""States entering the ranges of a cut sequence, from the ranges' local results.

A sequence cut into ranges (see scan_fwd.py) gets from the local launch, for each range r, the
state its steps leave from a zero start, h_r, and the sum of its delta, s_r. The state entering
range r + 1 is then exp(A s_r) e_r + h_r, with e_0 the initial state: a scan over the ranges
with the scan kernels' own composition (common.combine). The backward runs the same recursion
over its adjoints from the last range down (REVERSE), starting from dlast_state.

This kernel runs that scan once for every (sequence, channel, state), between the local launch
and the full one, and writes e in place of h: the forward's slot r then holds the state entering
range r + 1, the backward's slot r the gradient leaving range r - 1. The full launch loads one
slot. Folding the earlier ranges inside each full-launch program instead repeated the recursion
up to r times per program (quadratic in the range count) on its critical path (design §7).

Program = one sequence x BD channels x NP states (the grid's first axis, blocks fastest, see
common.block_and_sequence). It takes RB ranges a step: one load of their (RB, BD * NP) results,
a scan along the ranges held in one thread, one store; the carry enters through the first row.
"""

import triton
import triton.language as tl

from .common import LOG2E, block_and_sequence, combine


@triton.jit
def _range_entries_kernel(
    hloc_ptr, dtsum_ptr, A_ptr, init_ptr,
    dim, n_ranges, s_Ad, s_An, s_ib, s_id, s_in,
    DSTATE: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr,
    REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    blk, seq, num_seqs = block_and_sequence(dim, BD)
    # The block's channels and states as one axis j (contiguous in the results' rows, so that
    # Triton spreads it over the lanes and keeps the ranges of a (channel, state) in-thread).
    j = tl.arange(0, BD * NP)[None, :]  # [1, BD * NP]
    ch = blk * BD + j // NP
    n = j % NP
    ok = (ch < dim) & (n < DSTATE)
    A2 = tl.load(A_ptr + ch.to(tl.int64) * s_Ad + n * s_An, mask=ok, other=0.0).to(ACC)
    A2 *= tl.full([1, 1], LOG2E, ACC)
    h = tl.zeros([1, BD * NP], ACC)
    if HAS_INIT:
        init = init_ptr + seq.to(tl.int64) * s_ib + ch.to(tl.int64) * s_id + n * s_in
        h = tl.load(init, mask=ok, other=0.0).to(ACC)
    # Per-range results are (ranges, sequences, dim[, NP]), as the scan kernels index them.
    first_row = seq.to(tl.int64) * dim + blk * BD  # this block's first row in range 0
    range_step = num_seqs.to(tl.int64) * dim
    k_idx = tl.arange(0, RB)[:, None]  # [RB, 1]
    steps = n_ranges - 1  # the local launch covers all ranges but one
    for k0 in range(0, steps, RB):  # not pipelined: faster here (design §7)
        k = k0 + k_idx
        live = k < steps
        r = (n_ranges - 1 - k) if REVERSE else k  # the range whose results this row folds in
        rows = first_row + r * range_step  # [RB, 1]
        dtsum = tl.load(dtsum_ptr + rows + j // NP, mask=live & ok, other=0.0)
        slot = hloc_ptr + rows * NP + j
        x = tl.load(slot, mask=live & ok, other=0.0)
        a = tl.math.exp2(A2 * dtsum)
        x = tl.where(k_idx == 0, x + a * h, x)  # rows past the last: a = 1, x = 0
        _, entries = tl.associative_scan((a, x), axis=0, combine_fn=combine)
        tl.store(slot, entries, mask=live & ok)
        h = tl.sum(tl.where(k_idx == RB - 1, entries, 0.0), axis=0)[None, :]
