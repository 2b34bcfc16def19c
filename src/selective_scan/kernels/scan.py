"""Launchers of the Triton scan kernels: the bodies of the ``*_triton`` ops.

They only allocate outputs and launch kernels through ``wrap_triton`` (no data-dependent
Python), so Inductor can trace them and compile the kernels into its generated code.

Memory: the forward saves nothing beyond its outputs; checkpoints hold the state every CKPT
steps, batch * dim * (ceil(seqlen / CKPT) + 1) * dstate float32 (for CKPT = 128, dstate = 16
that is 0.5 bytes per (batch, dim, step), a quarter of a bf16 input). The backward's scratch adds
partial sums of dB/dC per block of channels: batch * ceil(dim / BD) * dstate * seqlen * 4 bytes
each for variable B/C (2 for bfloat16 B/C, see `bc_part_dtype`), and per program the entry
states of the tiles of one chunk (for 16-bit inputs also their delta and softplus', KEEP_STEPS
in bwd_config).
Lengths that are not a multiple of T (see `config` and `bwd_config`) add a padded copy of each
per-step input and output while a call runs (see `padded`).
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import NamedTuple

import torch
import triton
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_int
from torch.library import wrap_triton

from .._checks import (
    check_cu_seqlens_values,
    check_scan_grads,
    check_scan_inputs,
    checkpoint_slots,
    compute_dtype,
)
from .bc_blocks import _bc_blocks_kernel
from .grad_sums import GRAD_SUM_ELEMENTS, _grad_sums_kernel
from .launch import Launcher, is_plain_eager
from .range_entries import _range_entries_kernel
from .scan_bwd import _scan_bwd_kernel
from .scan_fwd import _scan_fwd_kernel
from .scan_fwd_lanes import LANES_STEPS, _scan_fwd_lanes_kernel

CKPT = 128  # checkpoint interval (steps) of the Triton backend


def cdiv(a, b):
    """Ceiling division for ints and SymInts, b > 0 (triton.cdiv is a JIT function: slow to
    call). Each operand appears once: as (a + b - 1) // b, the nested divisions of `ranges`
    repeated their symbolic divisors into a 4x longer sympy expression. Compiled with dynamic
    shapes on CPU, a reduction over range-sized partial sums then took 10.9 s against 7.4-8.7,
    a tensor shaped by the ranges 111 s against 27-29 (tests/test_triton_interpreter.py)."""
    return -(-a // b)


def _sym_min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_min(a, b)


def _sym_max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_max(a, b)


# How a launch gets the divisibility its T-step vectors need (the kernels' ALIGN, see
# scan_fwd.py): from Triton's launch-time specialization (multiples of 16), declared by the
# launcher (sizes known, multiples of T), or, while traced with symbolic sizes (Inductor passes
# them with no divisibility), checked at run time: ALIGN_CHECKED launches both kernels with
# complementary grids (`checked_launches`).
ALIGN_PLAIN, ALIGN_DECLARED, ALIGN_CHECKED = 0, 1, 2


def align_mode(T: int, wide: bool, rows, *row_strides) -> int:
    """The ALIGN of a launch whose rows hold `rows` steps and start at multiples of these
    strides. WIDE launches (packed sequences, padded rows) always want the declaration when it
    holds: only the declaring body loads whole tiles (tile_masks in common.py)."""
    sizes = (rows, *row_strides)
    if not all(isinstance(v, int) for v in sizes):
        return ALIGN_CHECKED
    if not all(v % T == 0 for v in sizes) or (all(v % 16 == 0 for v in sizes) and not wide):
        return ALIGN_PLAIN
    return ALIGN_DECLARED


def checked_launches(grid: tuple, T: int, sizes) -> list[tuple[int, tuple]]:
    """(ALIGN, grid) of the launches an ALIGN_CHECKED launch stands for: the declaring kernel
    with the whole grid where all sizes are multiples of T at run time, else the plain one; the
    other gets a grid of no program (a factor of 0 or 1, computed without a guard; launchers
    skip empty grids). One kernel holding both bodies and testing the sizes took the larger
    body's registers: 168 against 128 at S2, 242 against 168 at S7, and so fewer programs a
    wave (S2 0.344 ms compiled against 0.317 eager, S7 0.698 against 0.634; session 18)."""
    off = _sym_min(1, sum(v % T for v in sizes))  # 0: every size a multiple of T
    parts = ((ALIGN_DECLARED, 1 - off), (ALIGN_PLAIN, off))
    return [
        (align, (grid[0] * k, *grid[1:]))
        for align, k in parts
        if not (isinstance(k, int) and k == 0)
    ]


# The fast layout wants rows of whole T-step vectors (ALIGN above). A known length that is not
# a multiple of T gets rows padded to the next multiple: the per-step inputs are copied into
# such rows, outputs are written into them and copied out, and the kernels load whole tiles
# (WIDE). That is one more pass over each per-step tensor, where the unpadded layout cost the
# forward 3.4x and the backward 9x at S1's size with 2049 steps (bench/NOTES.md). Inputs that
# are contiguous in time but whose rows start off multiples of T (views) are copied likewise.
# Inputs strided in time (channels last) are not: their loads are not vectors along time anyway.
# Traced calls (torch.compile, torch.export) pad too when the length is a known int; with a
# symbolic length they keep their rows (padding would guard on seqlen % T) and their alignment
# picks the kernel at run time instead (checked_launches). The copy of misaligned views is for
# eager calls only: a traced view's strides may be symbolic too.


def padded(seqlen, T: int) -> bool:
    """Whether rows of this length are padded (a known length, not a multiple of T)."""
    return isinstance(seqlen, int) and seqlen % T != 0


def restaged(t: Tensor | None, pad: bool, T: int) -> bool:
    """Whether the per-step tensor t (batch, dim, seqlen) is copied into fresh rows: always
    when rows are padded (whole-tile loads read the padding), else when its steps are a
    broadcast (time stride 0: an expanded tensor, such as the gradient of a sum), or when it
    is a real tensor contiguous in time with rows that do not start at multiples of T. Triton
    lays a broadcast load's steps across lanes: the backward's loop doubled to 3958
    instructions per tile, 782 of them shuffles, at S1 (offline SASS). Traced calls copy a
    broadcast too (its stride is a plain 0, no guard): passed as it is, Inductor materialized
    it once for each of the backward's four launches (a local and a full pass, each a pair of
    checked_launches), 31 us each at S1 (session 18)."""
    if t is None:
        return False
    if pad:
        return True
    strides, fake = t.stride(), is_fake(t)
    if type(strides[2]) is int and strides[2] == 0 and (fake or t.shape[2] > 1):
        return True
    return not fake and strides[2] == 1 and (strides[0] % T != 0 or strides[1] % T != 0)


def staged(t: Tensor, p: _Plan) -> Tensor:
    """t (batch, dim, seqlen) copied into fresh rows of the plan's row length."""
    out = new_rows(t, p, t.dtype)
    out.copy_(t)
    return out


def unpadded(t: Tensor, p: _Plan) -> Tensor:
    """An output written by the kernels (see new_rows) as a contiguous tensor."""
    return t.contiguous() if p.pad else t


def new_rows(like: Tensor, p: _Plan, dtype: torch.dtype) -> Tensor:
    """An uninitialized tensor shaped like `like` (batch, dim, seqlen), contiguous, or a view of
    the first seqlen steps of padded rows when the plan pads."""
    if not p.pad:
        return like.new_empty(like.shape, dtype=dtype)
    return like.new_empty((p.batch, p.dim, p.rows), dtype=dtype)[..., : p.seqlen]


def _tl_dtype(dtype: torch.dtype):
    return triton.language.float64 if dtype == torch.float64 else triton.language.float32


def bc_tiles(seqlen, T: int):
    """Time tiles of pre-blocked B/C: ceil(seqlen / T), at least 2, so that no blocked
    dimension has size 1: when torch's ops did the blocking, a symbolic size-1 dimension in
    their views became a guard `tiles != 1` under torch.export, which short dynamic seqlens
    violate. The kernel that blocks now has no views; the rule stays (a spare tile is cheap)."""
    return _sym_max(cdiv(seqlen, T), 2)


class BlockLayout(NamedTuple):
    """What blocking B and C (`bc_blocks`) derives from their shapes and strides alone, which
    plans keep: computing it took a third of a small eager call's host time."""

    shapes: list  # of the blocks, one per variable source
    grid: tuple
    args: tuple  # the launch's scalars
    options: dict  # its constexprs but PDL


def bc_layout(B: Tensor, C: Tensor, T: int, NP: int) -> BlockLayout | None:
    """The BlockLayout of blocking B and C into tiles of T steps and NP states; None when
    neither is variable."""
    var = [t for t in (B, C) if t.dim() > 2]
    if not var:
        return None
    rows4 = [t if t.dim() == 4 else t.unsqueeze(1) for t in var]
    batch, _, dstate, seqlen = rows4[0].shape
    tiles = bc_tiles(seqlen, T)
    G = _sym_max(rows4[0].shape[1], rows4[-1].shape[1])
    per_source = [a for t in (rows4[0], rows4[-1]) for a in (t.shape[1], *t.stride())]
    TILES = max(1, BC_BLOCK_ELEMENTS // (NP * T))
    return BlockLayout(
        shapes=[(batch, t.shape[1], tiles, NP, T) for t in rows4],
        grid=(batch * G, cdiv(tiles, TILES), len(var)),
        args=(seqlen, dstate, tiles, G, *per_source),  # groups and strides of B's, then C's
        options=dict(NP=NP, T=T, TILES=TILES, num_warps=4),
    )


def bc_blocks(
    layout: BlockLayout | None, B: Tensor, C: Tensor, dtype: torch.dtype, launchers=None,
    pdl=False,
) -> tuple:  # fmt: skip
    """(B, C) with each variable one, (batch, [groups,] dstate, seqlen) with any strides, as
    contiguous (batch, groups, bc_tiles(seqlen, T), NP, T) blocks in dtype, zero-padded in time
    and states: every (tile, state) row is T contiguous values the kernels load without masks
    or conversion. ``layout``: ``bc_layout(B, C, T, NP)``. One launch for both
    (kernels/bc_blocks.py): torch's pad and copy took 4 launches, 9.5 us of S6's 37 us forward
    (session 7). Costs one pass over B and C (batch * groups * dstate * seqlen elements each,
    small next to u). Constant B/C pass through."""
    if layout is None:
        return B, C
    var = [t for t in (B, C) if t.dim() > 2]
    blocks = [var[0].new_empty(shape, dtype=dtype) for shape in layout.shapes]
    # One source is read as both; its blocks are written once, the spare output slot gets an
    # empty tensor: a tensor passed twice as a kernel's output is cloned twice when a traced
    # call is functionalized, and the clone kept was the one never written (opcheck of
    # constant B and grouped C failed on the H200; test_blocked_bc_outputs_distinct).
    second = blocks[1] if len(blocks) > 1 else blocks[0].new_empty((0,))
    tensors = (var[0], var[-1], blocks[0], second)
    _launch_kernel(launchers, _bc_blocks_kernel, layout.grid, tensors, layout.args,
                   layout.options | {"PDL": pdl}, key=("bc", pdl))  # fmt: skip
    made = iter(blocks)
    return tuple(next(made) if t.dim() > 2 else t for t in (B, C))


BC_BLOCK_ELEMENTS = 2048  # elements a program of _bc_blocks_kernel writes


def _bc_args(t: Tensor, dim) -> tuple:
    """(groups, channels per group, channel stride, state stride) for the kernels: pre-blocked
    variable B/C (strides implied by the block layout, see bc_blocks), or constant (dim, dstate)."""
    if t.dim() == 2:
        return 1, 1, t.stride(0), t.stride(1)
    groups = 1 if t.dim() == 3 else t.shape[1]
    return groups, dim // groups, 0, 0


def lanes_bc_args(t: Tensor, dim) -> tuple:
    """(channels per group, batch, group, state and step strides) of a variable B or C as the
    lanes kernel reads it, in place (lanes_fit leaves constant ones to the tile kernels)."""
    rows = t if t.dim() == 4 else t.unsqueeze(1)
    return dim // rows.shape[1], *rows.stride()


def _fast_math(u: Tensor, cdt: torch.dtype) -> bool:
    """Use MUFU approximations (inline PTX) for log: float32 on a GPU, not the interpreter."""
    return u.is_cuda and cdt == torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"


def _strides3(t: Tensor | None) -> tuple:
    return (0, 0, 0) if t is None else tuple(t.stride())


def size_hint(v) -> int | None:
    """v if an int; for a symbolic size, its value in the example being traced (None where
    there is none, e.g. a size read from data). Reading it adds no guard."""
    if isinstance(v, int):
        return v
    hint = v.node.hint if isinstance(v, torch.SymInt) else None
    return hint if isinstance(hint, int) else None


# Lanes a channel's padded states split over beyond 16 states, by their padded count: (forward,
# its ranges' local pass, backward, its local pass); counts past 256 take a warp. 16 and fewer
# keep the tiles measured on the H200 (config, bwd_config). Each state a thread holds is an
# unrolled copy of the tile's recurrence: with 64 states in 2 or 4 lanes the forward compiled
# in 52 s (its local pass, 64 a thread, 109 s) and the backward in 85-102 s with 255 registers
# and 912 bytes of spills. The splits were picked from offline sm_90 compiles: per thread at
# most 16 states forward, 8 backward (4 at 64 and 128), where Triton keeps the tile's steps
# in a thread; backward tiles of 8 lanes (4 channels a warp) spread them over lanes (SASS 3-6x
# longer) and are skipped (bench/NOTES.md, session 26).
STATE_LANES = {32: (2, 2, 4, 4), 64: (4, 4, 16, 8), 128: (8, 8, 32, 16), 256: (32, 32, 32, 32)}
FWD, FWD_LOCAL, BWD, BWD_LOCAL = range(4)


def state_lanes(dstate: int, role: int, lanes: int) -> int:
    """Lanes splitting a channel's states in tiles of `role` (FWD ... BWD_LOCAL): `lanes`, or
    the STATE_LANES split where that is more."""
    n_pad = triton.next_power_of_2(dstate)
    if n_pad <= 16:
        return lanes
    return max(lanes, STATE_LANES.get(n_pad, (32,) * 4)[role])


def _tiles(dim, dstate, B: Tensor, C: Tensor, T: int, NS: int, lanes: int = 0) -> dict:
    """T steps per thread; the padded states split as NS lanes x NI per thread; CH channels per
    thread, so a program's tile (num_warps warps) has BD = CH * (32 / NS) * num_warps channel
    rows. For grouped B/C, the BLOCK channels a program covers divide the channels of a group,
    so that a program's B/C tiles and dB/dC partial sums belong to one group (_derive_block).
    LANES (scan_fwd_lanes.py): a channel's steps over that many lanes instead, all states in
    each thread (NS = 1)."""
    n_pad = triton.next_power_of_2(dstate)
    NS = min(NS, n_pad)
    cfg = dict(T=T, NS=NS, NI=n_pad // NS, CH=1, num_warps=1, STAGES=3, LANES=lanes)
    return _derive_block(cfg, dim, B, C)


def config(
    dim,
    dstate,
    dtype: torch.dtype,
    B: Tensor,
    C: Tensor,
    num_states=1,
    seqlen=None,
    varlen=False,
    rows=(),
) -> dict:
    """Tiles of the forward (measured on the H200, bench/NOTES.md, session 6). T = 16 steps per
    thread (two 16-byte vectors of a 16-bit input, four of float32; 8 steps in float64): 10%
    fewer instructions per step than 8 for bf16, 28% for float32 (S1 0.317 -> 0.272 ms, S4 0.673
    -> 0.299). A known length that 16 does not divide but 8 does gets T = 8: rows padded to 16
    took S1's size with 2056 steps 0.560 ms, against 0.310 with T = 8 (session 5). 4 lanes per
    channel, or 2 where programs of 2-lane channels still give TARGET_WARPS warps (S5, S7: 7-8%
    faster; S1, S2: 13-30% slower with 2), or where 4 lanes would cut the sequence into ranges
    (S3 0.394 -> 0.384 ms, session 8: the cut makes the warps, and the per-step work repeated on
    each lane of a channel is halved). Symbolic sizes (torch.compile(dynamic=True),
    torch.export) get T = 16, and lanes, EPI and PRE chosen for the sizes of the example traced
    (`size_hint`), which adds no guard: the graph then runs every size with those tiles (as
    Inductor tunes its own kernels on the example). With 4 lanes always, S3's compiled forward
    took 0.423 ms against 0.354 eager (session 16), 0.360 with the example's tiles (session 17).
    The ranges' local pass (see `ranges`) keeps all states of a channel in one thread (LOCAL_NS
    = 1): it is bound by the SFU, and 4 lanes repeated each step's softplus on every lane (S3
    0.459 -> 0.396 ms, session 8). FINER (see `ranges`) 2: S3 cut into 32 ranges 0.3635 ms, into
    64 with 4 0.3669 (session 12; the backward keeps 4: 1.295 ms, 1.386 with the ranges FINER 2
    gives). PRE (steps a pass, 0: off; see scan_fwd.py): delta's bias and softplus once per step
    before the tile loop, for launches of few warps in one range, where each warp's latency is
    the time: S6 (640 warps) 28.1 -> 26.5 us as a CUDA graph. It costs float32 rows of the
    input's size and their traffic: S1, S2, S4 (4-lane tiles, 1536-2048 warps) 15-19% slower
    with it. EPI (see scan_fwd.py): the output's epilogue on each lane's share of the steps,
    selected in registers, for 2-lane tiles: S7 0.681 -> 0.625 ms, S3 0.363 -> 0.350, S5 0.319
    -> 0.275 (sessions 14, 19); 4-lane tiles lose (S2 0.317 -> 0.381, S4 0.287 -> 0.297, S6
    25.9 -> 27.6-28.2 us as a CUDA graph; session 19). LANES (scan_fwd_lanes.py, a channel's
    steps across 16 lanes) where PRE would be chosen and `lanes_fit` holds (eager, at most 256
    steps, CUDA): S6 as a CUDA graph 21.9-22.1 against 25.8-26.6 us (session 23). `rows`: the
    per-step inputs (u, delta, z), for lanes_fit."""
    T = 16 if dtype.itemsize <= 4 else 8
    if isinstance(seqlen, int) and seqlen % T != 0 and seqlen % (T // 2) == 0:
        T //= 2
    # FINER: the wide tiles' ranges decide below
    both = {"LOCAL_NS": state_lanes(dstate, FWD_LOCAL, 1), "FINER": 2, "PRE": 0, "EPI": 0}
    narrow = _tiles(dim, dstate, B, C, T, NS=state_lanes(dstate, FWD, 2)) | both
    wide = _tiles(dim, dstate, B, C, T, NS=state_lanes(dstate, FWD, 4)) | both
    # Decided on plain ints: comparing SymInts would guard on them.
    states, dims, length, narrow_bd, wide_bd = (
        size_hint(v) for v in (num_states, dim, seqlen, narrow["BLOCK"], wide["BLOCK"])
    )
    if None in (states, dims, narrow_bd, wide_bd):  # sizes known only at run time
        return wide
    wide_plain = dict(wide, BLOCK=wide_bd)
    cut = length is not None and ranges(wide_plain, states, dims, length, varlen)[0] > 1
    if states * cdiv(dims, narrow_bd) >= TARGET_WARPS or cut:
        return narrow | {"EPI": int(narrow["NS"] <= 2)}  # measured on 2-lane tiles only
    few = length is not None and states * cdiv(dims, wide_bd) < TARGET_WARPS // 2
    if few and lanes_fit(dtype, B, C, seqlen, varlen, rows):
        return _tiles(dim, dstate, B, C, 16, NS=1, lanes=16) | both
    if few:
        return wide | {"PRE": PRE_STEPS}
    return wide


def lanes_fit(dtype: torch.dtype, B: Tensor, C: Tensor, seqlen, varlen: bool, rows=()) -> bool:
    """Whether the forward takes scan_fwd_lanes.py (LANES, see config): a known length of at
    most 256 steps (16 lanes x 16) and a multiple of 16, no packed sequences, float32
    arithmetic on a GPU, plain eager calls (traced launches take no register cap, see
    LANES_MAXNREG), variable B and C, and B, C and the per-step inputs `rows` (u, delta, z) in
    16-byte vectors: unit step stride, 16-byte aligned, other strides multiples of 16. Its PTX
    scan needs each thread's steps in its registers in order, which Triton's layouts give only
    when every load is whole vectors: with 7-step rows the lanes kernel was wrong on the H200
    (session 23)."""
    steps = LANES_STEPS[0] * LANES_STEPS[1]
    if not (isinstance(seqlen, int) and seqlen <= steps and seqlen % 16 == 0 and not varlen):
        return False
    if B.dim() == 2 or C.dim() == 2:
        return False
    tensors = [t for t in (B, C, *rows) if t is not None]
    cdt = torch.float64 if torch.float64 in (dtype, B.dtype, C.dtype) else torch.float32
    return (
        _fast_math(B, cdt) and is_plain_eager(tensors) and all(_whole_vectors(t) for t in tensors)
    )


def _whole_vectors(t: Tensor) -> bool:
    """Rows of t load as whole 16-byte vectors (see lanes_fit)."""
    return (
        t.stride(-1) == 1 and all(s % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    )


# The lanes kernel's register cap in eager calls (direct launches; wrap_triton takes none): 96
# registers leave five of its one-warp programs a scheduler, all of S6's 2560 in one wave; 118
# uncapped gave four (S6 as a CUDA graph 28.1 against 25.4 us, session 22).
LANES_MAXNREG = 96
PRE_STEPS = 128  # see config: S6 26.5-26.7 us, 27.1 with 64 steps a pass, 28.1 with 256


def bwd_config(
    dim,
    dstate,
    dtype: torch.dtype,
    B: Tensor,
    C: Tensor,
    num_states=1,
    seqlen=None,
    varlen=False,
    rows=(),  # the forward's (config), unused
) -> dict:
    """Tiles of the backward: one 16-byte vector of a 16-bit input per thread (T = 8; float32
    too, 4 in float64), 4 lanes per channel, for any length. Longer tiles or fewer lanes spill
    its registers (offline SASS: T = 16 a 296-byte stack, 2 lanes 992 shuffles per tile);
    float32 with T = 4 took 2.75 ms at S4 against 1.93 with 8 (session 6), more than padding
    rows costs. KEEP_STEPS (16-bit inputs): the tile walk loads delta and softplus' from the
    scratch (kernels/scan_bwd.py): 5% faster on S1, S2, S3, S5, S7, but S4 (float32) 1.46 ->
    1.68 ms (session 7, not explained). The ranges' local pass takes 2 lanes a channel
    (LOCAL_NS): S3 1.462 -> 1.371 ms, against 1.404 with 1 lane (session 8). BF16_PARTS: see
    `bc_part_dtype`. FINER 4 (see `ranges`): S3 (192 warps, 10 -> 32 ranges) 1.58 -> 1.49 ms
    (session 7)."""
    cfg = _tiles(dim, dstate, B, C, T=8 if dtype.itemsize <= 4 else 4,
                 NS=state_lanes(dstate, BWD, 4))  # fmt: skip
    return cfg | {"KEEP_STEPS": int(dtype.itemsize == 2),
                  "LOCAL_NS": state_lanes(dstate, BWD_LOCAL, 2), "BF16_PARTS": 1,
                  "FINER": 4}  # fmt: skip


def _derive_block(cfg: dict, dim, B: Tensor, C: Tensor) -> dict:
    """BD, the tile's rows (a whole warp's lanes, whatever the channel count), and BLOCK, the
    channels a program covers: BD, or for grouped B/C the largest power of two dividing a
    group's channels where that is fewer, the other rows masked (common.block_channels)."""
    cfg["NI"] = max(cfg.get("NI", 1), 1)
    if cfg.get("LANES"):  # the lanes kernel finds each channel's group itself
        cfg["BD"] = cfg["BLOCK"] = 32 // cfg["LANES"] * cfg["num_warps"]
        return cfg
    cfg["BD"] = block = cfg["CH"] * (32 // cfg["NS"]) * cfg["num_warps"]
    for t in (B, C):
        if t.dim() == 4:
            per_group = dim // t.shape[1]
            block = min(block, per_group & -per_group)  # largest power of two dividing it
    cfg["BLOCK"] = block
    return cfg


# Warps at which a launch keeps the H200's 528 schedulers busy enough (about 4 each).
TARGET_WARPS = 2048
MIN_RANGES = 3  # see ranges


def ranges(cfg: dict, num_states, dim, seqlen, varlen: bool) -> tuple:
    """(number of ranges, range length) a sequence is cut into (see scan_fwd.py): more than one
    only when few (sequence, channel) pairs would leave the GPU idle, and never for packed
    sequences (they bring their own parallelism). Plain integer arithmetic, so that symbolic
    sizes (torch.compile(dynamic=True), torch.export) get the same ranges as eager without any
    guard, and compiled and eager results agree bit for bit."""
    chunks = cdiv(seqlen, CKPT)
    if varlen:
        return 1, chunks * CKPT
    warps = num_states * cdiv(dim, cfg["BLOCK"]) * cfg["num_warps"]
    # A sequence cut at all (TARGET_WARPS at least twice the warps) is cut FINER times finer
    # (a tile setting, see config and bwd_config): the local pass costs per step, not per
    # range, and short ranges even out the waves. The factor is arithmetic, not a branch: no
    # guard on symbolic sizes.
    factor = 1 + (cfg["FINER"] - 1) * _sym_min(1, TARGET_WARPS // warps // 2)
    wanted = _sym_min(chunks, factor * TARGET_WARPS // warps)
    # Fewer than MIN_RANGES ranges do not pay for the local pass: S6 (2 chunks) took 35.7 us
    # in the forward with 2 ranges, 29.8 with one (CUDA-graph replays, session 8).
    wanted = _sym_max(1, wanted * _sym_min(1, wanted // MIN_RANGES))
    length = cdiv(chunks, wanted) * CKPT
    return cdiv(seqlen, length), length


def _may_exceed_one(n_ranges) -> bool:
    """Whether the local launch is needed: skipped when there is surely one range (a launch of
    an empty grid does nothing but costs Python overhead); kept for symbolic counts, where an
    empty grid launches nothing."""
    return not isinstance(n_ranges, int) or n_ranges > 1


def overridden(cfg_fn, overrides: dict):
    """The tile function cfg_fn (config or bwd_config) with some tile sizes replaced
    (benchmarks and inspection); NI and BD follow."""

    def tiles(dim, dstate, dtype: torch.dtype, B: Tensor, C: Tensor, *sizes) -> dict:
        cfg = cfg_fn(dim, dstate, dtype, B, C, *sizes)
        out = cfg | overrides
        if "NS" in overrides and "NI" not in overrides:
            out["NI"] = cfg["NS"] * cfg["NI"] // out["NS"]
        return _derive_block(out, dim, B, C)

    return tiles


class _Plan:
    """What both launchers derive from the inputs' shapes, strides, dtypes and devices alone:
    the compute dtype, sizes, tiles, ranges, and the leading arguments both kernels' signatures
    share. Built by ``plan``."""

    def __init__(self, cfg_fn, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens):
        check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
        self.cdt = cdt = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
        self.batch, self.dim, self.seqlen = batch, dim, seqlen = u.shape
        # The state size is a kernel constant (DSTATE, and the tiles' split of the states): a
        # symbolic one (torch.compile(dynamic=True)) is specialized here. Left symbolic, its
        # next power of two became a sympy expression of bit operations that the tiles and
        # grids carried on: Inductor's first compile of the S1 forward took 190 s on the H200.
        self.dstate = guard_int(A.shape[1])
        self.num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        varlen = cu_seqlens is not None
        self.cfg = cfg = cfg_fn(dim, self.dstate, u.dtype, B, C, self.num_states, seqlen, varlen,
                                (u, delta, z))  # fmt: skip
        self.NP = cfg["NS"] * cfg["NI"]
        self.n_blocks = cdiv(dim, cfg["BLOCK"])
        # The ranges' local pass may split the states over other lanes (LOCAL_NS): its results
        # are indexed by channel and state, whatever the layout that computed them.
        local_ns = min(cfg["LOCAL_NS"], self.NP)
        self.local_tiles = _derive_block(dict(cfg, NS=local_ns, NI=self.NP // local_ns), dim, B, C)
        self.n_ranges, range_len = ranges(cfg, self.num_states, dim, seqlen, varlen)
        T = cfg["T"]
        lanes = cfg.get("LANES", 0)
        # The lanes kernel masks its steps: no padded rows.
        self.pad = pad = padded(seqlen, T) and not lanes
        self.rows = cdiv(seqlen, T) * T if pad else seqlen
        # Which of u, delta, z are copied into padded rows (see `padded`), and their strides
        # as the kernels see them.
        self.copied = [restaged(t, pad, T) for t in (u, delta, z)]
        u_s, delta_s, z_s = (
            (dim * self.rows, self.rows, 1) if copy else _strides3(t)
            for t, copy in zip((u, delta, z), self.copied, strict=True)
        )
        self.args = (
            dim, seqlen, range_len, self.n_ranges,
            *u_s, *delta_s, *z_s, *A.stride(),
            *(lanes_bc_args(B, dim) + lanes_bc_args(C, dim) if lanes else
              (bc_tiles(seqlen, T), *_bc_args(B, dim), *_bc_args(C, dim))),
            0 if D is None else D.stride(0), 0 if delta_bias is None else delta_bias.stride(0),
            *_strides3(initial_state),
        )  # fmt: skip
        # What the launches' ALIGN is decided on: the rows' length and where they start.
        self.align_sizes = (self.rows, *u_s[:2], *delta_s[:2], *z_s[:2])
        self.bc_layout = None if lanes else bc_layout(B, C, T, self.NP)
        wide = cu_seqlens is not None or pad
        self.flags = dict(
            DSTATE=self.dstate, NS=cfg["NS"], NI=cfg["NI"], BD=cfg["BD"], BLOCK=cfg["BLOCK"],
            T=T, CKPT=CKPT,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            HAS_H0=initial_state is not None, VARLEN=cu_seqlens is not None,
            B_VAR=B.dim() > 2, C_VAR=C.dim() > 2, ACC=_tl_dtype(cdt), FAST=_fast_math(u, cdt),
            STAGES=cfg["STAGES"], num_warps=cfg["num_warps"],
            WIDE=wide, ALIGN=align_mode(T, wide, *self.align_sizes),
            # A register cap only as a tuning override (bench/tune_gpu.py, eager calls).
            **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}),
        )  # fmt: skip
        # PDL (programmatic dependent launch, Hopper on): the forward's first scan launch starts
        # while the B/C blocking launch before it runs, and waits for it (gdc_wait) only after
        # its PRE pass, which reads none of the blocks: launches of few warps (PRE), where the
        # blocking launch and the gap after it are a few percent of the time (S6 as a CUDA
        # graph: 25.8 against 26.8-27.4 us). Only where the blocking launch is the one right
        # before it (no rows staged, no cu_seqlens copied in between).
        self.pdl = (
            cfg.get("PRE", 0) > 0  # the backward's tiles have no PRE
            and (B.dim() > 2 or C.dim() > 2)
            and not any(self.copied)
            and (cu_seqlens is None or cu_seqlens.is_contiguous())
            and _has_pdl(u.device)
        )
        # Direct launchers (launch.py) of eager calls, by the launch's own arguments; None for
        # plans built while tracing, which launch through wrap_triton.
        self.launchers: dict[tuple, Launcher] | None = None
        # Eager plans: an empty tensor for the buffers a launch does not use (no PRE pass, one
        # range), passed in their place: allocating them took 1-1.5 us of host time each.
        self.unused: Tensor | None = None
        # The backward's grad_sums launch (grid, scalars, constexprs), made at its first call.
        self.sums: tuple | None = None

    def direct(self, u: Tensor) -> dict[tuple, Launcher] | None:
        """The launchers of this call's launches: the plan's direct ones (launch.py) when
        launching now is plain eager on CUDA tensors, else None (through wrap_triton, which
        tracing records). Decided once a call, not at each of its launches (host time)."""
        if self.launchers is None or not u.is_cuda or not is_plain_eager((u,)):
            return None
        return self.launchers

    def tensors(
        self, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, launchers=None,
        pdl=False,
    ) -> tuple:  # fmt: skip
        """The kernels' leading tensor arguments: the inputs, variable B/C pre-blocked (with
        this call's launchers, letting the next launch start early with pdl), per-step inputs
        in padded rows where the plan says so."""
        Bb, Cb = bc_blocks(self.bc_layout, B, C, self.cdt, launchers, pdl)
        u, delta, z = (
            staged(t, self) if copy else t
            for t, copy in zip((u, delta, z), self.copied, strict=True)
        )
        if cu_seqlens is not None:  # the kernels read it as a dense array
            cu_seqlens = cu_seqlens.contiguous()
        return u, delta, A, Bb, Cb, D, z, delta_bias, initial_state, cu_seqlens

    def launches(self):
        """(LOCAL flag, grid, tile flags) of each scan launch: the ranges' local pass first when
        there are several ranges (see scan_fwd.py), with its own tiles, then the full pass; the
        caller launches the range entries between them (_range_entries). Grids are (blocks of
        channels x sequences, 1, ranges), see common.block_and_sequence."""
        states, count = self.num_states, self.n_ranges
        if _may_exceed_one(count):
            lt = self.local_tiles
            tiles = dict(NS=lt["NS"], NI=lt["NI"], BD=lt["BD"], BLOCK=lt["BLOCK"])
            yield True, (cdiv(self.dim, lt["BLOCK"]) * states, 1, count - 1), tiles
        yield False, (self.n_blocks * states, 1, count), {}


# Plans of eager calls by layout (shapes, strides, dtypes, devices): a training loop repeats a
# few layouts, and checking and planning again on every call is Python time the GPU waits for
# on short kernels. Emptied when full, to stay small. A plan keeps the FAST flag it was made
# with (it reads TRITON_INTERPRET; both settings are correct).
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def plan(cfg_fn, *inputs) -> _Plan:
    """The _Plan of the ten scan inputs (u, delta, A, B, C, D, z, delta_bias, initial_state,
    cu_seqlens) with the tiles of cfg_fn (config or bwd_config): cached for real tensors, built
    afresh for fake ones (tracing, where sizes may be symbolic). Checks raise before anything is
    cached."""
    if is_fake(inputs[0]):
        return _Plan(cfg_fn, *inputs)
    # 16-byte alignment too: the lanes kernel is chosen only for aligned rows (lanes_fit).
    key = (cfg_fn, *[None if t is None else
                     (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                     for t in inputs])  # fmt: skip
    found = _PLANS.get(key)
    if found is None:
        found = _Plan(cfg_fn, *inputs)
        found.launchers = {}
        found.unused = inputs[0].new_empty((0,), dtype=found.cdt)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def _launch(p: _Plan, launchers, kernel, grid: tuple, tensors: tuple, scalars: tuple,
            flags: dict, align_sizes: tuple) -> None:  # fmt: skip
    """kernel[grid](*tensors, *p.args, *scalars, **p.flags, **flags) with this call's launchers
    (``p.direct``), see _launch_kernel; an ALIGN_CHECKED launch as the two of
    `checked_launches` on `align_sizes` (the rows' length and the strides of the rows it reads
    and writes). ``scalars`` and ``flags`` are what the launch adds to the plan; they pick its
    launcher."""
    options = p.flags | flags
    variants = [(options["ALIGN"], grid)]
    if options["ALIGN"] == ALIGN_CHECKED:
        variants = checked_launches(grid, p.cfg["T"], align_sizes)
    for align, part in variants:
        _launch_kernel(launchers, kernel, part, tensors, (*p.args, *scalars),
                       options | {"ALIGN": align},
                       key=(kernel, part, scalars, align, *flags.values()))  # fmt: skip


def _launch_kernel(launchers, kernel, grid, tensors, args, options, key) -> None:
    """kernel[grid](*tensors, *args, **options): directly with ``launchers`` (launch.py; the
    plan's, by ``key``, for plain eager calls on CUDA tensors: ``_Plan.direct``), through
    wrap_triton when it is None (traced, or the interpreter)."""
    if launchers is None:
        wrap_triton(kernel)[grid](*tensors, *args, **options)
        return
    launcher = launchers.get(key)
    if launcher is None:
        launcher = Launcher(kernel, grid, args, options)
        launchers[key] = launcher
    launcher(*tensors)


def _unused(u: Tensor, p: _Plan) -> Tensor:
    """A tensor for a buffer the launches do not use (its pointer is passed, never read)."""
    return u.new_empty((0,), dtype=p.cdt) if p.unused is None else p.unused


def _range_buffers(u: Tensor, p: _Plan) -> tuple[Tensor, Tensor]:
    """The local launch's per-range results, states (ranges, sequences, dim, NP) and sum(delta)
    (ranges, sequences, dim), as flat tensors (the kernels index them). With the range count
    as a dimension, traced calls guarded on it: a symbolic count inside the strides (as
    Max(1, count) in one place and count in another) made Inductor (2.11) copy the buffer
    into itself around the kernel (a KeyError in its scheduler, AOTInductor with dynamic
    shapes); leading, it was tested for being 1 (contiguity), so that torch.compile(dynamic=
    True) compiled again when a longer sequence was cut into ranges."""
    if p.unused is not None and not _may_exceed_one(p.n_ranges):  # read and written by none
        return p.unused, p.unused
    per_range = p.num_states * p.dim
    h_local = u.new_empty((p.n_ranges * per_range * p.NP,), dtype=p.cdt)
    return h_local, u.new_empty((p.n_ranges * per_range,), dtype=p.cdt)


# Ranges a program of _range_entries_kernel takes a step (its one warp holds RANGE_BLOCK ranges
# of a value in each lane). Measured alone on S3's 63 ranges (do_bench, session 12): 8 ranges
# 12.8 us, 16 12.2, 32 15.8, 64 14.5; 4.8 us between the scan kernels.
RANGE_BLOCK = 16


def _range_entries(p: _Plan, launchers, local: Tensor, dt_sums: Tensor, A: Tensor,
                   init: Tensor | None, reverse: bool) -> None:  # fmt: skip
    """Turn the local launch's per-range results (see _range_buffers) into the state entering
    each range (forward; init = initial_state) or the gradient leaving it (backward, reverse;
    init = dlast_state), in place: kernels/range_entries.py."""
    BD = max(1, 32 // p.NP)  # a value of each range's results a lane
    # No program for a single range: traced calls keep this launch for a symbolic count (see
    # _may_exceed_one), and its programs, which then had nothing to fold, took 5-14 us of
    # S1's, S2's and S7's compiled forwards (session 17).
    programs = cdiv(p.dim, BD) * p.num_states * _sym_min(1, p.n_ranges - 1)
    grid = (programs, 1, 1)  # Inductor's launchers want three axes
    init_strides = (0, 0, 0) if init is None else init.stride()
    args = (p.dim, p.n_ranges, *A.stride(), *init_strides)
    options = dict(DSTATE=p.dstate, NP=p.NP, BD=BD, RB=RANGE_BLOCK, REVERSE=reverse,
                   HAS_INIT=init is not None, ACC=p.flags["ACC"], num_warps=1)  # fmt: skip
    tensors = (local, dt_sums, A, init)
    # The key holds every argument: a backward plan (keyed by the scan's inputs) serves calls
    # with and without dlast_state, of any strides.
    _launch_kernel(launchers, _range_entries_kernel, grid, tensors, args, options,
                   key=(_range_entries_kernel, grid, *args, *options.values()))  # fmt: skip


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
    """Triton forward: (out (batch, dim, seqlen) in u's dtype, last_state (batch or num_seqs,
    dim, dstate), checkpoints (batch, dim, ceil(seqlen / CKPT) + 1, dstate)), float32 states."""
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    p = plan(config, *inputs)
    if cu_seqlens is not None and not is_fake(cu_seqlens):  # eager only: reads it to the host
        check_cu_seqlens_values(cu_seqlens, p.seqlen)
    out = new_rows(u, p, u.dtype)
    last = u.new_empty((p.num_states, p.dim, p.dstate), dtype=p.cdt)
    ckpt = u.new_empty((p.batch, p.dim, checkpoint_slots(p.seqlen, CKPT), p.dstate), dtype=p.cdt)
    h_local, dt_sums = _range_buffers(u, p)
    # PRE (see config): delta after its bias and softplus, in rows like out's (same strides).
    pre = new_rows(u, p, p.cdt) if p.cfg["PRE"] else _unused(u, p)
    launchers = p.direct(u)
    # Eager launches only: Inductor's and AOTInductor's launchers set no launch attributes.
    pdl = p.pdl and launchers is not None
    tensors = (*p.tensors(*inputs, launchers=launchers, pdl=pdl), out, last, ckpt, h_local,
               dt_sums, pre)  # fmt: skip
    strides = (*out.stride()[:2], *ckpt.stride()[:3], *last.stride()[:2])
    kernel, lanes = _scan_fwd_kernel, {}
    if p.cfg.get("LANES"):
        full = p.seqlen == LANES_STEPS[0] * LANES_STEPS[1]  # no masks (scan_fwd_lanes.py)
        kernel, lanes = _scan_fwd_lanes_kernel, {"LANES": p.cfg["LANES"], "FULL": full}
        if launchers is not None and "maxnreg" not in p.cfg:  # see LANES_MAXNREG
            lanes["maxnreg"] = LANES_MAXNREG
    for local, grid, tiles in p.launches():
        flags = dict(SOFTPLUS=delta_softplus, LOCAL=local, PRE=p.cfg["PRE"], EPI=p.cfg["EPI"],
                     PDL=pdl, **tiles, **lanes)  # fmt: skip
        if pdl:  # the first launch only: the one right after the blocking launch
            flags["launch_pdl"] = True
            pdl = False
        _launch(p, launchers, kernel, grid, tensors, strides, flags, p.align_sizes)
        if local:
            _range_entries(p, launchers, h_local, dt_sums, A, initial_state, reverse=False)
    return unpadded(out, p), last, ckpt


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Whether launches on this device can overlap the one before them (PDL: NVIDIA, sm_90 on;
    not ROCm or the interpreter, which run no PTX)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    """SMs of a GPU, asked once: one_wave_cap runs on every eager backward."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def one_wave_cap(p: _Plan, u: Tensor, launchers) -> dict:
    """A register cap for the backward's full launch in an eager call on a GPU, where it turns
    that launch's grid into one wave. The backward's usual kernel (T = 8, 16 padded states)
    takes 255 registers: 8 one-warp programs per SM; capped at 168, 12. A grid of one to 1.5
    waves of 8 then fits one wave of 12: S1 1.31 -> 1.27 ms, S4 (float32) 1.44 -> 1.33
    (session 7, bench/NOTES.md). On fuller grids the cap's spills cost more than the occupancy
    gains (S2 1.53 -> 2.05, S7 3.74 -> 4.27). Only for direct launches (``launchers``, see
    _Plan.direct): wrap_triton takes no register cap."""
    if (
        launchers is None
        or "maxnreg" in p.cfg  # a tuning override (bench/tune_gpu.py) wins
        or (p.cfg["T"], p.NP) != (8, 16)
    ):
        return {}
    sms = _sm_count(u.device)
    programs = p.n_blocks * p.num_states * p.n_ranges
    return {"maxnreg": 168} if 8 * sms < programs <= 12 * sms else {}


def backward_align(p: _Plan, dout: Tensor) -> tuple[int, tuple]:
    """The backward's ALIGN and the sizes it is decided on: the plan's, and dout's rows
    (declared when the inputs' rows are multiples of 16 but dout's only of T; plain when dout
    is strided in time)."""
    sizes = (*p.align_sizes, *dout.stride()[:2])
    return align_mode(p.cfg["T"], p.flags["WIDE"], *sizes), sizes


def _fresh(t: Tensor, like: Tensor) -> Tensor:
    """t as a contiguous tensor of its own with like's shape and dtype (no aliasing, stable
    strides): in eager calls t itself when it is one already, else a copy. Traced calls always
    copy (Inductor fuses it): returning a kernel's buffer directly put a guard on the length
    into the compiled backward (on the H200, torch.compile(dynamic=True) compiled again for 999
    steps after 256, session 11, when dA's, dD's and ddelta_bias' sums were returned so)."""
    own = not is_fake(t) and t._base is None and t.is_contiguous()
    if own and t.shape == like.shape and t.dtype == like.dtype:
        return t
    out = like.new_empty(like.shape)
    out.view(t.shape).copy_(t)
    return out


def bc_part_dtype(p: _Plan, t: Tensor) -> torch.dtype:
    """The dtype of the backward's per-block partial sums of variable dB or dC: bfloat16 for
    bfloat16 B or C (BF16_PARTS), else the compute dtype. The block sums read them back from
    DRAM: at S1 201 MB each in float32, 106 us of a 1.25 ms backward; in bfloat16 64 us, and the
    kernel writes half the bytes (S1 1.163 -> 1.121 ms, S5 1.521 -> 1.439, S7 3.69 -> 3.46;
    session 11, bench/NOTES.md). Each partial (a float32 sum over BD channels) is rounded once,
    the partials are summed in float32 and the sum rounded to bfloat16: dB's and dC's error
    against float64 gradients grows by sqrt(2), as from a second rounding (S1, S3, S5: relative
    error 2.35e-3 against 1.66e-3 with float32 partials, the error of rounding to bfloat16)."""
    bf16 = t.dtype == torch.bfloat16 and p.cfg.get("BF16_PARTS", 0) == 1
    return torch.bfloat16 if bf16 else p.cdt


SUM_PROGRAMS = 256  # programs a job of _grad_sums_kernel should have at least, where it can


def grad_sum_tile(rows, M) -> int:
    """BM of a grad_sums job of `rows` rows of M sums: the widest of 1024, 256, 64, 16 giving
    it SUM_PROGRAMS programs. Fewer programs leave the GPU short of loads in flight (S2's dB
    and dC, 4 rows: 139 us at 1024, 81 at 256); narrower tiles than needed cost more programs
    and, past the terms, masked loads (S5, K = 64: 86 us at 1024, 135 at 256; S6, 4096 sums of
    640 blocks: 11.6 us at 16, 159 at 1024). The whole launch at every benchmark shape is
    within 17% of its best tile and faster than the torch reductions it replaced (H200,
    bench/experiments/grad_sums_tiles.py, session 28). From the sizes alone, not the device,
    so the order of the sums is the same everywhere; symbolic sizes by their hints."""
    rows, M = size_hint(rows), size_hint(M)
    for BM in (1024, 256, 64):
        if rows is None or M is None or rows * cdiv(M, BM) >= SUM_PROGRAMS:
            return BM
    return 16


def grad_sums_launch(p: _Plan, B: Tensor, C: Tensor, D: Tensor | None,
                     delta_bias: Tensor | None) -> tuple:  # fmt: skip
    """(grid, scalars, constexprs) of grad_sums' launch: the plan's sizes and which inputs are
    variable or present decide them, so eager plans keep them (``_Plan.sums``)."""
    batch, dim, NP, T = p.batch, p.dim, p.NP, p.cfg["T"]
    tiles = bc_tiles(p.seqlen, T)
    groups = [1 if t.dim() < 4 else t.shape[1] for t in (B, C)]
    BM_STATES = grad_sum_tile(1, dim * NP)
    BM_STEPS = grad_sum_tile(batch * max(groups), tiles * NP * T)
    BM_CHANNELS = grad_sum_tile(1, dim)
    # Programs of dA, dB, dC, dD and ddelta_bias (grad_sums.py's table): rows * cdiv(M, BM).
    counts = [cdiv(dim * NP, BM_STATES)]
    for t, g in zip((B, C), groups, strict=True):
        counts.append(batch * g * cdiv(tiles * NP * T, BM_STEPS) if t.dim() > 2 else counts[0])
    counts += [0 if t is None else cdiv(dim, BM_CHANNELS) for t in (D, delta_bias)]
    ends = list(itertools.accumulate(counts))  # each job's range of the grid ends there
    grid = (ends[-1], 1, 1)
    args = (p.num_states * p.n_ranges, dim, p.dstate, p.seqlen, tiles, p.n_blocks, *groups,
            *ends[:4])  # fmt: skip
    options = dict(NP=NP, T=T, B_VAR=B.dim() > 2, C_VAR=C.dim() > 2, HAS_D=D is not None,
                   HAS_BIAS=delta_bias is not None, BM_STATES=BM_STATES, BM_STEPS=BM_STEPS,
                   BM_CHANNELS=BM_CHANNELS, ELEMENTS=GRAD_SUM_ELEMENTS, ACC=p.flags["ACC"],
                   num_warps=4)  # fmt: skip
    return grid, args, options


def grad_sums(p: _Plan, launchers, parts: tuple, A: Tensor, B: Tensor, C: Tensor,
              D: Tensor | None, delta_bias: Tensor | None) -> tuple:  # fmt: skip
    """(dA, dB, dC, dD, ddelta_bias) from the backward kernel's partial sums ``parts`` (in that
    order), in one launch of kernels/grad_sums.py: each a fresh contiguous tensor of its
    input's shape and dtype, None for an absent D or delta_bias."""
    if p.sums is None:  # traced calls build a fresh plan each time
        p.sums = grad_sums_launch(p, B, C, D, delta_bias)
    grid, args, options = p.sums
    outs = [None if t is None else t.new_empty(t.shape) for t in (A, B, C, D, delta_bias)]
    unused = _unused(A, p)
    tensors = tuple(
        unused if t is None else t for pair in zip(parts, outs, strict=True) for t in pair
    )
    _launch_kernel(launchers, _grad_sums_kernel, grid, tensors, args, options,
                   key=("grad_sums",))  # fmt: skip
    return tuple(outs)


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
    """Triton backward from the forward's checkpoints: (du, ddelta, dA, dB, dC, dD, dz,
    ddelta_bias, dinitial_state), each in its input's dtype and shape (empty for absent
    optional inputs). Deterministic: partial sums are reduced in a fixed order."""
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    p = plan(bwd_config, *inputs)
    batch, dim, dstate, cdt, NP = p.batch, p.dim, p.dstate, p.cdt, p.NP
    check_scan_grads(dout, dlast_state, checkpoints, u, A, cu_seqlens, CKPT, cdt)
    programs = p.num_states * p.n_ranges  # partial sums are per (sequence, range)

    T = p.cfg["T"]
    du = new_rows(u, p, u.dtype)
    ddelta = new_rows(u, p, delta.dtype)
    dz = u.new_empty((0,)) if z is None else new_rows(u, p, z.dtype)
    if restaged(dout, p.pad, T):
        dout = staged(dout, p)
    dA_part = u.new_empty((programs, dim, NP), dtype=cdt)

    def bc_part(t):
        if t.dim() == 2:
            return u.new_empty((programs, dim, NP), dtype=cdt)
        tiles = bc_tiles(p.seqlen, T)
        return u.new_empty((batch, p.n_blocks, tiles, NP, T), dtype=bc_part_dtype(p, t))

    dB_part, dC_part = bc_part(B), bc_part(C)
    unused = _unused(u, p)  # the kernels write these only for a D, delta_bias, initial_state
    dD_part = unused if D is None else u.new_empty((programs, dim), dtype=cdt)
    dbias_part = unused if delta_bias is None else u.new_empty((programs, dim), dtype=cdt)
    dh0 = unused if initial_state is None else u.new_empty((p.num_states, dim, dstate), dtype=cdt)
    dh_local, dt_sums = _range_buffers(u, p)
    tiles_per_chunk = CKPT // T
    keep = p.cfg["KEEP_STEPS"]
    per_tile = p.cfg["BD"] * (NP + 2 * T * keep)  # see scratch in scan_bwd.py
    scratch = u.new_empty((programs * p.n_blocks * tiles_per_chunk * per_tile,), dtype=cdt)
    launchers = p.direct(u)
    last_strides = (0, 0, 0) if dlast_state is None else dlast_state.stride()
    tensors = (
        *p.tensors(*inputs, launchers=launchers), dout, dlast_state, checkpoints, scratch,
        du, ddelta, dz, dA_part, dB_part, dC_part, dD_part, dbias_part, dh0, dh_local, dt_sums,
    )  # fmt: skip
    scalars = (p.n_blocks, p.rows, *dout.stride(), *last_strides, *checkpoints.stride()[:3])
    align, align_sizes = backward_align(p, dout)
    cap = one_wave_cap(p, u, launchers)
    for local, grid, tiles in p.launches():
        # The cap is the full pass's (its grid, its kernel); the local pass is a smaller kernel.
        flags = dict(SOFTPLUS=delta_softplus, HAS_DLAST=dlast_state is not None, LOCAL=local,
                     KEEP_STEPS=keep, ALIGN=align, **tiles, **({} if local else cap))  # fmt: skip
        _launch(p, launchers, _scan_bwd_kernel, grid, tensors, scalars, flags, align_sizes)
        if local:
            _range_entries(p, launchers, dh_local, dt_sums, A, dlast_state, reverse=True)

    parts = (dA_part, dB_part, dC_part, dD_part, dbias_part)
    dA, dB, dC, dD, dbias = grad_sums(p, launchers, parts, A, B, C, D, delta_bias)

    def empty():  # one placeholder per absent input: outputs must not alias each other
        return u.new_empty((0,))

    return (
        unpadded(du, p),
        unpadded(ddelta, p),
        dA,
        dB,
        dC,
        empty() if D is None else dD,
        dz if z is None else unpadded(dz, p),
        empty() if delta_bias is None else dbias,
        empty() if initial_state is None else _fresh(dh0, initial_state),
    )
