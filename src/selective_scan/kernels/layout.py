"""How the scan kernels see their per-step tensors: row alignment, padded rows, B/C blocks.

The kernels load T-step tiles as 16-byte vectors only where Triton knows that rows start at
multiples of T (design §10). A launch gets that divisibility from Triton's launch-time
specialization (multiples of 16, ALIGN_PLAIN), declared by the launcher (sizes known, multiples
of T, ALIGN_DECLARED), or, while traced with symbolic sizes, checked at run time
(ALIGN_CHECKED: the launcher launches the declaring and the plain kernel with complementary
grids, ``checked_launches``).

A length that T does not divide gets rows padded to the next multiple (``padded``: symbolic
lengths too, by a guard, except under torch.export): the per-step inputs are copied into such
rows (``staged``), outputs are written into them and copied out (``unpadded``), and the kernels
load whole tiles (WIDE). Inputs contiguous in time whose rows start off multiples of T (views),
and steps broadcast in time, are copied likewise (``restaged``); inputs strided in time are not
(their loads are not vectors along time anyway). Exported calls with a symbolic length keep their
rows and pick the kernel at run time instead.

Variable B and C are copied once per call into blocks (``bc_block_tensors``, ``launch_bc_blocks``):
every (tile, state) row is T contiguous values the kernels load without masks or conversion.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from .bc_blocks import _bc_blocks_kernel
from .common import cdiv, sym_max, sym_min
from .launch import launch_kernel

ALIGN_PLAIN, ALIGN_DECLARED, ALIGN_CHECKED = 0, 1, 2
BC_BLOCK_ELEMENTS = 2048  # elements a program of _bc_blocks_kernel writes


def align_mode(T: int, wide: bool, rows, *row_strides) -> int:
    """The ALIGN of a launch whose rows hold `rows` steps and start at multiples of these
    strides. WIDE launches (packed sequences, padded rows) always want the declaration when it
    holds: only the declaring body loads whole tiles (common.tile_masks). A symbolic size counts
    as a multiple of T where its expression is one (padded rows, ``Rows``), without a guard;
    Triton's specialization knows nothing of symbolic sizes."""
    sizes = (rows, *row_strides)
    known = all(isinstance(v, int) for v in sizes)
    if not all(statically_known_true(v % T == 0) for v in sizes):
        return ALIGN_PLAIN if known else ALIGN_CHECKED
    if known and not wide and all(v % 16 == 0 for v in sizes):
        return ALIGN_PLAIN
    return ALIGN_DECLARED


def checked_launches(grid: tuple, T: int, sizes) -> list[tuple[int, tuple]]:
    """(ALIGN, grid) of the launches an ALIGN_CHECKED launch stands for: the declaring kernel
    with the whole grid where all sizes are multiples of T at run time, else the plain one; the
    other gets a grid of no program (a factor of 0 or 1, computed without a guard; grids known
    to be empty are left out). Two kernels, not one holding both bodies: that one took the
    larger body's registers, and fewer programs a wave (design §10)."""
    off = sym_min(1, sum(v % T for v in sizes))  # 0: every size a multiple of T
    parts = ((ALIGN_DECLARED, 1 - off), (ALIGN_PLAIN, off))
    return [
        (align, (grid[0] * k, *grid[1:]))
        for align, k in parts
        if not (isinstance(k, int) and k == 0)
    ]


def padded(seqlen, T: int) -> bool:
    """Whether rows of this length are padded: a length T does not divide. A symbolic one is
    decided by a guard under torch.compile: a graph for the lengths T divides, one for the
    others, which unpadded would run the plain kernels (time across lanes: S1's compiled forward
    4.7x slower than in padded rows, design §10). Under torch.export, where a guard on
    seqlen % T contradicts a dynamic length, and for a length without a value to guard on
    (unbacked), rows are not padded and the kernels check the alignment at run time. Either way
    is right for every length: the guard only picks the faster."""
    if isinstance(seqlen, int):
        return seqlen % T != 0
    return not torch.compiler.is_exporting() and guard_or_false(seqlen % T != 0)


def restaged(t: Tensor | None, pad: bool, T: int) -> bool:
    """Whether the per-step tensor t (batch, dim, seqlen) is copied into fresh rows: always
    when rows are padded (whole-tile loads read the padding), else when its steps are a
    broadcast (time stride 0: an expanded tensor, such as the gradient of a sum), or when it
    is a real tensor contiguous in time with rows that do not start at multiples of T. Triton
    lays a broadcast load's steps across lanes, which doubles the backward's instructions; traced
    calls copy a broadcast too (its stride is a plain 0, no guard), which Inductor would
    otherwise materialize once for every launch that reads it."""
    if t is None:
        return False
    if pad:
        return True
    strides, fake = t.stride(), is_fake(t)
    if type(strides[2]) is int and strides[2] == 0 and (fake or t.shape[2] > 1):
        return True
    return not fake and strides[2] == 1 and (strides[0] % T != 0 or strides[1] % T != 0)


class Rows(NamedTuple):
    """The rows a call's per-step tensors live in: (batch, dim, rows) with rows = seqlen, or
    seqlen padded to a multiple of T (pad)."""

    batch: object
    dim: object
    seqlen: object
    rows: object
    pad: bool


def new_rows(like: Tensor, r: Rows, dtype: torch.dtype) -> Tensor:
    """An uninitialized tensor shaped like `like` (batch, dim, seqlen), contiguous; for padded
    rows a view of their first seqlen steps, or where the length is symbolic the whole rows (a
    view's contiguity would guard on rows == seqlen)."""
    if not r.pad:
        return like.new_empty(like.shape, dtype=dtype)
    rows = like.new_empty((r.batch, r.dim, r.rows), dtype=dtype)
    return rows[..., : r.seqlen] if isinstance(r.seqlen, int) else rows


def staged(t: Tensor, r: Rows) -> Tensor:
    """t (batch, dim, seqlen) copied into fresh rows (new_rows); with a symbolic length, rows
    padded with zeros by a pad op (guard-free, where copying into a view guards)."""
    if not isinstance(r.seqlen, int):
        return F.pad(t, (0, r.rows - r.seqlen))
    out = new_rows(t, r, t.dtype)
    out.copy_(t)
    return out


def unpadded(t: Tensor, r: Rows) -> Tensor:
    """An output written by the kernels into new_rows as a contiguous tensor of seqlen steps."""
    if not r.pad:
        return t
    if not isinstance(r.seqlen, int):
        return F.pad(t, (0, r.seqlen - r.rows))  # a crop: a fresh tensor, no view's guards
    return t.contiguous()


def strides3(t: Tensor | None) -> tuple:
    """The three strides of a (batch, dim, seqlen) tensor; zeros for an absent one."""
    return (0, 0, 0) if t is None else tuple(t.stride())


def bc_tiles(seqlen, T: int):
    """Time tiles of pre-blocked B/C: ceil(seqlen / T), at least 2, so that no blocked
    dimension has size 1 (a symbolic size-1 dimension of a view becomes a guard under
    torch.export, which short dynamic lengths violate; a spare tile is cheap)."""
    return sym_max(cdiv(seqlen, T), 2)


class BlockLayout(NamedTuple):
    """What blocking B and C (`bc_block_tensors`) derives from their shapes and strides alone, which
    plans keep (computing it is a large share of a small eager call's host time)."""

    shapes: list  # of the blocks, one per variable source
    sizes: dict  # the block buffers (Bb, Cb) as ScanPlan.scratch takes them, in the compute dtype
    grid: tuple
    scalars: dict  # the launch's scalar arguments
    options: dict  # its constexprs but PDL


def bc_layout(B: Tensor, C: Tensor, T: int, NP: int, dtype: torch.dtype) -> BlockLayout | None:
    """The BlockLayout of blocking B and C into tiles of T steps and NP states, in dtype; None
    when neither is variable."""
    var = [t for t in (B, C) if t.dim() > 2]
    if not var:
        return None
    rows4 = [t if t.dim() == 4 else t.unsqueeze(1) for t in var]
    batch, _, dstate, seqlen = rows4[0].shape
    tiles = bc_tiles(seqlen, T)
    G = sym_max(rows4[0].shape[1], rows4[-1].shape[1])
    first, last = rows4[0], rows4[-1]  # B's and C's sources (one tensor when one is constant)
    TILES = max(1, BC_BLOCK_ELEMENTS // (NP * T))
    scalars = dict(seqlen=seqlen, dstate=dstate, tiles=tiles, G=G)
    for name, t in (("B", first), ("C", last)):
        s_b, s_g, s_n, s_t = t.stride()
        scalars |= {f"{name}_groups": t.shape[1], f"s_{name}b": s_b, f"s_{name}g": s_g,
                    f"s_{name}n": s_n, f"s_{name}t": s_t}  # fmt: skip
    shapes = [(batch, t.shape[1], tiles, NP, T) for t in rows4]
    # One source is read as both: its blocks are written once, to Bb; Cb is an empty spare (a
    # tensor passed twice as a kernel's output is cloned twice when a traced call is
    # functionalized, and the clone kept is the one never written).
    numels = [math.prod(shape) for shape in shapes] + [0]
    return BlockLayout(
        shapes=shapes,
        sizes={"Bb": (numels[0], dtype), "Cb": (numels[1], dtype)},
        grid=(batch * G, cdiv(tiles, TILES), len(var)),
        scalars=scalars,
        options=dict(NP=NP, T=T, TILES=TILES, num_warps=4),
    )


def bc_block_tensors(layout: BlockLayout | None, B: Tensor, C: Tensor, blocks: dict) -> dict:
    """What the scan kernels read as B and C ("B_ptr", "C_ptr") and the blocking launch's
    tensors ("Bsrc_ptr", "Csrc_ptr": the variable sources, "Bb_ptr", "Cb_ptr": their blocks in
    ``blocks``, flat, of ``layout.sizes``): "Bb" for the first variable one, "Cb" for C when
    both are. Constant B/C are read as they are; so are both without a layout."""
    if layout is None:
        return {"B_ptr": B, "C_ptr": C}
    var = [t for t in (B, C) if t.dim() > 2]
    made = iter((blocks["Bb"], blocks["Cb"]))
    read = [next(made) if t.dim() > 2 else t for t in (B, C)]
    return dict(B_ptr=read[0], C_ptr=read[1], Bsrc_ptr=var[0], Csrc_ptr=var[-1],
                Bb_ptr=blocks["Bb"], Cb_ptr=blocks["Cb"])  # fmt: skip


def launch_bc_blocks(layout: BlockLayout | None, tensors: dict, launchers=None, pdl=False):
    """Write the blocks of ``bc_block_tensors`` (in ``tensors``, with any others): one launch
    for both sources (kernels/bc_blocks.py), one pass over them; none without a layout."""
    if layout is not None:
        launch_kernel(launchers, _bc_blocks_kernel, layout.grid, tensors, layout.scalars,
                      layout.options | {"PDL": pdl}, key=("bc", pdl))  # fmt: skip


def tile_bc_scalars(name: str, t: Tensor, dim, tiles) -> dict:
    """The tile kernels' arguments for B or C (name): pre-blocked variable B/C (strides implied
    by the block layout, see bc_block_tensors), or constant (dim, dstate) with its strides."""
    if t.dim() == 2:
        groups, group, s_d, s_n = 1, 1, t.stride(0), t.stride(1)
    else:
        groups = 1 if t.dim() == 3 else t.shape[1]
        group, s_d, s_n = dim // groups, 0, 0
    return {"tiles": tiles, f"{name}_groups": groups, f"{name}_group": group,
            f"s_{name}d": s_d, f"s_{name}n": s_n}  # fmt: skip


def lanes_bc_scalars(name: str, t: Tensor, dim) -> dict:
    """The lanes kernel's arguments for a variable B or C (name), read in place: channels a
    group and the batch, group, state and step strides."""
    rows = t if t.dim() == 4 else t.unsqueeze(1)
    s_b, s_g, s_n, s_t = rows.stride()
    return {f"{name}_group": dim // rows.shape[1], f"s_{name}b": s_b, f"s_{name}g": s_g,
            f"s_{name}n": s_n, f"s_{name}t": s_t}  # fmt: skip
