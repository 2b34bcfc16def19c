"""Helpers shared by the kernel modules: host-side size arithmetic, then Triton functions.

Tile layout. Every per-step tensor is a [BD, NS, T] tile: BD channels, NS lanes that split the
states of a channel, T time steps. Loads are built so that T is the contiguous axis of whole
128-bit vectors, which makes Triton keep all T steps of a (channel, lane) in one thread: the
recurrence along time is then a plain in-thread loop, and picking step t or state i with a
compile-time index folds to a register read (`pick`, `put`). The states of a channel are split
as n = lane * NI + i: NI states per thread, NS threads per channel.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def cdiv(a, b):
    """Ceiling division for ints and SymInts, b > 0 (triton.cdiv is a JIT function, slow to
    call). Each operand appears once: nested divisions as (a + b - 1) // b repeat their
    symbolic divisors into longer sympy expressions, which Inductor compiles slower."""
    return -(-a // b)


def sym_min(a, b):
    """min for ints, torch.sym_min for SymInts (no guard)."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_min(a, b)


def sym_max(a, b):
    """max for ints, torch.sym_max for SymInts (no guard)."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_max(a, b)


def size_hint(v) -> int | None:
    """v if an int; for a symbolic size, its value in the example being traced (None where
    there is none, e.g. a size read from data). Reading it adds no guard."""
    if isinstance(v, int):
        return v
    hint = v.node.hint if isinstance(v, torch.SymInt) else None
    return hint if isinstance(hint, int) else None


def tl_dtype(dtype: torch.dtype):
    """The kernels' accumulation dtype for a compute dtype: float64, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


CARVE_ALIGN = 256  # bytes: where each carved buffer starts (Triton specializes on 16)


class Carving:
    """Flat buffers {name: (numel, dtype)} (ints), carved from one allocation of ``dtype`` for
    each call (``carving(like)``: uninitialized, on like's device), each starting at a multiple
    of CARVE_ALIGN bytes into it, as aligned as an allocation of its own. For what a call's
    kernels write and read internally, never returned: an allocation costs more host time than
    a view, and short eager calls wait on the host (design §11)."""

    __slots__ = ("dtype", "lengths", "names", "retyped", "total")

    def __init__(self, dtype: torch.dtype, sizes: dict):
        self.dtype, self.names = dtype, tuple(sizes)
        # Each buffer's length in units of dtype, rounded up to whole CARVE_ALIGN bytes.
        self.lengths = [cdiv(n * dt.itemsize, CARVE_ALIGN) * (CARVE_ALIGN // dtype.itemsize)
                        for n, dt in sizes.values()]  # fmt: skip
        self.total = sum(self.lengths)
        self.retyped = [(name, dt) for name, (_, dt) in sizes.items() if dt != dtype]

    def __call__(self, like: Tensor) -> dict[str, Tensor]:
        if not self.names:
            return {}
        whole = like.new_empty((self.total,), dtype=self.dtype)
        buffers = dict(zip(self.names, whole.split_with_sizes(self.lengths), strict=True))
        for name, dt in self.retyped:
            buffers[name] = buffers[name].view(dt)
        return buffers


def fresh_buffers(like: Tensor, sizes: dict) -> dict[str, Tensor]:
    """Flat uninitialized buffers {name: (numel, dtype)} on like's device, each an allocation
    of its own: what traced calls take instead of a Carving, so that Inductor sees buffers
    that are no views of one another."""
    return {name: like.new_empty((n,), dtype=dt) for name, (n, dt) in sizes.items()}


def fast_math(u: Tensor, cdt: torch.dtype) -> bool:
    """Whether kernels use MUFU approximations (inline PTX) for log and reciprocals: float32
    arithmetic on a GPU, never under the interpreter (which runs no PTX)."""
    return u.is_cuda and cdt == torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def block_and_sequence(dim, BD: tl.constexpr):
    """(block of BD channels, sequence, number of sequences) of this program. Both lie on the
    grid's first axis, blocks fastest (the launch order of a (blocks, sequences) grid): the
    other axes allow 65535 programs, fewer than a batch may have sequences."""
    n_blocks = (dim + BD - 1) // BD
    pid = tl.program_id(0)
    return pid % n_blocks, pid // n_blocks, tl.num_programs(0) // n_blocks


@triton.jit
def block_channels(blk, dim, BD: tl.constexpr, BLOCK: tl.constexpr):
    """(channel of each of the tile's BD rows, [BD]; whether the row is one of the program's
    BLOCK channels and below dim). A tile always has a whole warp's rows: a program of grouped
    B/C covers only channels of one group (BLOCK, a power of two dividing the group's channel
    count) and masks its other rows. With fewer rows than lanes, Triton lays the time axis
    across lanes and replicates values over the rest, and its scan lowering gave wrong
    results there on the H200 (design §9, "Tiles fill the warp")."""
    rows = tl.arange(0, BD)
    ch = blk * BLOCK + rows
    ok = ch < dim
    if BLOCK < BD:
        ok = ok & (rows < BLOCK)
    return ch, ok


@triton.jit
def combine(a1, x1, a2, x2):
    """Compose two steps h -> a h + x (first (a1, x1), then (a2, x2)). An explicit fma on the
    carry x1: x2 is often a product (delta u B), and LLVM contracted a2 * x1 + u * v into
    fma(u, v, a2 * x1), two dependent instructions a step on the chain (design §3)."""
    return a1 * a2, tl.fma(a2, x1, x2)


@triton.jit
def masked_pick(x, mask, axis: tl.constexpr):
    """x where mask holds along axis (once in each slice), that axis removed: a sum with -0.0
    elsewhere, which the compiler folds away where the mask is known at compile time
    (v + -0.0 is v for every v). -0.0 is made as 0.0 * -1.0: Triton stores a literal -0.0 as
    +0.0, and v + 0.0 is not v for v = -0.0, so it would stay an add."""
    return tl.sum(tl.where(mask, x, tl.zeros([], x.dtype) * -1.0), axis=axis)


@triton.jit
def pick(tile, idx, i):
    """tile[:, :, i] for a compile-time i, as [BD, NS]; idx is arange over the last axis."""
    return masked_pick(tile, idx == i, 2)


@triton.jit
def put(tile, idx, i, value):
    """tile with tile[:, :, i] = value ([BD, NS]) for a compile-time i."""
    return tl.where(idx == i, value[:, :, None], tile)


@triton.jit
def shift_right(tile, first, t_idx, T: tl.constexpr):
    """out[t] = tile[t - 1], out[0] = first ([BD, NS]): in-thread register moves."""
    out = put(tl.zeros_like(tile), t_idx, 0, first)
    for t in tl.static_range(1, T):
        out = put(out, t_idx, t, pick(tile, t_idx, t - 1))
    return out


@triton.jit
def reverse_recurrence(a, g, carry, t_idx, T: tl.constexpr):
    """dh[t] = g[t] + a[t+1] dh[t+1] along the in-thread time axis, last step first, where the
    term a[T] dh[T] from beyond the tile is `carry` ([BD, NS]). Written out step by step: Triton's
    reverse associative_scan shuffles across lanes even when the axis lies in one thread. The
    steps are fmas on the carry for the reason given in `combine` (g is dy C)."""
    acc = pick(g, t_idx, T - 1) + carry
    dh = put(tl.zeros_like(g), t_idx, T - 1, acc)
    for k in tl.static_range(T - 1):
        t = T - 2 - k
        acc = tl.fma(pick(a, t_idx, t + 1), acc, pick(g, t_idx, t))
        dh = put(dh, t_idx, t, acc)
    return dh


@triton.jit
def lane_swap(x, ch, bit: tl.constexpr):
    """x [BD, NS, K] of channel ch ^ bit (ch: arange over axis 0, whose channels lie on lanes):
    one shuffle per element (Triton lowers a gather within a warp to shuffles)."""
    return tl.gather(x, tl.broadcast_to(ch ^ bit, x.shape), axis=0)


@triton.jit
def _halving(x, ch, bit: tl.constexpr):
    """One level of channel_sums: x summed with channel ch ^ bit's."""
    if bit >= 1:
        if x.shape[2] >= 2:  # keep the upper half of the steps where ch has this bit
            halves = tl.reshape(x, (x.shape[0], x.shape[1], 2, x.shape[2] // 2))
            lo, hi = tl.split(tl.permute(halves, (0, 1, 3, 2)))  # in-thread register moves
            up = (ch & bit) != 0
            x = tl.where(up, hi, lo) + lane_swap(tl.where(up, lo, hi), ch, bit)
        else:
            x = x + lane_swap(x, ch, bit)
    return x


@triton.jit
def channel_sums(x, ch, BD: tl.constexpr):
    """Sums of x [BD, NS, T] over its BD channels (ch: their arange), reduce-scattered: each
    halving of the channels halves the steps a lane keeps, so the two lanes of a pair swap half
    their values (T/2 + T/4 + ... shuffles), where tl.sum's butterfly swaps all of them at every
    level (T log2 BD) and leaves every lane every sum. Returns [BD, NS, K], K = ceil(T / BD):
    channel ch keeps the steps of `sum_steps`; past K = 1 the halvings are butterflies."""
    # Written out: a constexpr cannot be reassigned in a loop. BD <= 32 channels.
    x = _halving(x, ch, BD // 2)
    x = _halving(x, ch, BD // 4)
    x = _halving(x, ch, BD // 8)
    x = _halving(x, ch, BD // 16)
    x = _halving(x, ch, BD // 32)
    return x


@triton.jit
def sum_steps(ch, BD: tl.constexpr, T: tl.constexpr):
    """(steps in the tile of the values channel_sums leaves with channel ch, [BD, 1, K]; whether
    ch is the first of the channels left holding the same values, when BD > T)."""
    K: tl.constexpr = (T + BD - 1) // BD  # BD and T are powers of two
    DUP: tl.constexpr = BD * K // T
    return (ch // DUP) * K + tl.arange(0, K)[None, None, :], ch % DUP == 0


@triton.jit
def exp(x):
    """e^x: one ex2.approx (MUFU) instruction in float32, exact in float64."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    return tl.math.exp2(x * LOG2E)


@triton.jit
def _mufu(x, instruction: tl.constexpr):
    return tl.inline_asm_elementwise(
        instruction, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def log(x, FAST: tl.constexpr):
    """ln x. FAST (float32 on a GPU, never in the interpreter): one MUFU lg2.approx, relative
    error below 2^-22, where Triton's own log is a ~20-instruction polynomial."""
    if FAST:
        return _mufu(x, "lg2.approx.ftz.f32 $0, $1;") * LN2
    return tl.log(x)


@triton.jit
def reciprocal(x, FAST: tl.constexpr):
    """1 / x. FAST: one MUFU rcp.approx (div.full.f32 adds range fix-ups). Else exact division
    (tl.fdiv with a tensor numerator: with a scalar one it computes in float32 for float64 x)."""
    if FAST:
        return _mufu(x, "rcp.approx.ftz.f32 $0, $1;")
    return tl.fdiv(tl.full(x.shape, 1.0, x.dtype), x, ieee_rounding=True)


@triton.jit
def softplus_and_grad(x, FAST: tl.constexpr):
    """(softplus(x) = log(1 + e^x), its derivative sigmoid(x)), both from one e^x: x above 20
    gives (x, 1) as in mamba; sigmoid(x) = e / w with w = 1 + e. log1p(e) keeps the relative
    precision of tiny results: FAST, by its series below e = 2^-6 (relative error below 2^-26;
    above, log(w) is off by at most 2^-24 / e from rounding w), so that it takes 2 MUFU, not 3;
    else as log(w) * e / (w - 1) (Kahan)."""
    e = exp(x)
    w = 1.0 + e
    if FAST:
        series = e * (1.0 - e * (0.5 - e * (0.3333333333333333 - e * 0.25)))
        log1p = tl.where(e < 0.015625, series, log(w, FAST))
    else:
        log1p = tl.where(w == 1.0, e, log(w, FAST) * e * reciprocal(w - 1.0, FAST))
    big = x > 20.0
    return tl.where(big, x, log1p), tl.where(big, 1.0, e * reciprocal(w, FAST))


@triton.jit
def softplus(x, FAST: tl.constexpr):
    """log(1 + e^x), see softplus_and_grad (the compiler drops the unused derivative)."""
    return softplus_and_grad(x, FAST)[0]


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    return reciprocal(1.0 + exp(-x), FAST)


@triton.jit
def row_offset(batch, s_b, ch, s_d, T: tl.constexpr, ALIGNED: tl.constexpr):
    """batch * s_b + ch * s_d ([BD, 1, 1] channels ch), declared a multiple of T when ALIGNED
    (the kernel checked the strides at run time): Triton then loads and stores T-step vectors
    from these rows. The hint goes on the computed offset, not on the strides: a kernel's or
    function's arguments carry no such attribute."""
    off_b = batch * s_b
    off_d = ch * s_d
    if ALIGNED:  # each term on its own: a sum may be folded away (batch is 0 for packed ones)
        off_b = tl.multiple_of(off_b, T)
        # A one-element tensor (one channel per program) is folded into a scalar, on which a
        # three-axis hint fails Triton's compile (AxisInfo assertion); it then goes without.
        if off_d.numel > 1:
            off_d = tl.multiple_of(off_d, [T, T, T])
    return off_b + off_d


@triton.jit
def tile_masks(row_ok, t, start, end, seqlen, T: tl.constexpr, WHOLE: tl.constexpr):
    """(steps of the tile inside [start, end), steps to load). Loads are masked like the steps,
    except WHOLE ones, which read every step of each tile that starts inside the row (t below
    seqlen rounded up to a multiple of T: the same for a whole tile) and zero the others
    afterwards. A packed sequence starts and ends anywhere, and so does the last tile of a
    length that is not a multiple of T; a mask varying inside a tile costs the loads their
    vector width, and the kernel its in-thread layout of the time axis. Rows must hold the
    rounded-up length (the launcher pads them, see kernels/layout.py)."""
    m = row_ok & (t >= start) & (t < end)
    if WHOLE:  # written so, Triton knows the bound is a multiple of T
        return m, row_ok & (t < ((seqlen + T - 1) // T) * T)
    return m, m


@triton.jit
def time_tile(base, t, t_stride, mask, load_mask, ACC: tl.constexpr, WHOLE: tl.constexpr):
    """Load [BD, NS, T] from base ([BD, NS, 1] pointers) + t ([1, 1, T]) * t_stride, 0 outside
    mask, as ACC (see tile_masks). Bases carry the NS axis even when they don't vary along it
    (u, delta, z), so that every time tile comes out in the same layout: no conversion inside
    the loop."""
    if WHOLE:
        x = tl.load(base + t * t_stride, mask=load_mask, other=0.0).to(ACC)
        return tl.where(mask, x, 0.0)
    return tl.load(base + t * t_stride, mask=mask, other=0.0).to(ACC)


@triton.jit
def delta_tile(dt_row, t, s_dt, mask, load_mask, bias, HAS_BIAS: tl.constexpr,
               SOFTPLUS: tl.constexpr, ACC: tl.constexpr, FAST: tl.constexpr,
               WHOLE: tl.constexpr):  # fmt: skip
    """(delta after its bias and softplus, 0 outside mask; softplus' of it, or unused without
    softplus) of one time tile (see time_tile): the forward drops the derivative, and the
    compiler with it."""
    dt = time_tile(dt_row, t, s_dt, mask, load_mask, ACC, WHOLE)
    if HAS_BIAS:
        dt += bias
    grad = dt
    if SOFTPLUS:
        dt, grad = softplus_and_grad(dt, FAST)
    return tl.where(mask, dt, 0.0), grad


@triton.jit
def load_states(ptrs, stride, limit, NI: tl.constexpr, row_ok, ACC: tl.constexpr):
    """[BD, NS, NI] values at ptrs ([BD, NS, 1], state lane * NI) + i * stride, states from
    `limit` (state count less lane * NI) on read as 0. One [BD, NS, 1] load per state i: a
    [BD, NS, NI] load of NI contiguous float32 states wider than a 16-byte vector (NI = 8, 2
    lanes) is laid over 2 threads, and Triton then lays the whole tile loop out so, with the
    time axis split across lanes (design §3)."""
    i_idx = tl.arange(0, NI)[None, None, :]
    out = tl.zeros([ptrs.shape[0], ptrs.shape[1], NI], ACC)
    for i in tl.static_range(NI):
        v = tl.load(ptrs + i * stride, mask=row_ok & (i < limit), other=0.0).to(ACC)
        out = tl.where(i_idx == i, v, out)
    return out


@triton.jit
def store_states(ptrs, stride, limit, values, NI: tl.constexpr, mask):
    """Store values [BD, NS, NI] (see load_states)."""
    i_idx = tl.arange(0, NI)[None, None, :]
    for i in tl.static_range(NI):
        v = pick(values, i_idx, i)[:, :, None]
        tl.store(ptrs + i * stride, v.to(ptrs.dtype.element_ty), mask=mask & (i < limit))
