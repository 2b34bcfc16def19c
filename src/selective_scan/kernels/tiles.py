"""The tile policy of the scan kernels: pure functions of sizes and options.

A ``TilePolicy`` turns a call's sizes into the tiles of its forward (``fwd``) and backward
(``bwd``) launches, and holds the other knobs a launch reads (register caps, whether the lanes
kernel, PDL or fast math may be used, how rows are aligned). The launchers take the active
policy (``current_policy``), the default unless a caller set another with ``use_policy``:
tuners, tests and offline compiles swap it there instead of overwriting module globals.

A tile dict holds: T steps per thread; the padded states split as NS lanes x NI per thread; CH
channels per thread; num_warps; BD, the tile's channel rows (CH * 32 / NS * num_warps: a whole
warp's lanes); BLOCK, the channels a program covers (BD, or fewer for grouped B/C, see
``derive_block``); STAGES; LANES (the lanes kernel, scan_fwd_lanes.py); LOCAL_NS and FINER
(the ranges' local pass and cut, see ``ranges``); PRE and EPI (forward), KEEP_STEPS,
BF16_PARTS and RECOMPUTE_STAGES (backward). Why each value: docs/design.md, section 9.

Decisions compare plain ints: symbolic sizes (torch.compile(dynamic=True), torch.export) are
read through their hints (``size_hint``), which adds no guard, so a traced call takes the tiles
an eager call of the traced example would take.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping

import torch
import triton
from torch import Tensor

from .common import cdiv, fast_math, size_hint, sym_max, sym_min
from .launch import is_plain_eager

CKPT = 128  # checkpoint interval (steps) of the Triton backend
MIN_RANGES = 3  # fewer ranges do not pay for the local pass (see ranges)
LANES_STEPS = (16, 16)  # the lanes kernel: lanes a channel, steps a lane (scan_fwd_lanes.py)

# Lanes a channel's padded states split over beyond 16 states, by their padded count: (forward,
# its ranges' local pass, backward, its local pass); counts past 256 take a warp. Each state a
# thread holds is an unrolled copy of the tile's recurrence: at most 16 a thread forward, 8
# backward (4 at 64 and 128), which keeps compile times and registers bounded (design §9).
STATE_LANES = {32: (2, 2, 4, 4), 64: (4, 4, 16, 8), 128: (8, 8, 32, 16), 256: (32, 32, 32, 32)}
FWD, FWD_LOCAL, BWD, BWD_LOCAL = range(4)

# The backward's one-warp programs of 16 padded states an SM holds uncapped (about 255
# registers); scan.wave_cap caps them to fit 12.
BWD_PROGRAMS_PER_SM = 8


@dataclasses.dataclass(frozen=True, eq=False)
class TilePolicy:
    """Tiles and launch options from sizes. Compared by identity: the plan cache keeps plans of
    each policy apart.

    fwd_overrides / bwd_overrides: tile values replacing the chosen ones (NI and the blocks
    follow). target_warps: warps at which a launch keeps the GPU's schedulers busy (about four
    each of the H200's 528); fewer cut sequences into ranges. pre_steps: the forward's PRE pass
    length. lanes: the lanes kernel may be chosen. lanes_maxnreg: its register cap in eager
    calls. fast_math, pdl: None decides from the device, a bool forces it (fast math only
    in float32). sm_count: None asks
    the device. align: None decides each launch's ALIGN from its sizes, else forces one
    (layout.ALIGN_*). pad_rows: lengths that T does not divide get padded rows (layout.padded).
    range_block: ranges a program of the range entries' launch takes a step. sum_programs:
    programs a grad_sums job should have at least. sum_tile: None picks grad_sums' tiles, else
    forces the step jobs' BM."""

    fwd_overrides: Mapping = dataclasses.field(default_factory=dict)
    bwd_overrides: Mapping = dataclasses.field(default_factory=dict)
    target_warps: int = 2048
    pre_steps: int = 128
    lanes: bool = True
    lanes_maxnreg: int = 96
    fast_math: bool | None = None
    pdl: bool | None = None
    sm_count: int | None = None
    align: int | None = None
    pad_rows: bool = True
    range_block: int = 16
    sum_programs: int = 256
    sum_tile: int | None = None

    def replace(self, **changes) -> TilePolicy:
        """A policy with these fields changed."""
        return dataclasses.replace(self, **changes)

    def fwd(self, dim, dstate, dtype, B, C, num_states=1, seqlen=None, varlen=False,
            rows=()) -> dict:  # fmt: skip
        """The forward's tiles (fwd_tiles), with fwd_overrides applied."""
        cfg = fwd_tiles(self, dim, dstate, dtype, B, C, num_states, seqlen, varlen, rows)
        return _overridden(cfg, self.fwd_overrides, dim, B, C)

    def bwd(self, dim, dstate, dtype, B, C, num_states=1, seqlen=None, varlen=False,
            rows=()) -> dict:  # fmt: skip
        """The backward's tiles (bwd_tiles, or where they pay ``two_channels``'), with
        bwd_overrides applied."""
        cfg = bwd_tiles(dim, dstate, dtype, B, C)
        cfg = two_channels(self, cfg, dim, B, C, num_states, seqlen, varlen, rows) or cfg
        return _overridden(cfg, self.bwd_overrides, dim, B, C)

    def uses_fast_math(self, u: Tensor, cdt: torch.dtype) -> bool:
        """Whether the kernels use MUFU approximations: common.fast_math, or where forced, for
        float32 arithmetic (they have no float64 form)."""
        if self.fast_math is None:
            return fast_math(u, cdt)
        return self.fast_math and cdt == torch.float32


DEFAULT_POLICY = TilePolicy()


@functools.cache
def _device_sm_count(device: torch.device) -> int:
    """SMs of a GPU, asked once: eager calls read it on every call."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(policy: TilePolicy, device: torch.device) -> int:
    """SMs of the device, or the policy's count."""
    return policy.sm_count if policy.sm_count is not None else _device_sm_count(device)


_ACTIVE = contextvars.ContextVar("selective_scan_tile_policy", default=DEFAULT_POLICY)


def current_policy() -> TilePolicy:
    """The policy the launchers use now: DEFAULT_POLICY unless ``use_policy`` set another."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use_policy(policy: TilePolicy) -> Iterator[TilePolicy]:
    """Run the scan launchers with ``policy`` inside the block (this thread or task only). The
    eager backward of a forward run here takes its policy wherever autograd runs it; a compiled
    graph's backward op (opaque, ops.py) runs under the policy current where it runs, the
    default on autograd's device thread: set it around ``.backward()`` on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``)."""
    token = _ACTIVE.set(policy)
    try:
        yield policy
    finally:
        _ACTIVE.reset(token)


def run_with_policy(policy: TilePolicy, fn, *args):
    """fn(*args) with the launchers using ``policy``, as inside ``use_policy`` (without a
    context manager's host time: an eager backward runs it, ops.run_backward)."""
    token = _ACTIVE.set(policy)
    try:
        return fn(*args)
    finally:
        _ACTIVE.reset(token)


def _overridden(cfg: dict, overrides: Mapping, dim, B: Tensor, C: Tensor) -> dict:
    """cfg with some tile values replaced; NI, BD and BLOCK follow."""
    if not overrides:
        return cfg
    out = cfg | dict(overrides)
    if "NS" in overrides and "NI" not in overrides:
        out["NI"] = cfg["NS"] * cfg["NI"] // out["NS"]
    return derive_block(out, dim, B, C)


def state_lanes(dstate: int, role: int, lanes: int) -> int:
    """Lanes splitting a channel's states in tiles of `role` (FWD ... BWD_LOCAL): `lanes`, or
    the STATE_LANES split where that is more."""
    n_pad = triton.next_power_of_2(dstate)
    if n_pad <= 16:
        return lanes
    return max(lanes, STATE_LANES.get(n_pad, (32,) * 4)[role])


def derive_block(cfg: dict, dim, B: Tensor, C: Tensor) -> dict:
    """Sets BD, the tile's rows (a whole warp's lanes, whatever the channel count), and BLOCK,
    the channels a program covers: BD, or for grouped B/C the largest power of two dividing a
    group's channels where that is fewer, so that a program's B/C tiles and dB/dC partial sums
    belong to one group; the other rows are masked (common.block_channels). Tiles of fewer rows
    than lanes got layouts that Triton's scan lowering got wrong (design §9)."""
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


def base_tiles(dim, dstate, B: Tensor, C: Tensor, T: int, NS: int, lanes: int = 0) -> dict:
    """Tiles of T steps with the padded states over NS lanes (at most the states), one
    channel a thread, one warp a program; LANES: the lanes kernel's (NS = 1)."""
    n_pad = triton.next_power_of_2(dstate)
    NS = min(NS, n_pad)
    cfg = dict(T=T, NS=NS, NI=n_pad // NS, CH=1, num_warps=1, STAGES=3, LANES=lanes)
    return derive_block(cfg, dim, B, C)


def fwd_tiles(policy: TilePolicy, dim, dstate, dtype: torch.dtype, B: Tensor, C: Tensor,
              num_states=1, seqlen=None, varlen=False, rows=()) -> dict:  # fmt: skip
    """Tiles of the forward (design §9). T = 16 steps (8 in float64, and for a known length
    that 8 divides but 16 does not). 4 lanes a channel; 2 where programs of 2-lane channels
    still give target_warps warps or where 4 lanes would cut the sequence into ranges, with the
    epilogue on each lane's steps (EPI). Launches of few warps: the lanes kernel where
    `lanes_fit` holds, else the PRE pass. The ranges' local pass keeps a channel's states in one
    thread (LOCAL_NS 1) and cuts FINER 2. `rows`: the per-step inputs (u, delta, z)."""
    T = 16 if dtype.itemsize <= 4 else 8
    if isinstance(seqlen, int) and seqlen % T != 0 and seqlen % (T // 2) == 0:
        T //= 2
    both = {"LOCAL_NS": state_lanes(dstate, FWD_LOCAL, 1), "FINER": 2, "PRE": 0, "EPI": 0}
    narrow = base_tiles(dim, dstate, B, C, T, NS=state_lanes(dstate, FWD, 2)) | both
    wide = base_tiles(dim, dstate, B, C, T, NS=state_lanes(dstate, FWD, 4)) | both
    target = policy.target_warps
    states, dims, length, narrow_block, wide_block = (
        size_hint(v) for v in (num_states, dim, seqlen, narrow["BLOCK"], wide["BLOCK"])
    )
    if None in (states, dims, narrow_block, wide_block):  # sizes known only at run time
        return wide
    plain = dict(wide, BLOCK=wide_block)
    cut = length is not None and ranges(plain, states, dims, length, varlen, target)[0] > 1
    if states * cdiv(dims, narrow_block) >= target or cut:
        return narrow | {"EPI": int(narrow["NS"] <= 2)}  # measured on 2-lane tiles only
    few = length is not None and states * cdiv(dims, wide_block) < target // 2
    if few and policy.lanes and lanes_fit(policy, dtype, B, C, seqlen, varlen, rows):
        return base_tiles(dim, dstate, B, C, 16, NS=1, lanes=LANES_STEPS[0]) | both
    if few:
        return wide | {"PRE": policy.pre_steps}
    return wide


def bwd_tiles(dim, dstate, dtype: torch.dtype, B: Tensor, C: Tensor) -> dict:
    """Tiles of the backward (design §5, §9): one 16-byte vector of a 16-bit input a thread
    (T = 8, float32 too; 4 in float64), 4 lanes a channel, for any length: longer tiles or
    fewer lanes spill. KEEP_STEPS for 16-bit inputs (delta and softplus' computed once a
    channel and step, then loaded from the scratch), a 2-lane local pass, dB/dC partials in
    bfloat16 for bfloat16 B/C (BF16_PARTS, see scan.bc_part_dtype), ranges cut FINER 4. The
    chunk's pass and recompute, loops too short to hide their loads' latency, prefetch
    RECOMPUTE_STAGES - 1 tiles ahead with up to 16 states (with 64 states, 16 lanes a channel,
    the deeper prefetch was 16% slower), the tile walk STAGES - 1 (design §5)."""
    T = 8 if dtype.itemsize <= 4 else 4
    cfg = base_tiles(dim, dstate, B, C, T=T, NS=state_lanes(dstate, BWD, 4))
    return cfg | {"KEEP_STEPS": int(dtype.itemsize == 2), "FINER": 4, "BF16_PARTS": 1,
                  "RECOMPUTE_STAGES": 5 if dstate <= 16 else cfg["STAGES"],
                  "LOCAL_NS": state_lanes(dstate, BWD_LOCAL, 2)}  # fmt: skip


def two_channels(policy: TilePolicy, cfg: dict, dim, B: Tensor, C: Tensor, num_states, seqlen,
                 varlen: bool, rows=()) -> dict | None:  # fmt: skip
    """The backward's tiles of 2 channels a thread (CH 2: 16 channels a warp, which Triton lays
    2 lanes a channel, 8 states a thread) where they replace ``cfg``'s 1, else None (design
    §9). They repeat a channel's per-step work on half as many lanes and write half the dB/dC
    partials, but make half the programs, 8 an SM (their 255 registers take no wave cap): they
    pay where those fill their last wave, to 0.9 with KEEP_STEPS (16-bit inputs), to 0.7
    without (float32), a program a range where sequences are cut (their local pass keeps 1).
    Only for the measured tiles (T = 8, 16 padded states), a GPU's launch without packed
    sequences (not measured), and blocks of 16 channels of one B/C group."""
    u = rows[0] if rows else None
    dims, states, length = size_hint(dim), size_hint(num_states), size_hint(seqlen)
    if (cfg["T"], cfg["NS"] * cfg["NI"], cfg["CH"], cfg["num_warps"]) != (8, 16, 1, 1):
        return None
    if varlen or None in (dims, states, length) or u is None:
        return None
    if policy.sm_count is None and (not u.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    wide = derive_block(cfg | {"CH": 2}, dim, B, C)
    if size_hint(wide["BLOCK"]) != wide["BD"]:  # a B/C group's channels fill no 16-row block
        return None
    n_ranges = ranges(cfg, states, dims, length, varlen, policy.target_warps)[0]
    slots = BWD_PROGRAMS_PER_SM * sm_count(policy, u.device)
    programs = states * cdiv(dims, wide["BD"]) * n_ranges
    fill = programs / (cdiv(programs, slots) * slots)
    return wide if fill >= (0.9 if cfg["KEEP_STEPS"] else 0.7) else None


def lanes_fit(policy: TilePolicy, dtype: torch.dtype, B: Tensor, C: Tensor, seqlen,
              varlen: bool, rows=()) -> bool:  # fmt: skip
    """Whether the forward may take the lanes kernel (scan_fwd_lanes.py): a known length of at
    most 256 steps and a multiple of 16, no packed sequences, float32 arithmetic with fast math
    on a GPU, plain eager calls (traced launches take no register cap), variable B and C, and
    B, C and the per-step inputs `rows` (u, delta, z) in whole 16-byte vectors. Its PTX scan
    needs each thread's steps in its registers in order, which Triton's layouts give only when
    every load is whole vectors."""
    steps = LANES_STEPS[0] * LANES_STEPS[1]
    if not (isinstance(seqlen, int) and seqlen <= steps and seqlen % 16 == 0 and not varlen):
        return False
    if B.dim() == 2 or C.dim() == 2:
        return False
    tensors = [t for t in (B, C, *rows) if t is not None]
    cdt = torch.float64 if torch.float64 in (dtype, B.dtype, C.dtype) else torch.float32
    return (
        policy.uses_fast_math(B, cdt)
        and is_plain_eager(tensors)
        and all(_whole_vectors(t) for t in tensors)
    )


def _whole_vectors(t: Tensor) -> bool:
    """Rows of t load as whole 16-byte vectors (see lanes_fit)."""
    return (
        t.stride(-1) == 1 and all(s % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    )


def ranges(cfg: dict, num_states, dim, seqlen, varlen: bool, target_warps: int) -> tuple:
    """(number of ranges, range length) a sequence is cut into (see scan_fwd.py): more than one
    only when few (sequence, channel) pairs would leave the GPU idle (under target_warps), and
    never for packed sequences (they bring their own parallelism). A cut sequence is cut FINER
    times finer, in whole checkpoint chunks, and only into MIN_RANGES or more. Integer
    arithmetic without branches on sizes, so that symbolic sizes get the same ranges as eager
    calls without a guard, and compiled and eager results agree bit for bit."""
    chunks = cdiv(seqlen, CKPT)
    if varlen:
        return 1, chunks * CKPT
    # Counted in warps of one channel a thread: the backward's 2-channel tiles cut as its
    # 1-channel ones would.
    warps = num_states * cdiv(dim, cfg["BLOCK"]) * cfg["num_warps"] * cfg["CH"]
    factor = 1 + (cfg["FINER"] - 1) * sym_min(1, target_warps // warps // 2)
    wanted = sym_min(chunks, factor * target_warps // warps)
    wanted = sym_max(1, wanted * sym_min(1, wanted // MIN_RANGES))
    length = cdiv(chunks, wanted) * CKPT
    return cdiv(seqlen, length), length


def may_exceed_one(n_ranges) -> bool:
    """Whether the local launch is needed: skipped when there is surely one range; kept for
    symbolic counts, where an empty grid launches nothing."""
    return not isinstance(n_ranges, int) or n_ranges > 1
