"""The launch plan of a scan call: what the launchers derive from the inputs' layout alone.

A ``ScanPlan`` holds the compute dtype, the sizes, the tiles of the policy, the ranges, how the
per-step tensors are laid out (layout.py), and the arguments every launch of the forward's or
the backward's kernels shares, by name. Plans of real tensors are cached by layout (shapes,
strides, dtypes, devices, 16-byte alignment) and policy, with the direct launchers of their
eager launches (launch.py): a training loop repeats a few layouts, and checking and planning
again on every call is host time the GPU waits for on short kernels (design §11). Plans of
fake tensors (tracing, with possibly symbolic sizes) are built afresh and launch through
wrap_triton.
"""

from __future__ import annotations

import functools
import os
from collections import ChainMap
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_int

from .._checks import check_scan_inputs, compute_dtype
from ..scan_args import ScanArgs
from .common import Carving, cdiv, fresh_buffers, tl_dtype
from .launch import (
    Launcher,
    is_plain,
    is_plain_eager,
    launch_kernel,
    launch_sequence,
    on_device_of,
)
from .layout import (
    ALIGN_CHECKED,
    Rows,
    align_mode,
    bc_block_tensors,
    bc_layout,
    bc_tiles,
    checked_launches,
    lanes_bc_scalars,
    padded,
    restaged,
    staged,
    strides3,
    tile_bc_scalars,
)
from .tiles import CKPT, TilePolicy, derive_block, may_exceed_one, ranges

# The kernels' parameters of the scan's ten inputs, in ScanArgs' order.
INPUT_NAMES = ("u_ptr", "delta_ptr", "A_ptr", "B_ptr", "C_ptr", "D_ptr", "z_ptr", "bias_ptr",
               "h0_ptr", "cu_ptr")  # fmt: skip
_MAX_PLANS = 256  # cached plans; the cache is emptied when full, to stay small


def input_flags(args: ScanArgs) -> dict:
    """The kernels' constexpr flags of which inputs are present, packed or variable."""
    return dict(
        HAS_D=args.D is not None,
        HAS_Z=args.z is not None,
        HAS_BIAS=args.delta_bias is not None,
        HAS_H0=args.initial_state is not None,
        VARLEN=args.cu_seqlens is not None,
        B_VAR=args.B.dim() > 2,
        C_VAR=args.C.dim() > 2,
    )


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    """Whether launches on this device can overlap the one before them (PDL: NVIDIA, sm_90 on;
    not ROCm or the interpreter, which run no PTX)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


class ScanPlan:
    """What the forward's (backward=False) or the backward's launchers derive from the inputs'
    layout and the tile policy. Built by ``plan``."""

    def __init__(self, policy: TilePolicy, backward: bool, args: ScanArgs):
        check_scan_inputs(args)
        if args.A.is_complex():
            raise NotImplementedError(
                "selective_scan: the Triton kernels take real A; complex A runs on the PyTorch "
                "ops (torch.ops.selective_scan.scan_fwd), which selective_scan_fn picks for it"
            )
        u, B, C = args.u, args.B, args.C
        self.policy = policy
        self.cdt = cdt = compute_dtype(*args.floats)
        self.batch, self.dim, self.seqlen = batch, dim, seqlen = u.shape
        # The state size is a kernel constant (DSTATE, and the tiles' split of the states): a
        # symbolic one is specialized here; left symbolic, its next power of two becomes a long
        # sympy expression that the tiles and grids carry (design §16).
        self.dstate = guard_int(args.A.shape[1])
        self.num_states = args.num_states
        varlen = args.cu_seqlens is not None
        tiles = policy.bwd if backward else policy.fwd
        self.cfg = cfg = tiles(dim, self.dstate, u.dtype, B, C, self.num_states, seqlen, varlen,
                               (u, args.delta, args.z))  # fmt: skip
        self.NP = cfg["NS"] * cfg["NI"]
        self.n_blocks = cdiv(dim, cfg["BLOCK"])
        # The ranges' local pass may split the states over other lanes (LOCAL_NS): its results
        # are indexed by channel and state, whatever the layout that computed them. It keeps one
        # channel a thread where the full pass takes two (tiles.two_channels).
        local_ns = min(cfg["LOCAL_NS"], self.NP)
        self.local_tiles = derive_block(dict(cfg, NS=local_ns, NI=self.NP // local_ns, CH=1),
                                        dim, B, C)  # fmt: skip
        self.n_ranges, range_len = ranges(cfg, self.num_states, dim, seqlen, varlen,
                                          policy.target_warps)  # fmt: skip
        T = cfg["T"]
        lanes = cfg.get("LANES", 0)
        # The lanes kernel masks its steps: no padded rows.
        self.pad = pad = policy.pad_rows and padded(seqlen, T) and not lanes
        self.rows = cdiv(seqlen, T) * T if pad else seqlen
        self.layout = Rows(batch, dim, seqlen, self.rows, pad)
        # Which of u, delta, z are copied into fresh rows, and their strides as the kernels see.
        self.copied = [restaged(t, pad, T) for t in (u, args.delta, args.z)]
        u_s, delta_s, z_s = (
            (dim * self.rows, self.rows, 1) if copy else strides3(t)
            for t, copy in zip((u, args.delta, args.z), self.copied, strict=True)
        )
        A, D, bias, h0 = args.A, args.D, args.delta_bias, args.initial_state
        if lanes:
            bc = lanes_bc_scalars("B", B, dim) | lanes_bc_scalars("C", C, dim)
        else:
            tiles_bc = bc_tiles(seqlen, T)
            bc = tile_bc_scalars("B", B, dim, tiles_bc) | tile_bc_scalars("C", C, dim, tiles_bc)
        s_hb, s_hd, s_hn = strides3(h0)
        # The arguments every scan launch of this plan shares (both kernels' leading scalars).
        self.scalars = dict(
            dim=dim, seqlen=seqlen, RL=range_len, n_ranges=self.n_ranges,
            s_ub=u_s[0], s_ud=u_s[1], s_ut=u_s[2], s_db=delta_s[0], s_dd=delta_s[1],
            s_dt=delta_s[2], s_zb=z_s[0], s_zd=z_s[1], s_zt=z_s[2],
            s_Ad=A.stride(0), s_An=A.stride(1), **bc,
            s_D=0 if D is None else D.stride(0), s_bias=0 if bias is None else bias.stride(0),
            s_hb=s_hb, s_hd=s_hd, s_hn=s_hn,
        )  # fmt: skip
        # What the launches' ALIGN is decided on: the rows' length and where they start.
        self.align_sizes = (self.rows, *u_s[:2], *delta_s[:2], *z_s[:2])
        self.bc_layout = None if lanes else bc_layout(B, C, T, self.NP, cdt)
        wide = varlen or pad
        fast = policy.uses_fast_math(u, cdt)
        self.flags = dict(
            DSTATE=self.dstate, NS=cfg["NS"], NI=cfg["NI"], BD=cfg["BD"], BLOCK=cfg["BLOCK"],
            T=T, CKPT=CKPT, **input_flags(args), ACC=tl_dtype(cdt), FAST=fast,
            STAGES=cfg["STAGES"], num_warps=cfg["num_warps"], WIDE=wide,
            ALIGN=self.align(wide, self.align_sizes),
            # A register cap only as a tuning override (a policy's tiles, eager calls).
            **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}),
        )  # fmt: skip
        # PDL (programmatic dependent launch, Hopper on): the forward's first scan launch starts
        # while the B/C blocking launch before it runs, and waits for it only after its PRE
        # pass, which reads none of the blocks (design §15). Only where the blocking launch is
        # the one right before it (no rows staged, no cu_seqlens copied in between).
        pdl = _device_has_pdl(u.device) if policy.pdl is None else policy.pdl
        self.pdl = (
            cfg.get("PRE", 0) > 0  # the backward's tiles have no PRE
            and (B.dim() > 2 or C.dim() > 2)
            and not any(self.copied)
            and (args.cu_seqlens is None or args.cu_seqlens.is_contiguous())
            and pdl
        )
        # Direct launchers (launch.py) of eager calls, by the launch's own arguments; None for
        # plans built while tracing, which launch through wrap_triton.
        self.launchers: dict[tuple, Launcher] | None = None
        # The launchers a direct call ran, in order, by what else its launches depended on.
        self.sequences: dict[tuple, list[Launcher]] | None = None
        # Eager plans: an empty tensor passed for the buffers a launch does not use (no PRE
        # pass, one range): allocating one each call is measurable host time.
        self.unused: Tensor | None = None
        # The backward's grad_sums launch (grid, scalars, constexprs), made at its first call.
        self.sums: tuple | None = None
        # Eager plans: how a call's internal buffers are carved (``scratch``), from the first.
        self.carving: Carving | None = None

    def align(self, wide: bool, sizes: tuple) -> int:
        """The ALIGN of a launch on rows of these sizes (layout.align_mode), or the policy's."""
        if self.policy.align is not None:
            return self.policy.align
        return align_mode(self.cfg["T"], wide, *sizes)

    def direct(self, u: Tensor) -> dict[tuple, Launcher] | None:
        """The launchers of this call's launches: the plan's direct ones when launching now is
        plain eager on CUDA tensors, else None (through wrap_triton, which tracing records).
        Decided once a call, not at each of its launches (host time)."""
        if self.launchers is None or not u.is_cuda or not is_plain_eager((u,)):
            return None
        return self.launchers

    def tensors(self, args: ScanArgs, scratch: dict) -> dict:
        """The kernels' input tensors by parameter name: u, delta and z in fresh rows where the
        plan says so, cu_seqlens dense, and variable B/C as their blocks in the call's
        ``scratch`` with the blocking launch's tensors (layout.bc_block_tensors)."""
        u, delta, A, B, C, D, z, bias, h0, cu = args.tensors
        u, delta, z = (
            staged(t, self.layout) if copy else t
            for t, copy in zip((u, delta, z), self.copied, strict=True)
        )
        if cu is not None:  # the kernels read it as a dense array
            cu = cu.contiguous()
        tensors = dict(zip(INPUT_NAMES, (u, delta, A, B, C, D, z, bias, h0, cu), strict=True))
        return tensors | bc_block_tensors(self.bc_layout, B, C, scratch)

    def run(self, launchers, key: tuple, tensors: dict, launch: Callable[[], None]) -> None:
        """``launch()``: a call's launches, each reading its tensors from ``tensors`` by name,
        on the inputs' device (launch.on_device_of). With direct launchers (``direct``), the
        plan keeps the sequence of launchers it ran, by ``key`` (what the launches depend on
        besides the plan), and later calls run that sequence on their own ``tensors``
        (launch.launch_sequence)."""
        sequences = None if launchers is None else self.sequences
        with on_device_of(tensors["u_ptr"]):
            launch_sequence(sequences, key, tensors, launch)

    def launches(self):
        """(LOCAL flag, grid, tile flags) of each scan launch: the ranges' local pass first when
        there are several ranges (see scan_fwd.py), with its own tiles, then the full pass; the
        caller launches the range entries between them. Grids are (blocks of channels x
        sequences, 1, ranges), see common.block_and_sequence."""
        states, count = self.num_states, self.n_ranges
        if may_exceed_one(count):
            lt = self.local_tiles
            tiles = dict(NS=lt["NS"], NI=lt["NI"], BD=lt["BD"], BLOCK=lt["BLOCK"])
            yield True, (cdiv(self.dim, lt["BLOCK"]) * states, 1, count - 1), tiles
        yield False, (self.n_blocks * states, 1, count), {}

    def unused_buffer(self, u: Tensor) -> Tensor:
        """A tensor for a buffer the launches do not use (its pointer is passed, never read)."""
        return u.new_empty((0,), dtype=self.cdt) if self.unused is None else self.unused

    def scratch(self, u: Tensor, sizes: Callable[[], dict]) -> dict[str, Tensor]:
        """This call's internal buffers by name, flat and uninitialized: the B/C blocks ("Bb",
        "Cb", layout.bc_blocks), the local launch's per-range results, states (ranges,
        sequences, dim, NP) as "hloc" and sum(delta) (ranges, sequences, dim) as "dtsum", and
        what the launcher adds, ``sizes()`` ({name: (numel, dtype)}). Eager plans carve them
        from one allocation (common.Carving, made at their first call); eager calls of one range
        get the unused buffer for the range results. Other plans (traced calls) allocate each
        (common.fresh_buffers), the range results with the range count as a dimension, guarded
        on (design §16)."""
        if self.carving is None:
            wanted = {} if self.bc_layout is None else dict(self.bc_layout.sizes)
            if self.unused is None or may_exceed_one(self.n_ranges):
                per_range = self.n_ranges * self.num_states * self.dim
                wanted |= {"hloc": (per_range * self.NP, self.cdt),
                           "dtsum": (per_range, self.cdt)}  # fmt: skip
            wanted |= sizes()
            if self.unused is None:
                return fresh_buffers(u, wanted)
            self.carving = Carving(self.cdt, wanted)
        buffers = self.carving(u)
        if "hloc" not in buffers:
            buffers["hloc"] = buffers["dtsum"] = self.unused
        return buffers

    def launch(self, launchers, kernel, grid: tuple, tensors: dict, scalars: dict,
               flags: dict, align_sizes: tuple) -> None:  # fmt: skip
        """kernel[grid](**tensors, **self.scalars, **scalars, **self.flags, **flags) with this
        call's launchers (``direct``); an ALIGN_CHECKED launch as the two of
        ``checked_launches`` on `align_sizes` (the rows' length and the strides of the rows it
        reads and writes). ``scalars`` and ``flags`` are what the launch adds to the plan; they
        pick its launcher."""
        options = self.flags | flags
        variants = [(options["ALIGN"], grid)]
        if options["ALIGN"] == ALIGN_CHECKED:
            variants = checked_launches(grid, self.cfg["T"], align_sizes)
        # A view of both, not a merged copy: a cached launcher reads neither (host time).
        arguments = ChainMap(scalars, self.scalars)
        for align, part in variants:
            key = (kernel, part, tuple(scalars.values()), align, *flags.values())
            launch_kernel(launchers, kernel, part, tensors, arguments, options | {"ALIGN": align},
                          key=key)  # fmt: skip


_PLANS: dict[tuple, ScanPlan] = {}


def plan(policy: TilePolicy, backward: bool, args: ScanArgs) -> ScanPlan:
    """The ScanPlan of these inputs: cached for real tensors (by layout and policy), built
    afresh for fake ones. Checks raise before anything is cached."""
    tensors = args.tensors
    if not is_plain(tensors[0]) and is_fake(tensors[0]):  # is_plain first: it costs less
        return ScanPlan(policy, backward, args)
    # 16-byte alignment too: the lanes kernel is chosen only for aligned rows (tiles.lanes_fit).
    key = (policy, backward, *[None if t is None else
                               (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                               for t in tensors])  # fmt: skip
    found = _PLANS.get(key)
    if found is None:
        found = ScanPlan(policy, backward, args)
        found.launchers, found.sequences = {}, {}
        found.unused = tensors[0].new_empty((0,), dtype=found.cdt)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = found
    return found
