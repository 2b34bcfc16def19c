"""Launchers of the Triton scan kernels: the bodies of the ``*_triton`` ops.

They only allocate outputs and launch kernels (through ``wrap_triton`` when traced, directly in
plain eager calls; no data-dependent Python). The forward is a ``triton_op``: Inductor traces it
and compiles its kernels into its generated code. The backward op is opaque to the compiler
(ops.py), so its launcher only ever runs on real tensors. The tiles come from the active tile
policy (tiles.current_policy), the layout of the call from its plan (plan.py).

Memory: the forward saves nothing beyond its outputs; checkpoints hold the state every CKPT
steps, batch * dim * (ceil(seqlen / CKPT) + 1) * dstate float32 (for CKPT = 128, dstate = 16
that is 0.5 bytes per (batch, dim, step), a quarter of a bf16 input). The backward's scratch adds
partial sums of dB/dC per block of channels: batch * ceil(dim / BLOCK) * dstate * seqlen values
each for variable B/C (bfloat16 for bfloat16 B/C, see `bc_part_dtype`), and per program the
entry states of the tiles of one chunk (for 16-bit inputs also their delta and softplus').
Lengths that T does not divide add a padded copy of each per-step input and output while a call
runs (layout.py).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .._checks import check_cu_seqlens_values, check_scan_grads, checkpoint_slots
from ..scan_args import ScanArgs
from .common import cdiv, sym_min
from .grad_sums import GRAD_SUM_ELEMENTS, _grad_sums_kernel
from .launch import launch_kernel
from .layout import bc_tiles, launch_bc_blocks, new_rows, restaged, staged, unpadded
from .plan import ScanPlan, plan
from .range_entries import _range_entries_kernel
from .scan_bwd import _scan_bwd_kernel
from .scan_fwd import _scan_fwd_kernel
from .scan_fwd_lanes import _scan_fwd_lanes_kernel
from .tiles import BWD_PROGRAMS_PER_SM, CKPT, LANES_STEPS, TilePolicy, current_policy, sm_count

__all__ = ["CKPT", "scan_bwd", "scan_bwd_autograd", "scan_fwd"]


def _range_entries(p: ScanPlan, launchers, tensors: dict, reverse: bool) -> None:
    """Turn the local launch's per-range results ("hloc_ptr", "dtsum_ptr" of ``tensors``: of
    ScanPlan.scratch) into the state entering each range (forward; "init_ptr" the
    initial_state) or the gradient leaving it (backward, reverse; "init_ptr" the dlast_state),
    in place: kernels/range_entries.py."""
    A, init = tensors["A_ptr"], tensors["init_ptr"]
    BD = max(1, 32 // p.NP)  # a value of each range's results a lane
    # No program for a single range: traced calls keep this launch for a symbolic count (see
    # tiles.may_exceed_one), and programs with nothing to fold cost time.
    programs = cdiv(p.dim, BD) * p.num_states * sym_min(1, p.n_ranges - 1)
    grid = (programs, 1, 1)  # Inductor's launchers want three axes
    s_ib, s_id, s_in = (0, 0, 0) if init is None else init.stride()
    scalars = dict(dim=p.dim, n_ranges=p.n_ranges, s_Ad=A.stride(0), s_An=A.stride(1),
                   s_ib=s_ib, s_id=s_id, s_in=s_in)  # fmt: skip
    options = dict(DSTATE=p.dstate, NP=p.NP, BD=BD, RB=p.policy.range_block, REVERSE=reverse,
                   HAS_INIT=init is not None, ACC=p.flags["ACC"], num_warps=1)  # fmt: skip
    # The key holds every argument: a backward plan (keyed by the scan's inputs) serves calls
    # with and without dlast_state, of any strides.
    key = (_range_entries_kernel, grid, *scalars.values(), *options.values())
    launch_kernel(launchers, _range_entries_kernel, grid, tensors, scalars, options, key=key)


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
    args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens,
                    delta_softplus)  # fmt: skip
    return launch_fwd(args, current_policy())


def forward_scratch(p: ScanPlan) -> dict:
    """The forward's own buffers, {name: (numel, dtype)} (ScanPlan.scratch): with a PRE pass
    (tiles.fwd_tiles), delta after its bias and softplus, in rows laid out like out's."""
    return {"pre": (p.batch * p.dim * p.rows, p.cdt)} if p.cfg["PRE"] else {}


def launch_fwd(args: ScanArgs, policy: TilePolicy) -> tuple[Tensor, Tensor, Tensor]:
    """scan_fwd with the tiles of ``policy``."""
    p = plan(policy, False, args)
    u, cu_seqlens = args.u, args.cu_seqlens
    if cu_seqlens is not None and not is_fake(cu_seqlens):  # eager only: reads it to the host
        check_cu_seqlens_values(cu_seqlens, p.seqlen)
    out = new_rows(u, p.layout, u.dtype)
    last = u.new_empty((p.num_states, p.dim, p.dstate), dtype=p.cdt)
    ckpt = u.new_empty((p.batch, p.dim, checkpoint_slots(p.seqlen, CKPT), p.dstate), dtype=p.cdt)
    scratch = p.scratch(u, lambda: forward_scratch(p))
    launchers = p.direct(u)
    tensors = p.tensors(args, scratch) | dict(
        out_ptr=out, last_ptr=last, ckpt_ptr=ckpt, hloc_ptr=scratch["hloc"],
        dtsum_ptr=scratch["dtsum"], pre_ptr=scratch.get("pre", p.unused_buffer(u)),
        init_ptr=args.initial_state,
    )  # fmt: skip

    def launch() -> None:
        # Eager launches only: Inductor's and AOTInductor's launchers set no launch attributes.
        pdl = p.pdl and launchers is not None
        launch_bc_blocks(p.bc_layout, tensors, launchers, pdl)
        s_ob, s_od, _ = out.stride()
        s_kb, s_kd, s_kc, _ = ckpt.stride()
        s_lb, s_ld, _ = last.stride()
        scalars = dict(s_ob=s_ob, s_od=s_od, s_kb=s_kb, s_kd=s_kd, s_kc=s_kc, s_lb=s_lb,
                       s_ld=s_ld)  # fmt: skip
        kernel, lanes = _scan_fwd_kernel, {}
        if p.cfg.get("LANES"):
            full = p.seqlen == LANES_STEPS[0] * LANES_STEPS[1]  # no masks (scan_fwd_lanes.py)
            kernel, lanes = _scan_fwd_lanes_kernel, {"LANES": p.cfg["LANES"], "FULL": full}
            if launchers is not None and "maxnreg" not in p.cfg:  # traced launches take no cap
                lanes["maxnreg"] = policy.lanes_maxnreg
        for local, grid, tiles in p.launches():
            flags = dict(SOFTPLUS=args.delta_softplus, LOCAL=local, PRE=p.cfg["PRE"],
                         EPI=p.cfg["EPI"], PDL=pdl, **tiles, **lanes)  # fmt: skip
            if pdl:  # the first launch only: the one right after the blocking launch
                flags["launch_pdl"] = True
                pdl = False
            p.launch(launchers, kernel, grid, tensors, scalars, flags, p.align_sizes)
            if local:
                _range_entries(p, launchers, tensors, reverse=False)

    # Everything the launches depend on that the plan's key leaves out.
    p.run(launchers, (args.delta_softplus,), tensors, launch)
    return unpadded(out, p.layout), last, ckpt


def wave_cap(p: ScanPlan, u: Tensor, launchers) -> dict:
    """A register cap for the backward's full launch in an eager call on a GPU, where it fits
    the grid into fewer waves: the usual backward kernel (T = 8, 16 padded states, one channel
    a thread) takes 254 registers, 8 one-warp programs an SM; capped at 168 (16 bytes of stack),
    12. A wave of 12 takes longer than one of 8 (S2: two of each, 1.60 against 1.38 ms), so only
    a grid that needs fewer of them gains (S1's 1.45 waves of 8 become one, S5's 3.9 three: 1.35
    against 1.40 ms; S7's 4.9 four: equal; design §9). Only for direct launches: wrap_triton
    takes no register cap."""
    if launchers is None or "maxnreg" in p.cfg or (p.cfg["T"], p.NP, p.cfg["CH"]) != (8, 16, 1):
        return {}
    sms = sm_count(p.policy, u.device)
    programs = p.n_blocks * p.num_states * p.n_ranges
    capped = cdiv(programs, 12 * sms) < cdiv(programs, BWD_PROGRAMS_PER_SM * sms)
    return {"maxnreg": 168} if capped else {}


def backward_align(p: ScanPlan, dout: Tensor) -> tuple[int, tuple]:
    """The backward's ALIGN and the sizes it is decided on: the plan's, and dout's rows
    (declared when the inputs' rows are multiples of 16 but dout's only of T; plain when dout
    is strided in time)."""
    sizes = (*p.align_sizes, *dout.stride()[:2])
    return p.align(p.flags["WIDE"], sizes), sizes


def _fresh(t: Tensor, like: Tensor) -> Tensor:
    """t as a contiguous tensor of its own with like's shape and dtype (no aliasing, stable
    strides): t itself when it is one already, else a copy."""
    own = t._base is None and t.is_contiguous()
    if own and t.shape == like.shape and t.dtype == like.dtype:
        return t
    out = like.new_empty(like.shape)
    out.view(t.shape).copy_(t)
    return out


def bc_part_dtype(p: ScanPlan, t: Tensor) -> torch.dtype:
    """The dtype of the backward's per-block partial sums of variable dB or dC: bfloat16 for
    bfloat16 B or C (BF16_PARTS), else the compute dtype. Each partial (a float32 sum over a
    block's channels) is rounded once, the partials are summed in float32 and the sum rounded to
    bfloat16: half the bytes written and read back, for an error against float64 gradients
    sqrt(2) times that of rounding the exact gradient to bfloat16 (design §12)."""
    bf16 = t.dtype == torch.bfloat16 and p.cfg.get("BF16_PARTS", 0) == 1
    return torch.bfloat16 if bf16 else p.cdt


def backward_scratch(p: ScanPlan, args: ScanArgs) -> dict:
    """The backward's own buffers, {name: (numel, dtype)} (ScanPlan.scratch): partial sums
    per (sequence, range) of dA, dD, ddelta_bias and constant dB/dC, per (batch, block of
    channels, tile) of variable dB/dC; the chunks' scratch (see scan_bwd.py)."""
    dim, NP, T, cdt = p.dim, p.NP, p.cfg["T"], p.cdt
    programs = p.num_states * p.n_ranges

    def bc_part(t):
        if t.dim() == 2:
            return programs * dim * NP, cdt
        return p.batch * p.n_blocks * bc_tiles(p.seqlen, T) * NP * T, bc_part_dtype(p, t)

    per_tile = p.cfg["BD"] * (NP + 2 * T * p.cfg["KEEP_STEPS"])
    sizes = dict(dA_part=(programs * dim * NP, cdt), dB_part=bc_part(args.B),
                 dC_part=bc_part(args.C),
                 scratch=(programs * p.n_blocks * (CKPT // T) * per_tile, cdt))  # fmt: skip
    for name, t in (("dD_part", args.D), ("dbias_part", args.delta_bias)):
        if t is not None:  # the kernels write these only for D and delta_bias
            sizes[name] = (programs * dim, cdt)
    return sizes


def grad_sum_tile(p: ScanPlan, rows: int, M: int) -> int:
    """BM of a grad_sums job of `rows` rows of M sums: the widest of 1024, 256, 64, 16 giving it
    the policy's sum_programs programs. Fewer programs leave the GPU short of loads in flight;
    narrower tiles than needed cost more programs and masked loads (design §12). From the sizes
    alone, not the device, so the order of the sums is the same everywhere."""
    for BM in (1024, 256, 64):
        if rows * cdiv(M, BM) >= p.policy.sum_programs:
            return BM
    return 16


def grad_sums_launch(p: ScanPlan, B: Tensor, C: Tensor, D: Tensor | None,
                     delta_bias: Tensor | None) -> tuple:  # fmt: skip
    """(grid, scalars, constexprs) of grad_sums' launch: the plan's sizes and which inputs are
    variable or present decide them, so eager plans keep them (``ScanPlan.sums``)."""
    batch, dim, NP, T = p.batch, p.dim, p.NP, p.cfg["T"]
    tiles = bc_tiles(p.seqlen, T)
    groups = [1 if t.dim() < 4 else t.shape[1] for t in (B, C)]
    BM_STATES = grad_sum_tile(p, 1, dim * NP)
    BM_STEPS = p.policy.sum_tile or grad_sum_tile(p, batch * max(groups), tiles * NP * T)
    BM_CHANNELS = grad_sum_tile(p, 1, dim)
    # Programs of dA, dB, dC, dD and ddelta_bias (grad_sums.py's table): rows * cdiv(M, BM).
    counts = [cdiv(dim * NP, BM_STATES)]
    for t, g in zip((B, C), groups, strict=True):
        counts.append(batch * g * cdiv(tiles * NP * T, BM_STEPS) if t.dim() > 2 else counts[0])
    counts += [0 if t is None else cdiv(dim, BM_CHANNELS) for t in (D, delta_bias)]
    ends = list(itertools.accumulate(counts))  # each job's range of the grid ends there
    grid = (ends[-1], 1, 1)
    scalars = dict(
        programs=p.num_states * p.n_ranges, dim=dim, dstate=p.dstate, seqlen=p.seqlen,
        tiles=tiles, blocks=p.n_blocks, B_groups=groups[0], C_groups=groups[1],
        end_A=ends[0], end_B=ends[1], end_C=ends[2], end_D=ends[3],
    )  # fmt: skip
    options = dict(NP=NP, T=T, B_VAR=B.dim() > 2, C_VAR=C.dim() > 2, HAS_D=D is not None,
                   HAS_BIAS=delta_bias is not None, BM_STATES=BM_STATES, BM_STEPS=BM_STEPS,
                   BM_CHANNELS=BM_CHANNELS, ELEMENTS=GRAD_SUM_ELEMENTS, ACC=p.flags["ACC"],
                   num_warps=4)  # fmt: skip
    return grid, scalars, options


# The backward kernel's partial sums and the sums of each, by grad_sums' parameter names.
PART_NAMES = ("dA_part", "dB_part", "dC_part", "dD_part", "dbias_part")
SUM_NAMES = ("dA", "dB", "dC", "dD", "dbias")


def grad_sum_tensors(p: ScanPlan, args: ScanArgs, parts: dict) -> tuple[tuple, dict]:
    """(dA, dB, dC, dD, ddelta_bias), each a fresh contiguous tensor of its input's shape and
    dtype, None for an absent D or delta_bias; and what the grad_sums launch reads and writes,
    by its parameter names: the backward kernel's partial sums ``parts`` and those gradients
    (the plan's unused buffer for absent ones)."""
    inputs = (args.A, args.B, args.C, args.D, args.delta_bias)
    outs = tuple(None if t is None else t.new_empty(t.shape) for t in inputs)
    unused = p.unused_buffer(args.A)
    tensors = dict(parts)
    for name, t in zip(SUM_NAMES, outs, strict=True):
        tensors[name] = unused if t is None else t
    return outs, tensors


def launch_grad_sums(p: ScanPlan, launchers, tensors: dict, args: ScanArgs) -> None:
    """The gradients of ``grad_sum_tensors`` from the backward kernel's partial sums, in one
    launch of kernels/grad_sums.py."""
    if p.sums is None:  # the plan's first backward
        p.sums = grad_sums_launch(p, args.B, args.C, args.D, args.delta_bias)
    grid, scalars, options = p.sums
    launch_kernel(launchers, _grad_sums_kernel, grid, tensors, scalars, options,
                  key=("grad_sums",))  # fmt: skip


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
    args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens,
                    delta_softplus)  # fmt: skip
    return launch_bwd(dout, dlast_state, args, checkpoints, current_policy())


def scan_bwd_autograd(dout: Tensor, dlast_state: Tensor | None, *args) -> tuple:
    """scan_bwd (same arguments: the forward's ten inputs, checkpoints, delta_softplus) as the
    forward op's autograd backward calls it in plain eager calls (ops.run_backward), without
    the checks and allocations that call does not need: autograd has checked dout and
    dlast_state against the forward's outputs (shape, dtype, device), the checkpoints are the
    forward's own, and the gradients of absent inputs are None, not empty tensors (autograd
    takes None for them; design §1.5)."""
    *inputs, checkpoints, delta_softplus = args
    return launch_bwd(dout, dlast_state, ScanArgs(*inputs, delta_softplus), checkpoints,
                      current_policy(), for_autograd=True)  # fmt: skip


def launch_bwd(dout: Tensor, dlast_state: Tensor | None, args: ScanArgs, checkpoints: Tensor,
               policy: TilePolicy, for_autograd: bool = False) -> tuple:  # fmt: skip
    """scan_bwd with the tiles of ``policy``; scan_bwd_autograd's with ``for_autograd``."""
    p = plan(policy, True, args)
    u = args.u
    dim, dstate, cdt, T = p.dim, p.dstate, p.cdt, p.cfg["T"]
    if not for_autograd:
        check_scan_grads(dout, dlast_state, checkpoints, args, CKPT, cdt)
    unused = p.unused_buffer(u)
    du = new_rows(u, p.layout, u.dtype)
    ddelta = new_rows(u, p.layout, args.delta.dtype)
    dz = unused if args.z is None else new_rows(u, p.layout, args.z.dtype)
    if restaged(dout, p.pad, T):
        dout = staged(dout, p.layout)
    scratch = p.scratch(u, lambda: backward_scratch(p, args))
    parts = {name: scratch.get(name, unused) for name in PART_NAMES}
    has_h0 = args.initial_state is not None
    dh0 = u.new_empty((p.num_states, dim, dstate), dtype=cdt) if has_h0 else unused
    (dA, dB, dC, dD, dbias), sum_tensors = grad_sum_tensors(p, args, parts)
    launchers = p.direct(u)
    tensors = p.tensors(args, scratch) | sum_tensors | dict(
        dout_ptr=dout, dlast_ptr=dlast_state, ckpt_ptr=checkpoints,
        scratch_ptr=scratch["scratch"], du_ptr=du, ddelta_ptr=ddelta, dz_ptr=dz,
        dA_ptr=parts["dA_part"], dB_ptr=parts["dB_part"], dC_ptr=parts["dC_part"],
        dD_ptr=parts["dD_part"], dbias_ptr=parts["dbias_part"], dh0_ptr=dh0,
        dhloc_ptr=scratch["hloc"], dtsum_ptr=scratch["dtsum"], hloc_ptr=scratch["hloc"],
        init_ptr=dlast_state,
    )  # fmt: skip

    def launch() -> None:
        launch_bc_blocks(p.bc_layout, tensors, launchers)
        s_ob, s_od, s_ot = dout.stride()
        s_lb, s_ld, s_ln = (0, 0, 0) if dlast_state is None else dlast_state.stride()
        s_kb, s_kd, s_kc, _ = checkpoints.stride()
        scalars = dict(n_blocks=p.n_blocks, rows=p.rows, s_ob=s_ob, s_od=s_od, s_ot=s_ot,
                       s_lb=s_lb, s_ld=s_ld, s_ln=s_ln, s_kb=s_kb, s_kd=s_kd,
                       s_kc=s_kc)  # fmt: skip
        align, align_sizes = backward_align(p, dout)
        cap = wave_cap(p, u, launchers)
        for local, grid, tiles in p.launches():
            # The cap is the full pass's (its grid, its kernel); the local pass is smaller.
            flags = dict(SOFTPLUS=args.delta_softplus, HAS_DLAST=dlast_state is not None,
                         LOCAL=local, KEEP_STEPS=p.cfg["KEEP_STEPS"], ALIGN=align,
                         RECOMPUTE_STAGES=p.cfg["RECOMPUTE_STAGES"], **tiles,
                         **({} if local else cap))  # fmt: skip
            p.launch(launchers, _scan_bwd_kernel, grid, tensors, scalars, flags, align_sizes)
            if local:
                _range_entries(p, launchers, tensors, reverse=True)
        launch_grad_sums(p, launchers, tensors, args)

    # Everything the launches depend on that the plan's key leaves out: the option, the layouts
    # of dout (staged or not), dlast_state and the checkpoints.
    layouts = [None if t is None else (t.stride(), t.dtype)
               for t in (dout, dlast_state, checkpoints)]  # fmt: skip
    p.run(launchers, (args.delta_softplus, *layouts), tensors, launch)

    def empty():  # a placeholder per absent input (the op's outputs must not alias each other)
        return None if for_autograd else u.new_empty((0,))

    return (
        unpadded(du, p.layout),
        unpadded(ddelta, p.layout),
        dA,
        dB,
        dC,
        empty() if args.D is None else dD,
        empty() if args.z is None else unpadded(dz, p.layout),
        empty() if args.delta_bias is None else dbias,
        empty() if not has_h0 else _fresh(dh0, args.initial_state),
    )
