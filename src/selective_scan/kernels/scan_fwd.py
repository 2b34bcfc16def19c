"""Forward selective-scan kernel.

One program = one sequence (a batch row, or one packed sequence of cu_seqlens) x BLOCK channels,
in a tile of BD >= BLOCK rows (see common.block_channels).
It walks the sequence in tiles of T steps; for each of the NI states a thread holds it computes
exp2(delta * A * log2(e)), delta * u * B, runs the recurrence along the tile in-thread from the
carried state, and accumulates C * h into y. y is summed over the NS lanes of a channel, then
out = (y + D u) * silu(z) is stored. The state entering every CKPT-th step is stored as a
checkpoint for the backward; the final state is stored as last_state.

Variable B and C arrive pre-blocked as float32 (batch, groups, seqlen / T, NP, T) tiles (see
`bc_block_tensors`): one aligned, unmasked vector load per (state, tile), no conversion in the loop.

Few (batch, channel) pairs leave most of the GPU idle, so a sequence can also be cut into
ranges of RL steps processed by separate programs (program axis 2), in three launches:
LOCAL=True runs each range but the last from a zero state and stores only its end state and
sum(delta); the range entries' launch (range_entries.py) turns those into the state entering
each range (the state entering range r + 1 is exp(A sum(delta_r)) h_in(r) + h_local(r)); the
full launch then starts range r from it.

With PRE (a launch of few warps, see tiles.fwd_tiles), each program first writes delta after
its bias and softplus for its rows to a scratch, PRE steps at a time, and the tile loop reads
that. With PDL (eager calls, see plan.ScanPlan.pdl) the launch may start while the B/C blocking
launch before it runs: programs wait for it (gdc_wait) after the PRE pass, before the tile loop
reads the blocks.

The output's epilogue (D u, the gate silu(z), the store) takes y summed over a channel's lanes,
which the sum leaves in every lane. By default it runs in the layout Triton gives [BD, 1, T]
tiles (the steps spread over the lanes), which it reaches from the sum's through shared memory.
With EPI, lane k of a channel selects steps [k T / NS, (k + 1) T / NS) of its copy in
registers and runs the epilogue on those.

Steps outside [start, end) of the sequence (the head of the first tile, the tail of the last)
get delta = 0, i.e. exp(0 * A) = 1 and no input: they carry the state through unchanged.

Loads and stores of T-step tiles are 16-byte vectors only where Triton knows that row offsets
and range bounds are multiples of T; otherwise it lays the time axis across lanes, 3-5x slower.
Its launch-time specialization knows multiples of 16 (ALIGN 0). ALIGN 1 declares multiples of
T where the launcher knows them (see ALIGN in kernels/layout.py, which also covers traced calls,
whose sizes are symbolic). The backward does the same.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .common import (
    LOG2E,
    block_and_sequence,
    block_channels,
    combine,
    delta_tile,
    load_states,
    masked_pick,
    pick,
    put,
    row_offset,
    sigmoid,
    store_states,
    tile_masks,
    time_tile,
)


@triton.jit
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr, cu_ptr,
    out_ptr, last_ptr, ckpt_ptr, hloc_ptr, dtsum_ptr, pre_ptr,
    dim, seqlen, RL, n_ranges,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_Ad, s_An,
    tiles, B_groups, B_group, s_Bd, s_Bn, C_groups, C_group, s_Cd, s_Cn,
    s_D, s_bias, s_hb, s_hd, s_hn,
    s_ob, s_od, s_kb, s_kd, s_kc, s_lb, s_ld,
    DSTATE: tl.constexpr, NS: tl.constexpr, NI: tl.constexpr, BD: tl.constexpr,
    BLOCK: tl.constexpr, T: tl.constexpr, CKPT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, VARLEN: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    ACC: tl.constexpr, FAST: tl.constexpr, STAGES: tl.constexpr, LOCAL: tl.constexpr,
    PRE: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr, WIDE: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    ALIGNED: tl.constexpr = ALIGN == 1  # see ALIGN in kernels/layout.py
    WHOLE: tl.constexpr = WIDE and ALIGNED  # load whole tiles (see tile_masks)
    blk, seq, num_seqs = block_and_sequence(dim, BLOCK)
    rng = tl.program_id(2)
    if VARLEN:  # one range per sequence
        start = tl.load(cu_ptr + seq).to(tl.int32)
        end = tl.load(cu_ptr + seq + 1).to(tl.int32)
        batch = (seq * 0).to(tl.int64)
    else:
        start = rng * RL
        end = tl.minimum(seqlen, start + RL)
        if ALIGNED and not WIDE:  # RL is a multiple of CKPT, seqlen one of T: uniform masks
            start = tl.multiple_of(start, T)
            end = tl.multiple_of(end, T)
        batch = seq.to(tl.int64)

    blk_first = (blk * BLOCK).to(tl.int64)  # first channel of the block
    ch, ch_ok = block_channels(blk, dim, BD, BLOCK)
    ch64 = ch.to(tl.int64)[:, None, None]  # [BD, 1, 1]
    row_ok = ch_ok[:, None, None]
    lane = tl.arange(0, NS)[None, :, None]  # [1, NS, 1]
    i_idx = tl.arange(0, NI)[None, None, :]  # [1, 1, NI]
    t_idx = tl.arange(0, T)[None, None, :]  # [1, 1, T]

    first_n = lane * NI  # [1, NS, 1]
    n_left = DSTATE - first_n
    A2 = load_states(A_ptr + ch64 * s_Ad + first_n * s_An, s_An, n_left, NI, row_ok, ACC)
    A2 *= tl.full([1, 1, 1], LOG2E, ACC)  # exact in float64 too (a bare literal is fp32)
    # State entering this range: the initial state, or for later ranges the one left in
    # their slot of the local results by the range entries' launch (range_entries.py).
    # Per-range results are (ranges, sequences, dim[, NP]): no stride depends on the range
    # count (a symbolic one made Inductor copy these buffers, see kernels/plan.py).
    range_row = seq.to(tl.int64) * dim + ch64  # [BD, 1, 1]: this block's rows of range 0
    range_step = num_seqs.to(tl.int64) * dim
    h = tl.zeros([BD, NS, NI], ACC)
    if not LOCAL:
        if rng > 0:
            entry = hloc_ptr + (range_row + (rng - 1) * range_step) * (NS * NI) + first_n
            h = load_states(entry, 1, n_left, NI, row_ok, ACC)
        elif HAS_H0:
            h0 = h0_ptr + seq.to(tl.int64) * s_hb + ch64 * s_hd + first_n * s_hn
            h = load_states(h0, s_hn, n_left, NI, row_ok, ACC)
    # B/C: constant (dim, dstate) with strides (s_Bd, s_Bn), or blocks (layout.bc_block_tensors)
    # whose offsets are multiples of T by construction, which lets Triton emit aligned vector loads.
    # B/C tiles are loaded once per program ([1, NS, T]), not once per channel: with the loop
    # software-pipelined, they pass through shared memory and every channel reads them there.
    ch_in = tl.minimum(blk_first, dim - 1)
    if B_VAR:
        B_row = B_ptr + ((batch * B_groups + ch_in // B_group) * tiles) * (NS * NI * T)
        B_row += lane * (NI * T)  # [1, NS, 1]: this lane's first state
    else:
        B_const = load_states(B_ptr + ch64 * s_Bd + first_n * s_Bn, s_Bn, n_left, NI, row_ok, ACC)
    if C_VAR:
        C_row = C_ptr + ((batch * C_groups + ch_in // C_group) * tiles) * (NS * NI * T)
        C_row += lane * (NI * T)
    else:
        C_const = load_states(C_ptr + ch64 * s_Cd + first_n * s_Cn, s_Cn, n_left, NI, row_ok, ACC)
    if HAS_D:
        Dv = tl.load(D_ptr + ch64 * s_D, mask=row_ok, other=0.0).to(ACC)
    bias = tl.zeros([BD, 1, 1], ACC)  # unused without delta_bias
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch64 * s_bias, mask=row_ok, other=0.0).to(ACC)
    u_row = u_ptr + row_offset(batch, s_ub, ch64, s_ud, T, ALIGNED)
    dt_row = delta_ptr + row_offset(batch, s_db, ch64, s_dd, T, ALIGNED)
    if HAS_Z:
        z_row = z_ptr + row_offset(batch, s_zb, ch64, s_zd, T, ALIGNED)
    out_row = out_ptr + row_offset(batch, s_ob, ch64, s_od, T, ALIGNED)
    ckpt_tile = ckpt_ptr + batch * s_kb + ch64 * s_kd + first_n

    SHARED_DT: tl.constexpr = PRE > 0 and not LOCAL
    if SHARED_DT:
        # delta's per-step work (bias, softplus) once per (channel, step), spread over all the
        # lanes of the program, into rows of the compute dtype laid out like out's; the tile
        # loop then loads it, where each of a channel's NS lanes would repeat it for every step
        # (S6, 4 lanes: 876 -> 618 SASS instructions a tile, 104 -> 72 MUFU; design §9).
        pre_row = pre_ptr + row_offset(batch, s_ob, ch64, s_od, T, ALIGNED)
        for p0 in tl.range((start // T) * T, end, PRE, num_stages=STAGES):
            tp = p0 + tl.arange(0, PRE)[None, None, :]  # [1, 1, PRE]
            mp, lmp = tile_masks(row_ok, tp, start, end, seqlen, T, WHOLE)
            dp = delta_tile(dt_row, tp.to(tl.int64), s_dt, mp, lmp, bias, HAS_BIAS, SOFTPLUS,
                            ACC, FAST, WHOLE)[0]  # fmt: skip
            # Only this program's steps: a packed neighbour's share this row's whole tiles,
            # and the loop zeroes steps outside its own range after loading them.
            tl.store(pre_row + tp.to(tl.int64), dp, mask=mp)
        tl.debug_barrier()  # the loop's lanes read what other lanes of the program wrote
    if PDL:  # launched while the B/C blocking launch runs: the loop reads its blocks
        gdc_wait()
    dt_total = tl.zeros([BD, 1, T], ACC)
    for t0 in tl.range((start // T) * T, end, T, num_stages=STAGES):
        t = t0 + t_idx
        t64 = t.to(tl.int64)
        m, lm = tile_masks(row_ok, t, start, end, seqlen, T, WHOLE)  # [BD, 1, T]
        if not LOCAL and (t0 % CKPT == 0) & (t0 >= start):
            store_states(ckpt_tile + (t0 // CKPT) * s_kc, 1, n_left, h, NI, row_ok)
        if SHARED_DT:
            dt = time_tile(pre_row, t64, 1, m, lm, ACC, WHOLE)
        else:
            dt = delta_tile(dt_row, t64, s_dt, m, lm, bias, HAS_BIAS, SOFTPLUS, ACC, FAST,
                            WHOLE)[0]  # fmt: skip
        dt_total += dt
        uu = time_tile(u_row, t64, s_ut, m, lm, ACC, WHOLE)
        dtu = dt * uu
        y = tl.zeros([BD, NS, T], ACC)
        for i in tl.static_range(NI):
            a = tl.math.exp2(dt * pick(A2, i_idx, i)[:, :, None])
            if B_VAR:
                b_i = tl.load(B_row + (t0 // T) * (NS * NI * T) + i * T + t_idx).to(ACC)
            else:
                b_i = pick(B_const, i_idx, i)[:, :, None]
            # Fold the carried state into the first step; the scan then needs no decay products.
            x = dtu * b_i
            x = tl.where(t_idx == 0, x + a * pick(h, i_idx, i)[:, :, None], x)
            _, hs = tl.associative_scan((a, x), axis=2, combine_fn=combine)
            h = put(h, i_idx, i, pick(hs, t_idx, T - 1))
            if not LOCAL:
                if C_VAR:
                    c_i = tl.load(C_row + (t0 // T) * (NS * NI * T) + i * T + t_idx).to(ACC)
                else:
                    c_i = pick(C_const, i_idx, i)[:, :, None]
                y += hs * c_i
        if not LOCAL:
            out = tl.sum(y, axis=1)[:, None, :]  # every lane of a channel holds the sum
            t_out, m_out, lm_out = t64, m, lm
            if EPI:
                # Lane k keeps steps [k Q, (k + 1) Q) of its own copy: a select in registers,
                # where the default reaches the [BD, 1, T] layout through shared memory.
                Q: tl.constexpr = T // NS
                out = tl.broadcast_to(out, [BD, NS, T])
                if HAS_D:
                    out += Dv * uu
                parts = tl.reshape(out, [BD, NS, NS, Q])  # [channel, lane, part, step]
                part = tl.arange(0, NS)[None, None, :, None]
                out = masked_pick(parts, lane[:, :, :, None] == part, 2)
                t_q = t0 + lane * Q + tl.arange(0, Q)[None, None, :]  # [1, NS, Q]
                m_out, lm_out = tile_masks(row_ok, t_q, start, end, seqlen, T, WHOLE)
                t_out = t_q.to(tl.int64)
            elif HAS_D:
                out += Dv * uu
            if HAS_Z:
                zz = time_tile(z_row, t_out, s_zt, m_out, lm_out, ACC, WHOLE)
                out *= zz * sigmoid(zz, FAST)
            tl.store(out_row + t_out, out.to(out_ptr.dtype.element_ty), mask=m_out)
    if LOCAL:
        store_states(hloc_ptr + (range_row + rng * range_step) * (NS * NI) + first_n, 1, n_left,
                     h, NI, row_ok)  # fmt: skip
        tl.store(dtsum_ptr + range_row + rng * range_step, tl.sum(dt_total, axis=2)[:, :, None],
                 mask=row_ok)  # fmt: skip
    else:
        last_ok = row_ok & (rng == n_ranges - 1)
        store_states(last_ptr + seq.to(tl.int64) * s_lb + ch64 * s_ld + first_n, 1, n_left, h, NI,
                     last_ok)  # fmt: skip
        # The spare checkpoint slot (see checkpoint_slots) gets the state after the last step,
        # written by the one program whose non-empty range ends there.
        spare_ok = row_ok & (end == seqlen) & (start < end)
        store_states(ckpt_tile + ((seqlen + CKPT - 1) // CKPT) * s_kc, 1, n_left, h, NI, spare_ok)
