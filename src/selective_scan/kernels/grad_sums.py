"""The backward's reduced gradients from its partial sums, in one launch, in a fixed order.

The backward kernel (scan_bwd.py) leaves dA, dD and ddelta_bias (and constant dB, dC) as one
partial sum per program, (programs, dim, NP) or (programs, dim), and variable dB, dC as one per
block of channels, (batch, blocks, tiles, NP, T). This kernel adds each set of partials in a
fixed order (deterministic: the same bits run to run) and writes the gradient in its input's
shape and dtype, cut to dstate states and seqlen steps.

Each of the five gradients is a job of the same form: output row r, element m, is the sum over
k < K of ``part[(r * K + k) * M + m]``; m stands for (outer, n, inner) over (M / (NP * T), NP,
T) and lands at ``out[r * s_r + (outer * T + inner) * s_l + n * s_n]`` when n < dstate and
outer * T + inner < length:

| job | R | K | M | NP, T | length | s_r, s_l, s_n |
|---|---|---|---|---|---|---|
| dA, constant dB/dC | 1 | programs | dim * NP | NP, 1 | dim | 0, dstate, 1 |
| variable dB/dC | batch * G | blocks / G | tiles * NP * T | NP, T | seqlen | L, 1, seqlen |
| dD, ddelta_bias | 1 | programs | dim | 1, 1 | dim | 0, 1, 0 |

(G: groups, L = dstate * seqlen.)

A program sums BM consecutive m of one row over all K terms, BK terms a load. Jobs take
consecutive ranges of the grid's one axis (dA, dB, dC, dD, ddelta_bias), which the launcher
sizes and passes as the ranges' ends (kernels/scan.py, grad_sums_launch); an absent one takes
none. One launch instead of seven torch reductions and two copies (design §12).
"""

import triton
import triton.language as tl

GRAD_SUM_ELEMENTS = 4096  # partial values a program loads at once (BK * BM)


@triton.jit
def _sum_job(
    part_ptr, out_ptr, pid, K, M, length, dstate, s_r, s_l, s_n,
    NP: tl.constexpr, T: tl.constexpr, BM: tl.constexpr, ELEMENTS: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    BK: tl.constexpr = ELEMENTS // BM
    m_blocks = tl.cdiv(M, BM)
    row = (pid // m_blocks).to(tl.int64)
    m = (pid % m_blocks) * BM + tl.arange(0, BM)  # int64 where M is (variable dB/dC)
    k = tl.arange(0, BK)
    terms = part_ptr + row * K * M + m[None, :]
    # Summed across the tile's BK rows once, after the loop: summing each load across them
    # (across warps, through shared memory) took S1's and S2's dB and dC 3-4x as long.
    acc = tl.zeros([BK, BM], ACC)
    for k0 in range(0, K, BK):
        kk = k0 + k[:, None]
        x = tl.load(terms + kk.to(tl.int64) * M, mask=(kk < K) & (m[None, :] < M), other=0.0)
        acc += x.to(ACC)
    acc = tl.sum(acc, axis=0)
    n = (m // T) % NP
    step = (m // (NP * T)) * T + m % T
    ok = (m < M) & (n < dstate) & (step < length)
    out = out_ptr + row * s_r + step.to(tl.int64) * s_l + n * s_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _states_job(part, out, pid, programs, dim, dstate, NP: tl.constexpr, BM: tl.constexpr,
                ELEMENTS: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """dA, constant dB or dC: (programs, dim, NP) partials into (dim, dstate)."""
    _sum_job(part, out, pid, programs, dim * NP, dim, dstate, 0, dstate, 1, NP, 1, BM, ELEMENTS,
             ACC)  # fmt: skip


@triton.jit
def _channels_job(part, out, pid, programs, dim, BM: tl.constexpr, ELEMENTS: tl.constexpr,
                  ACC: tl.constexpr):  # fmt: skip
    """dD, ddelta_bias: (programs, dim) partials into (dim,)."""
    _sum_job(part, out, pid, programs, dim, dim, 1, 0, 1, 0, 1, 1, BM, ELEMENTS, ACC)


@triton.jit
def _bc_job(part, out, pid, VAR: tl.constexpr, groups, programs, blocks, dim, dstate, seqlen,
            var_M, var_row, NP: tl.constexpr, T: tl.constexpr, BM_STATES: tl.constexpr,
            BM_STEPS: tl.constexpr, ELEMENTS: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """dB or dC: variable, (batch, blocks, tiles, NP, T) partials summed over each group's
    blocks into (batch, groups, dstate, seqlen); constant, as dA."""
    if VAR:
        _sum_job(part, out, pid, blocks // groups, var_M, seqlen, dstate, var_row, 1, seqlen, NP,
                 T, BM_STEPS, ELEMENTS, ACC)  # fmt: skip
    else:
        _states_job(part, out, pid, programs, dim, dstate, NP, BM_STATES, ELEMENTS, ACC)


# The jobs' ends vary with every size: specialized on their divisibility, each shape would
# compile a kernel of its own.
@triton.jit(do_not_specialize=["end_A", "end_B", "end_C", "end_D"])
def _grad_sums_kernel(
    dA_part, dA, dB_part, dB, dC_part, dC, dD_part, dD, dbias_part, dbias,
    programs, dim, dstate, seqlen, tiles, blocks, B_groups, C_groups, end_A, end_B, end_C, end_D,
    NP: tl.constexpr, T: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, BM_STATES: tl.constexpr,
    BM_STEPS: tl.constexpr, BM_CHANNELS: tl.constexpr, ELEMENTS: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # A variable job's rows (dstate * seqlen outputs, tiles * NP * T partials) may pass 2**31
    # elements, as the backward kernel's offsets into them do: int64.
    var_M = tl.cast(tiles, tl.int64) * (NP * T)  # tl.cast: sizes of 1 come as constants
    var_row = tl.cast(seqlen, tl.int64) * dstate
    if pid < end_A:
        _states_job(dA_part, dA, pid, programs, dim, dstate, NP, BM_STATES, ELEMENTS, ACC)
    elif pid < end_B:
        _bc_job(dB_part, dB, pid - end_A, B_VAR, B_groups, programs, blocks, dim, dstate, seqlen,
                var_M, var_row, NP, T, BM_STATES, BM_STEPS, ELEMENTS, ACC)  # fmt: skip
    elif pid < end_C:
        _bc_job(dC_part, dC, pid - end_B, C_VAR, C_groups, programs, blocks, dim, dstate, seqlen,
                var_M, var_row, NP, T, BM_STATES, BM_STEPS, ELEMENTS, ACC)  # fmt: skip
    elif pid < end_D:
        if HAS_D:
            _channels_job(dD_part, dD, pid - end_C, programs, dim, BM_CHANNELS, ELEMENTS, ACC)
    elif HAS_BIAS:
        _channels_job(dbias_part, dbias, pid - end_D, programs, dim, BM_CHANNELS, ELEMENTS, ACC)
