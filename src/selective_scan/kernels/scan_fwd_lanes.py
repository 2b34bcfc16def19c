"""Forward selective-scan kernel for short sequences in launches of few channels (see LANES in
kernels/tiles.py, fwd_tiles): a channel's steps across the lanes of a warp.

One program (one warp) = BD = 32 / LANES channels of one sequence of at most LANES * T steps.
Thread (c, l) holds steps [l T, (l + 1) T) of channel c, so the per-step work (delta's bias
and softplus, the gate, the store) runs once per step, and the states are walked in a loop. For
each state: the decays exp(delta A) and inputs delta u B of the thread's T steps; their
composition across the channel's lanes (a scan of one (decay, input) pair per lane, with the
state entering the sequence at lane 0); the recurrence through the thread's steps from the
state entering them; y += C h. Then out = (y + D u) * silu(z). The states after steps 128 k - 1
(CKPT) are the checkpoints, the state after the last lane's steps is last_state.

Why: scan_fwd.py keeps a channel's steps in one thread and its states across lanes, so each
sequence is a chain of tiles through one warp. S6 (5120 channels, 256 steps) gives it 640 warps
for 528 schedulers, each walking 16 tiles: bound by the chain's latency (design §4). Here S6 is
2560 warps of 16 states each, about five a scheduler.

Layout. Triton loads a thread's share of a 1-D tensor as 16-byte vectors (V = 8 steps of a
16-bit input, 4 of float32), so a [BD, LANES * T] load would spread a thread's steps over
lanes. Each per-step tensor (u, delta, z, and B/C, read in place with their strides) is
therefore loaded flat, with an index e whose vector j, thread i and repeat r (e = r * 32 V +
i V + j) map to channel c = i // LANES, step (i % LANES) T + r V + j; reshaped and permuted to
[BD, LANES * T], each thread then holds its T steps in order (`_in_lanes`; no data moves). This
holds only where every load is whole vectors (kernels/tiles.py, lanes_fit). bfloat16 B/C rows
load as int32 pairs of steps (`_bc_rows`). B/C rows are shared by a group's channels: its first
programs prefetch them into L2 (`_prefetch_rows`).

The recurrence over a thread's steps and across lanes is inline PTX (FAST): Triton's
associative_scan takes only blocked layouts, and converting these tiles into one went through
shared memory at every state. The interpreter (and float64) run associative_scan instead.
"""

import triton
import triton.language as tl

from .common import LOG2E, block_and_sequence, combine, sigmoid, softplus

LANES_STEPS = (16, 16)  # (LANES, T): the one shape the PTX below is written for


def scan_ptx(lanes: int, steps: int) -> str:
    """PTX of one state's recurrence over a thread's steps: outputs $0..steps-1 (h), inputs a
    ($steps..), x (next steps), the state entering the sequence (next steps, first used, lane 0
    of a channel only), log2 of the thread's total decay (next steps, first used).
    Pass 1 composes the thread's steps into (P, X); a scan of those over the channel's lanes
    (shfl.up within segments of `lanes`) gives the state entering each thread; pass 2 runs the
    recurrence from it."""
    a = [f"${steps + s}" for s in range(steps)]
    x = [f"${2 * steps + s}" for s in range(steps)]
    h0, log_p = f"${3 * steps}", f"${4 * steps}"
    segment = (32 - lanes) << 8  # shfl's segment mask: lanes-wide sub-warps, clamped at 0
    lines = [
        "{",
        ".reg .f32 P, X, pu, xu, hin, h0;",
        ".reg .u32 ln;",
        ".reg .pred p, first;",
        "mov.u32 ln, %laneid;",
        f"and.b32 ln, ln, {lanes - 1};",
        "setp.eq.u32 first, ln, 0;",
        f"selp.f32 h0, {h0}, 0f00000000, first;",
        f"fma.rn.f32 X, {a[0]}, h0, {x[0]};",
        *(f"fma.rn.f32 X, {a[s]}, X, {x[s]};" for s in range(1, steps)),
        f"ex2.approx.ftz.f32 P, {log_p};",
    ]
    d = 1
    while d < lanes:
        lines += [
            f"shfl.sync.up.b32 xu|p, X, {d}, {segment}, 0xffffffff;",
            f"shfl.sync.up.b32 pu, P, {d}, {segment}, 0xffffffff;",
            "@p fma.rn.f32 X, P, xu, X;",
            "@p mul.f32 P, P, pu;",
        ]
        d *= 2
    lines += [
        f"shfl.sync.up.b32 hin|p, X, 1, {segment}, 0xffffffff;",
        f"@!p mov.f32 hin, {h0};",
        f"fma.rn.f32 $0, {a[0]}, hin, {x[0]};",
        *(f"fma.rn.f32 ${s}, {a[s]}, ${s - 1}, {x[s]};" for s in range(1, steps)),
        "}",
    ]
    # One line: Inductor copies the kernel's globals into its generated source as literals,
    # and a newline inside one breaks that source (a SyntaxError).
    return " ".join(lines)


_PTX = tl.constexpr(scan_ptx(*LANES_STEPS))
_CONSTRAINTS = tl.constexpr(",".join(["=f"] * LANES_STEPS[1] + ["f"] * (4 * LANES_STEPS[1])))


@triton.jit
def _flat_steps(blk, dim, seqlen, V: tl.constexpr, BD: tl.constexpr, LANES: tl.constexpr,
                S: tl.constexpr):  # fmt: skip
    """(channel, step, in bounds) of each element of the flat index of V-element vectors (see
    the docstring)."""
    e = tl.arange(0, BD * LANES * S)
    i = (e // V) % 32
    ch = blk * BD + i // LANES
    t = (i % LANES) * S + (e // (32 * V)) * V + e % V
    return ch, t, (ch < dim) & (t < seqlen)


@triton.jit
def _in_lanes(x, V: tl.constexpr, BD: tl.constexpr, LANES: tl.constexpr, S: tl.constexpr):
    """Flat-indexed x as [BD, LANES * S] (channel, step)."""
    x = tl.permute(tl.reshape(x, [S // V, BD, LANES, V]), [1, 2, 0, 3])
    return tl.reshape(x, [BD, LANES * S])


@triton.jit
def _flat(x, V: tl.constexpr, BD: tl.constexpr, LANES: tl.constexpr, S: tl.constexpr):
    """The inverse of _in_lanes."""
    x = tl.permute(tl.reshape(x, [BD, LANES, S // V, V]), [2, 0, 1, 3])
    return tl.reshape(x, [BD * LANES * S])


@triton.jit
def _offsets(V: tl.constexpr, blk, dim, seqlen, s_d, s_t, per_group, BD: tl.constexpr,
             LANES: tl.constexpr, S: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """Offsets and mask of the program's rows of a per-step input loaded in the flat index of
    V-element vectors (channel c's row at (c // per_group) s_d, channels past dim read the
    last one's). FULL (a whole chunk of steps): no mask."""
    ch, t, ok = _flat_steps(blk, dim, seqlen, V, BD, LANES, S)
    offs = (tl.minimum(ch, dim - 1) // per_group).to(tl.int64) * s_d + t.to(tl.int64) * s_t
    if FULL:  # a constant mask: the load drops it
        ok = tl.full([BD * LANES * S], True, tl.int1)
    return offs, ok


@triton.jit
def _steps(ptr, blk, dim, seqlen, s_d, s_t, ACC: tl.constexpr, BD: tl.constexpr,
           LANES: tl.constexpr, S: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """The program's rows of a per-step input (ptr at its sequence, channel stride s_d) as
    [BD, LANES * S] in ACC, 0 past seqlen. Loaded in the flat index of its own dtype's
    vectors (V elements): the layout after _in_lanes is then the same for all."""
    V: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth  # a 16-byte vector
    offs, ok = _offsets(V, blk, dim, seqlen, s_d, s_t, 1, BD, LANES, S, FULL)
    return _in_lanes(tl.load(ptr + offs, mask=ok, other=0.0).to(ACC), V, BD, LANES, S)


@triton.jit
def _bc_offsets(ptr, blk, dim, seqlen, s_g, s_t, per_group, BD: tl.constexpr,
                LANES: tl.constexpr, S: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """Offsets and mask of the program's B or C rows (channel c's at (c // per_group) s_g) in
    the flat index of _bc_rows' loads: bfloat16 rows as int32 pairs of steps (unit step
    stride, even strides: lanes_fit), others as elements."""
    if ptr.dtype.element_ty == tl.bfloat16:
        offs, ok = _offsets(4, blk, dim, seqlen // 2, s_g // 2, 1, per_group, BD, LANES, S // 2,
                            FULL)  # fmt: skip
    else:
        V: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
        offs, ok = _offsets(V, blk, dim, seqlen, s_g, s_t, per_group, BD, LANES, S, FULL)
    return offs, ok


@triton.jit
def _bc_rows(row, offs, ok, ACC: tl.constexpr, BD: tl.constexpr, LANES: tl.constexpr,
             S: tl.constexpr):  # fmt: skip
    """One state's B or C rows (row: the state's start) as [BD, LANES * S] in ACC. bfloat16
    is widened by bit operations, one a step, where Triton's conversion takes 1.5 (PRMT and SHF
    for the high half of each pair; design §4)."""
    if row.dtype.element_ty == tl.bfloat16:
        x = tl.load(row.to(tl.pointer_type(tl.int32), bitcast=True) + offs, mask=ok, other=0)
        x = _in_lanes(x, 4, BD, LANES, S // 2)
        low = (x << 16).to(tl.float32, bitcast=True)
        high = (x & -65536).to(tl.float32, bitcast=True)  # 0xffff0000
        rows = tl.reshape(tl.join(low, high), [BD, LANES * S])
    else:
        V: tl.constexpr = 128 // row.dtype.element_ty.primitive_bitwidth
        rows = _in_lanes(tl.load(row + offs, mask=ok, other=0.0), V, BD, LANES, S)
    return rows.to(ACC)


@triton.jit
def _lane_ends(x, BD: tl.constexpr, LANES: tl.constexpr, S: tl.constexpr):
    """[BD, LANES]: x at each thread's last step, by halving splits (register picks)."""
    x = tl.reshape(x, [BD, LANES, S])
    for _ in tl.static_range(4):  # log2(S), S = 16
        x = tl.reshape(x, [BD, LANES, x.shape[2] // 2, 2])
        _, x = tl.split(x)
    return tl.reshape(x, [BD, LANES])


@triton.jit
def _prefetch_rows(ptr, k, s_n, s_t, rows, LPR):
    """Prefetch into L2 lines k * 32 + lane of rows ptr + n s_n (n < rows) of LPR lines."""
    j = k * 32 + tl.arange(0, 32)
    STEPS: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # a line's steps
    line = ptr + (j // LPR) * s_n + ((j % LPR) * STEPS).to(tl.int64) * s_t
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.ne.u32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [line, (j < rows * LPR).to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _bc_row(ptr, batch, ch, per_group, s_b, s_g, blk, BD: tl.constexpr):
    """Start of the B/C rows (batch, group, :, :) of channel ch, and the program's rank among
    those of its group (they share its rows)."""
    group = ch // per_group
    first_blk = (blk * BD // per_group) * per_group // BD
    return ptr + batch * s_b + group.to(tl.int64) * s_g, blk - first_blk


@triton.jit
def _scan_fwd_lanes_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr,
    out_ptr, last_ptr, ckpt_ptr,
    dim, seqlen,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_Ad, s_An,
    B_group, s_Bb, s_Bg, s_Bn, s_Bt, C_group, s_Cb, s_Cg, s_Cn, s_Ct,
    s_D, s_bias, s_hb, s_hd, s_hn,
    s_ob, s_od, s_kb, s_kd, s_kc, s_lb, s_ld,
    DSTATE: tl.constexpr, NS: tl.constexpr, NI: tl.constexpr, BD: tl.constexpr,
    BLOCK: tl.constexpr, T: tl.constexpr, CKPT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, VARLEN: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    ACC: tl.constexpr, FAST: tl.constexpr, LANES: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    # The arguments are the subset of scan_fwd.py's that this kernel uses (one plan builds both;
    # launch.kernel_arguments passes each kernel its own). B and C come as they are, with their
    # strides (see layout.lanes_bc_scalars). Ranges, packed sequences, the PRE pass and EPI do
    # not apply here (see tiles.fwd_tiles).
    tl.static_assert((LANES == 16) & (T == 16) & (BD * LANES == 32) & (BLOCK == BD))
    tl.static_assert(not VARLEN)
    tl.static_assert(B_VAR & C_VAR)  # see lanes_fit
    S: tl.constexpr = T
    DSTATE_P2: tl.constexpr = NS * NI  # the states padded to a power of two
    CH: tl.constexpr = LANES * S
    blk, seq, _ = block_and_sequence(dim, BD)
    batch = seq.to(tl.int64)
    ch = blk * BD + tl.arange(0, BD)[:, None]  # [BD, 1]
    row_ok = ch < dim
    ch64 = ch.to(tl.int64)
    in_bounds = row_ok & (tl.arange(0, CH)[None, :] < seqlen)

    if FAST:
        # Every channel of a group reads the group's B/C rows, state after state: from cold
        # lines, all its warps would wait on DRAM at each state. The group's first programs
        # prefetch all of them into L2 at once (design §4).
        # The interpreter has no PTX.
        B_lines = (seqlen * B_ptr.dtype.element_ty.primitive_bitwidth + 1023) // 1024
        C_lines = (seqlen * C_ptr.dtype.element_ty.primitive_bitwidth + 1023) // 1024
        B_start, k = _bc_row(B_ptr, batch, blk * BD, B_group, s_Bb, s_Bg, blk, BD)
        if k * 32 < DSTATE * B_lines:
            _prefetch_rows(B_start, k, s_Bn, s_Bt, DSTATE, B_lines)
        C_start, k = _bc_row(C_ptr, batch, blk * BD, C_group, s_Cb, s_Cg, blk, BD)
        if k * 32 < DSTATE * C_lines:
            _prefetch_rows(C_start, k, s_Cn, s_Ct, DSTATE, C_lines)

    u_seq = u_ptr + batch * s_ub
    dt = _steps(delta_ptr + batch * s_db, blk, dim, seqlen, s_dd, s_dt, ACC, BD, LANES, S, FULL)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + ch64 * s_bias, mask=row_ok, other=0.0).to(ACC)
    if SOFTPLUS:
        dt = softplus(dt, FAST)
    dt = tl.where(in_bounds, dt, 0.0)  # steps past the end carry the state: exp(0 A) = 1
    uu = _steps(u_seq, blk, dim, seqlen, s_ud, s_ut, ACC, BD, LANES, S, FULL)
    dtu = dt * uu
    if FAST:
        dt_sums = tl.sum(tl.reshape(dt, [BD, LANES, S]), axis=2)  # [BD, LANES]

    # B/C rows' offsets computed once (per state, they took 40 of 246 instructions, offline
    # SASS).
    B_seq = B_ptr + batch * s_Bb
    C_seq = C_ptr + batch * s_Cb
    B_offs, B_ok = _bc_offsets(B_ptr, blk, dim, seqlen, s_Bg, s_Bt, B_group, BD, LANES, S, FULL)
    C_offs, C_ok = _bc_offsets(C_ptr, blk, dim, seqlen, s_Cg, s_Ct, C_group, BD, LANES, S, FULL)
    lane = tl.arange(0, LANES)[None, :]  # [1, LANES]
    ckpt_row = ckpt_ptr + batch * s_kb + ch64 * s_kd  # [BD, 1]
    slot = (lane + 1) * S // CKPT  # the checkpoint after this lane's steps, if any
    slot_ok = row_ok & ((lane + 1) * S % CKPT == 0) & (slot <= (seqlen + CKPT - 1) // CKPT)
    last_row = last_ptr + seq.to(tl.int64) * s_lb + ch64 * s_ld + lane * 0  # [BD, LANES]
    # Checkpoint slot 0: the state entering step 0.
    states = tl.arange(0, DSTATE_P2)[None, :]
    states_ok = row_ok & (states < DSTATE)
    if HAS_H0:
        h0s = tl.load(h0_ptr + batch * s_hb + ch64 * s_hd + states * s_hn, mask=states_ok)
        h0s = h0s.to(ACC)
        tl.store(ckpt_row + states, h0s, mask=states_ok)
    else:
        tl.store(ckpt_row + states, tl.zeros([BD, DSTATE_P2], ACC), mask=states_ok)
    h0 = tl.zeros([BD, 1], ACC)
    # Each state's B row and A are loaded one state ahead: their latency was a third of the
    # loop's stalls (ncu, design §4).
    b_next = _bc_rows(B_seq, B_offs, B_ok, ACC, BD, LANES, S)
    A_next = tl.load(A_ptr + ch64 * s_Ad, mask=row_ok, other=0.0).to(ACC)
    # y starts at D u, from the u loaded for delta u, instead of reloading u in the epilogue.
    y = tl.zeros([BD, CH], ACC)
    if HAS_D:
        y += tl.load(D_ptr + ch64 * s_D, mask=row_ok, other=0.0).to(ACC) * uu
    if FAST & HAS_Z:
        # z's rows into L2 now that delta's and u's loads are in: from DRAM, the epilogue's
        # first use of z waits with every warp at once; prefetched at the start, with delta's
        # and u's loads, it costs as much as it saves (design §4).
        z_lines = (seqlen * z_ptr.dtype.element_ty.primitive_bitwidth + 1023) // 1024
        z_rows = z_ptr + batch * s_zb + (blk * BD).to(tl.int64) * s_zd
        _prefetch_rows(z_rows, 0, s_zd, s_zt, tl.minimum(BD, dim - blk * BD), z_lines)
    for n in tl.range(0, DSTATE):
        b = b_next
        A2 = A_next * tl.full([1, 1], LOG2E, ACC)  # exact in float64 (a bare literal is fp32)
        n1 = tl.minimum(n + 1, DSTATE - 1)
        b_next = _bc_rows(B_seq + n1 * s_Bn, B_offs, B_ok, ACC, BD, LANES, S)
        c = _bc_rows(C_seq + n * s_Cn, C_offs, C_ok, ACC, BD, LANES, S)
        A_next = tl.load(A_ptr + ch64 * s_Ad + n1 * s_An, mask=row_ok, other=0.0).to(ACC)
        if HAS_H0:
            h0 = tl.load(h0_ptr + batch * s_hb + ch64 * s_hd + n * s_hn, mask=row_ok,
                         other=0.0).to(ACC)  # fmt: skip
        a = tl.math.exp2(dt * A2)
        x = dtu * b
        if FAST:
            # A in the lanes' layout picked from the steps' (register picks): taken from A2
            # itself, it would be loaded twice a state, once a layout.
            A2_lanes = _lane_ends(tl.broadcast_to(A2, [BD, CH]), BD, LANES, S)
            log_p = tl.reshape(tl.broadcast_to((dt_sums * A2_lanes)[:, :, None], [BD, LANES, S]),
                               [BD, CH])  # fmt: skip
            hs = tl.inline_asm_elementwise(
                _PTX,
                _CONSTRAINTS,
                [a, x, tl.broadcast_to(h0, [BD, CH]), log_p],
                dtype=tl.float32,
                is_pure=True,
                pack=S,
            )
        else:
            first = tl.arange(0, CH)[None, :] == 0
            _, hs = tl.associative_scan((a, tl.where(first, x + a * h0, x)), axis=1,
                                        combine_fn=combine)  # fmt: skip
        y += hs * c
        ends = _lane_ends(hs, BD, LANES, S)  # [BD, LANES]
        tl.store(ckpt_row + slot * s_kc + n, ends, mask=slot_ok)
        tl.store(last_row + n, ends, mask=row_ok & (lane == LANES - 1))
    out = y
    if HAS_Z:
        zz = _steps(z_ptr + batch * s_zb, blk, dim, seqlen, s_zd, s_zt, ACC, BD, LANES, S, FULL)
        out *= zz * sigmoid(zz, FAST)
    V: tl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth
    ch_f, t_f, ok_f = _flat_steps(blk, dim, seqlen, V, BD, LANES, S)
    out_ptrs = out_ptr + batch * s_ob + ch_f.to(tl.int64) * s_od + t_f.to(tl.int64)
    tl.store(out_ptrs, _flat(out, V, BD, LANES, S).to(out_ptr.dtype.element_ty), mask=ok_f)
