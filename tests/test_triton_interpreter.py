"""The Triton kernels' logic on CPU, under the Triton interpreter (TRITON_INTERPRET=1, set by
conftest.py when there is no GPU), through the public API with SELECTIVE_SCAN_BACKEND=triton.

The interpreter runs every program in Python, so these cases are few and short, chosen to cover
the kernels' branches: variable/grouped/constant B and C, optional inputs, padded states, tails
of tiles, several checkpoint chunks, sequence ranges (the three-launch path), packed sequences
with an empty one, an initial state, float64 exactness and low-precision inputs. The full option
grid runs on the real kernels in test_gpu.py and, parametrized by backend, on a GPU machine.
"""

import itertools
import math
import threading
import types
from unittest import mock

import pytest
import torch
from conftest import TRITON_RUNS
from helpers import (
    SCAN_INPUTS,
    RecordOps,
    check_replays,
    float_inputs,
    make_inputs,
    oracle,
    rel_err,
    replay_cases,
)
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from selective_scan import ops, selective_scan_fn
from selective_scan._checks import checkpoint_slots
from selective_scan.kernels import common, layout, offline, plan, scan
from selective_scan.kernels.bc_blocks import _bc_blocks_kernel
from selective_scan.kernels.launch import recording
from selective_scan.kernels.range_entries import _range_entries_kernel
from selective_scan.kernels.scan_bwd import _scan_bwd_kernel
from selective_scan.kernels.scan_fwd import _scan_fwd_kernel
from selective_scan.kernels.tiles import (
    CKPT,
    DEFAULT_POLICY,
    MIN_RANGES,
    bwd_tiles,
    ranges,
    use_policy,
)
from selective_scan.scan_args import ScanArgs

pytestmark = [
    pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)"),
    pytest.mark.usefixtures("poison_uninitialized"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}

LANES = {"LANES": 16, "NS": 1, "T": 16}  # the lanes kernel's tiles (tiles.fwd_tiles)
CASES = {
    # 300 steps: three 128-step chunks, cut into ranges (few channels), tail of a tile.
    "ranges-init": dict(seqlen=300, dstate=8, initial_state=True),
    # 4 ranges, 3 folded by the range entries' launch in blocks of 2 (RANGE_BLOCK, 16 on a
    # GPU): the carry between blocks, forward and backward; padded states. A scaled down so
    # that states last for ranges: with make_inputs' A, 128 steps decay them by ~1e-5, below
    # the bound, and a wrong carry from two ranges back went unseen.
    "many-ranges": dict(batch=1, seqlen=500, dstate=5, initial_state=True, A_scale=0.01,
                        range_block=2),
    # Strided in time (channels last), at a multiple of T: the kernels read these strides.
    "float64-constB-groupedC-strided": dict(
        seqlen=132, dtype=torch.float64, b_form="constant", c_form="grouped", D=False, z=False,
        delta_bias=False, strided=True,
    ),
    # Rows that start off multiples of T (views of longer rows): copied into aligned rows.
    "rows-off-T": dict(seqlen=128, dstate=4, sliced=True),
    "varlen-empty-init": dict(
        batch=1, seqlen=150, cu_seqlens=[0, 10, 10, 64, 131, 150], initial_state=True,
        b_form="grouped", dstate=8,
    ),
    # Packed, 152 steps (a multiple of T = 4): the kernels load whole tiles across the
    # sequences' boundaries and zero what lies outside each (tile_masks' WHOLE loads). The
    # case above (150 steps) gets rows padded to 152 and loads whole tiles too.
    "varlen-whole-tiles": dict(
        batch=1, seqlen=152, cu_seqlens=[0, 10, 10, 67, 131, 152], initial_state=True, dstate=8,
    ),
    # 41 steps: rows padded to 48 (forward T = 16, backward 8), whole-tile loads.
    "bf16-padded-states-nosoftplus": dict(seqlen=41, dtype=torch.bfloat16, dstate=5,
                                          softplus=False),
    "one-step": dict(seqlen=1, dstate=16, c_form="constant"),
    # More than 16 states split over more lanes (tiles.STATE_LANES): 64 (forward 4 lanes, 16
    # states a thread; backward 16 lanes), 256 over a whole warp, one channel a program, with
    # grouped B; 64 cut into three ranges (the local passes' splits: 4 and 8 lanes).
    "states-64": dict(batch=1, dim=3, seqlen=41, dstate=64),
    "states-256-grouped": dict(batch=1, dim=2, seqlen=20, dstate=256, b_form="grouped"),
    "states-64-ranges": dict(batch=1, dim=1, seqlen=260, dstate=64, initial_state=True),
    # dB/dC from bfloat16 partials of 2 blocks a group (32 channels, BD = 8), padded states:
    # the tile-ordered partials summed and transposed into (batch, groups, dstate, seqlen).
    "bf16-blocks-grouped": dict(seqlen=64, dtype=torch.bfloat16, dim=32, dstate=5,
                                b_form="grouped", c_form="grouped", groups=2),
    # The ranges' local passes take their own tiles by default (LOCAL_NS: all states of a
    # channel in one thread forward, 2 lanes backward); here the full passes' (4 lanes), with
    # grouped B.
    "ranges-local-lanes": dict(batch=1, seqlen=300, dstate=8, initial_state=True, b_form="grouped",
                               fwd_tiles={"LOCAL_NS": 4}, bwd_tiles={"LOCAL_NS": 4}),
    # The forward's PRE pass (delta's bias and softplus once per step, see config) runs in the
    # uncut cases above by default; here over ranges too, each of which starts past step 0.
    # And the backward's tile walk loading delta and softplus' from the scratch (KEEP_STEPS,
    # the default for 16-bit inputs), in float32's tighter bound, across chunks and ranges.
    "pre-ranges-keep-steps": dict(batch=1, seqlen=300, dstate=8, initial_state=True,
                                  fwd_tiles={"PRE": 64}, bwd_tiles={"KEEP_STEPS": 1}),
    # The backward's tiles of 2 channels a thread (tiles.two_channels, chosen on GPUs for grids
    # that fill their waves): bfloat16 over ranges (whose local pass keeps 1 channel a thread)
    # with B in groups of 16 channels; float32 with constant C and a block of 16 rows cut by
    # the channel count.
    "two-channel-ranges": dict(batch=1, dim=32, seqlen=400, dtype=torch.bfloat16, dstate=16,
                               initial_state=True, b_form="grouped", groups=2,
                               bwd_tiles={"CH": 2}),
    "two-channel-float32": dict(dim=40, seqlen=136, dtype=torch.float32, dstate=16,
                                c_form="constant", bwd_tiles={"CH": 2}),
    # The forward's epilogue on the steps each lane selects (EPI, the default of 2-lane tiles),
    # over ranges, with and without z, and over packed sequences (masks inside a lane's steps).
    "two-lane-epilogue": dict(batch=1, seqlen=300, dstate=8, initial_state=True,
                              fwd_tiles={"NS": 2, "EPI": 1}),
    "two-lane-epilogue-no-z": dict(seqlen=41, dstate=16, z=False,
                                   fwd_tiles={"NS": 2, "EPI": 1, "LANES": 0}),
    "two-lane-epilogue-packed": dict(batch=1, seqlen=150, cu_seqlens=[0, 10, 10, 64, 131, 150],
                                     dstate=8, fwd_tiles={"NS": 2, "EPI": 1}),
    # As traced with symbolic sizes: the kernels test the strides' divisibility by T at run
    # time and take the body declaring it, or the plain one.
    "checked-aligned-ranges": dict(batch=1, seqlen=300, dstate=8, initial_state=True, checked=True),
    "checked-unaligned": dict(seqlen=41, dtype=torch.bfloat16, dstate=5, checked=True),
    # And rows left unpadded (the policy's pad_rows off), in the tiles traced calls take for
    # such examples (see config): the last tile cut by masks, in 2-lane tiles with EPI over
    # ranges, and after a PRE pass.
    "traced-two-lane-epilogue": dict(batch=1, seqlen=300, dstate=8, initial_state=True,
                                     checked=True, unpadded=True, fwd_tiles={"NS": 2, "EPI": 1}),
    "traced-pre-pass": dict(seqlen=41, dtype=torch.bfloat16, dstate=16, checked=True,
                            unpadded=True, fwd_tiles={"PRE": DEFAULT_POLICY.pre_steps, "LANES": 0,
                                                      "NS": 4}),
    # The forward with a channel's steps across 16 lanes (scan_fwd_lanes.py; chosen for CUDA
    # launches of few channels and at most 256 steps in whole 16-byte vectors, see lanes_fit):
    # one full chunk with an initial state; a masked tail with grouped B and C and padded
    # states; an odd channel count (a program's second channel masked), three checkpoint slots.
    # On a GPU these shapes take the lanes kernel without forcing it.
    # Grouped B/C with 2 channels a group, cut into 4 ranges: each program covers 2 channels in
    # a tile of 8 or 16 rows (common.block_channels). Wrong gradients on the H200 when the tiles
    # had 2 rows (test_sm90_compile.py checks the layouts that caused it).
    "grouped-two-channels-ranges": dict(dim=4, dstate=8, seqlen=384, b_form="grouped",
                                        c_form="grouped", groups=2),
    "lanes-init": dict(batch=1, seqlen=256, dstate=16, initial_state=True, fwd_tiles=LANES),
    "lanes-bf16-masked-grouped": dict(seqlen=48, dtype=torch.bfloat16, dstate=5,
                                      b_form="grouped", c_form="grouped", D=False,
                                      softplus=False, fwd_tiles=LANES),
    "lanes-float32-odd-dim": dict(seqlen=144, dtype=torch.float32, dim=7, z=False,
                                  delta_bias=False, fwd_tiles=LANES),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_triton_kernels_match_oracle(name, monkeypatch):
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    case = dict(CASES[name])
    softplus = case.pop("softplus", True)
    strided = case.pop("strided", False)
    sliced = case.pop("sliced", False)
    policy = DEFAULT_POLICY.replace(
        fwd_overrides=case.pop("fwd_tiles", {}),
        bwd_overrides=case.pop("bwd_tiles", {}),
        align=layout.ALIGN_CHECKED if case.pop("checked", False) else None,
        pad_rows=not case.pop("unpadded", False),
        range_block=case.pop("range_block", DEFAULT_POLICY.range_block),
    )
    A_scale = case.pop("A_scale", 1.0)
    inputs = make_inputs(device=DEVICE, batch=case.pop("batch", 2), dim=case.pop("dim", 8),
                         **case)  # fmt: skip
    inputs["A"] = inputs["A"] * A_scale
    names = float_inputs(inputs)
    leaves = {k: v.detach().clone().requires_grad_(True) if k in names else v
              for k, v in inputs.items()}  # fmt: skip
    args = dict(leaves)
    if strided:  # the kernels take any strides: feed transposed and sliced views
        for k in ("u", "delta"):
            args[k] = leaves[k].transpose(1, 2).contiguous().transpose(1, 2)
        args["A"] = leaves["A"].t().contiguous().t()
        args["C"] = torch.cat([leaves["C"], leaves["C"]], dim=-1)[..., : leaves["C"].shape[-1]]
    if sliced:  # u, delta, z as the first seqlen steps of rows one step longer
        for k in ("u", "delta", "z"):
            args[k] = torch.cat([leaves[k], leaves[k][..., :1]], dim=-1)[..., :-1]
    with use_policy(policy):
        out, last = selective_scan_fn(**args, delta_softplus=softplus, return_last_state=True)
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE),
         torch.randn(last.shape, generator=gen, dtype=torch.float64).to(DEVICE))  # fmt: skip
    loss = (out.double() * w[0]).sum() + (last.double() * w[1]).sum()
    with use_policy(policy):
        grads = torch.autograd.grad(loss, [leaves[k] for k in names])
    ref_out, ref_last, ref_grads = oracle(inputs, softplus, w)
    bound = BOUND[inputs["u"].dtype]
    assert rel_err(out, ref_out) < bound
    assert rel_err(last, ref_last) < max(bound, 1e-6)
    for k, g in zip(names, grads, strict=True):
        if ref_grads[k].abs().max() == 0:  # e.g. dA with one step and no initial state
            assert g.abs().max() < 1e-6, k
        else:
            assert rel_err(g, ref_grads[k]) < bound, k


def plan_of(direction: str, inputs, policy=DEFAULT_POLICY) -> plan.ScanPlan:
    """The plan of the forward ("fwd") or the backward ("bwd") of the scan inputs (u, delta,
    A, B, C, then optional ones, in ScanArgs' order)."""
    return plan.ScanPlan(policy, direction == "bwd", ScanArgs(*inputs))


def blocked(B, C, T=4, NP=8) -> tuple:
    """B and C blocked as the launchers block them (bc_layout, bc_block_tensors on carved
    buffers, launch_bc_blocks), in float32, each variable one of real tensors shaped (batch,
    groups, tiles, NP, T)."""
    lay = layout.bc_layout(B, C, T, NP, torch.float32)
    if lay is None:
        return B, C
    fake = is_fake(B)  # traced: buffers of their own, as the plans of traced calls give
    buffers = (
        common.fresh_buffers(B, lay.sizes) if fake else common.Carving(torch.float32, lay.sizes)(B)
    )
    tensors = layout.bc_block_tensors(lay, B, C, buffers)
    layout.launch_bc_blocks(lay, tensors)
    out = tensors["B_ptr"], tensors["C_ptr"]
    shapes = iter(lay.shapes)
    shaped = []
    for t in out:  # constant B or C passes through; blocks are flat (kept so when traced)
        if t.dim() == 1 and not fake:  # carved, at least as long as needed
            shape = next(shapes)
            t = t[: math.prod(shape)].view(shape)
        shaped.append(t)
    return tuple(shaped)


def test_blocked_bc_layout():
    """B/C blocking: (batch, groups, tiles, NP, T), zero-padded in time and states, for B and C
    of other group counts and strides in one launch, or for either alone."""
    B = torch.randn(2, 3, 5, 21, dtype=torch.float64, device=DEVICE)
    B = B.transpose(2, 3).contiguous().transpose(2, 3)
    C = torch.randn(2, 5, 21, device=DEVICE)
    const = torch.randn(7, 5, device=DEVICE)
    for src, blocks in (*zip((B, C), blocked(B, C), strict=True),
                        (B, blocked(B, const)[0]),
                        (C, blocked(const, C)[1])):  # fmt: skip
        src = src if src.dim() == 4 else src.unsqueeze(1)
        want = torch.zeros(2, src.shape[1], 8, 24, device=DEVICE)
        want[:, :, :5, :21] = src
        assert blocks.shape == (2, src.shape[1], 6, 8, 4) and blocks.is_contiguous()
        want = want.unflatten(3, (6, 4)).transpose(2, 3)
        torch.testing.assert_close(blocks, want, rtol=0, atol=0)
    assert blocked(const, const) == (const, const)


def test_blocked_bc_adds_no_guard_for_symbolic_seqlen():
    """With a symbolic seqlen (torch.export, compile(dynamic=True)), blocking B/C guards on
    nothing: a size-1 tile dimension used to add `ceil(seqlen / T) != 1`, which an export with a
    dynamic seqlen as short as T steps violates (seen exporting the LM on the GPU). Launches
    are recorded, not run: in a traced op they become wrap_triton's graph nodes."""
    traced = make_fx(lambda B: blocked(B, B), tracing_mode="symbolic")
    graphs = []
    launches = offline.record_launches(lambda: graphs.append(traced(torch.randn(2, 4, 37))))
    assert [k for k, *_ in launches] == [_bc_blocks_kernel]
    graph = graphs[0]
    shape_env = next(iter(graph.graph.nodes)).meta["val"].fake_mode.shape_env
    assert [str(g.expr) for g in shape_env.guards] == []
    short = torch.randn(1, 4, 3, device=DEVICE)
    assert blocked(short, short)[0].shape == (1, 1, 2, 8, 4)


def test_blocked_bc_outputs_distinct():
    """With one variable source (constant B, grouped C), the launch gets its blocks once and an
    empty spare in the other output slot. Passed as both outputs, the blocks were cloned twice
    when a traced call was functionalized (torch.compile, export, opcheck) and the clone never
    written was returned: opcheck failed on the H200, and make_fx(functionalize) on CPU showed
    the graph returning the 'Cb_ptr' clone. Launches are recorded, not run."""
    const, grouped = torch.randn(7, 4), torch.randn(2, 2, 4, 7)
    outputs = []
    launches = offline.record_launches(lambda: outputs.extend(blocked(const, grouped, 16, 4)))
    ((_, grid, kw, _),) = launches
    assert grid[2] == 1 and kw["Bsrc_ptr"] is kw["Csrc_ptr"] is grouped  # one source, read as both
    assert kw["Bb_ptr"].data_ptr() == outputs[1].data_ptr() and outputs[0] is const
    assert kw["Cb_ptr"].numel() == 0


def test_align_modes():
    """Divisibility comes from Triton's specialization (multiples of 16), from the launcher
    (other multiples of T), or from the sizes at run time (symbolic sizes: checked_launches;
    its symbolic grids: test_traced_launchers_guard_alike_for_any_size)."""
    assert layout.align_mode(8, False, 2048, 1536 * 2048, 2048, 0, 0) == layout.ALIGN_PLAIN
    assert layout.align_mode(8, True, 2048, 1536 * 2048, 2048) == layout.ALIGN_DECLARED  # packed
    assert layout.align_mode(8, False, 1000, 1536 * 1000, 1000) == layout.ALIGN_DECLARED
    assert layout.align_mode(8, True, 2049, 2049) == layout.ALIGN_PLAIN  # rows not vector-aligned
    traced = make_fx(lambda u: u.new_empty(u.shape[-1]), tracing_mode="symbolic")(
        torch.randn(2, 48)
    )
    seqlen = next(iter(traced.graph.nodes)).meta["val"].shape[-1]  # a symbolic size
    assert layout.align_mode(8, False, seqlen, 16) == layout.ALIGN_CHECKED
    rows = common.cdiv(seqlen, 8) * 8  # padded rows: a multiple of 8 by construction
    assert layout.align_mode(8, True, rows, 16 * rows, rows) == layout.ALIGN_DECLARED
    assert layout.align_mode(8, False, rows, 16 * rows) == layout.ALIGN_DECLARED  # no 16 known
    # Known sizes leave one launch: the kernel they call for, with the whole grid.
    grid = (12, 1, 3)
    assert layout.checked_launches(grid, 8, (1000, 8000)) == [(layout.ALIGN_DECLARED, grid)]
    assert layout.checked_launches(grid, 8, (1000, 8004)) == [(layout.ALIGN_PLAIN, grid)]


@pytest.mark.parametrize(
    "tiles, seqlen, layout, copied, rows, align",
    [
        # The backward's tiles: T = 8 steps of bf16.
        ("bwd", 264, "contiguous", False, 264, layout.ALIGN_DECLARED),  # 8 | 264, 16 does not
        ("bwd", 2049, "contiguous", True, 2056, layout.ALIGN_DECLARED),  # padded rows
        ("bwd", 2048, "sliced", True, 2048, layout.ALIGN_PLAIN),  # rows of 2049: copied
        ("bwd", 2048, "channels_last", False, 2048, layout.ALIGN_PLAIN),  # its strides
        ("bwd", 2049, "channels_last", True, 2056, layout.ALIGN_DECLARED),  # all copied
        # The forward's: T = 16, or 8 where that divides the length and 16 does not.
        ("fwd", 2048, "contiguous", False, 2048, layout.ALIGN_PLAIN),
        ("fwd", 264, "contiguous", False, 264, layout.ALIGN_DECLARED),  # T = 8
        ("fwd", 2049, "contiguous", True, 2064, layout.ALIGN_DECLARED),  # padded to T = 16
    ],
)
def test_padded_rows(tiles, seqlen, layout, copied, rows, align):
    """Which per-step inputs a launch copies into fresh rows, the rows' length, its ALIGN."""
    x = make_inputs(device=DEVICE, batch=2, dim=16, seqlen=seqlen, dtype=torch.bfloat16)
    if layout == "sliced":
        x["u"] = torch.randn(2, 16, seqlen + 1, dtype=torch.bfloat16, device=DEVICE)[..., :seqlen]
    if layout == "channels_last":
        x["u"] = x["u"].transpose(1, 2).contiguous().transpose(1, 2)
    p = plan_of(tiles, [x.get(k) for k in SCAN_INPUTS])
    assert (p.copied[0], p.rows, p.flags["ALIGN"]) == (copied, rows, align)
    assert p.flags["WIDE"] == (rows != seqlen)
    u = p.tensors(ScanArgs(*[x.get(k) for k in SCAN_INPUTS]), p.scratch(x["u"], lambda: {}))[
        "u_ptr"
    ]
    T = p.cfg["T"]
    assert torch.equal(u, x["u"]) and (u.stride(1) % T == 0 or layout == "channels_last")


def test_traced_calls_pad_rows():
    """Fake tensors (torch.compile, torch.export) of a known odd length get padded rows, as
    eager calls do. A symbolic length gets them by a guard on seqlen % T (one graph for the
    lengths T divides, one for the others), its rows a multiple of T by construction, which the
    launch declares without a run-time check; exported, it keeps its rows and guards on
    nothing. Misaligned views of a known length are copied in eager calls only (a traced
    view's strides may be symbolic)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = make_inputs(device="cpu", batch=2, dim=16, seqlen=2049, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = [None if x.get(k) is None else mode.from_tensor(x[k]) for k in SCAN_INPUTS]
        p = plan_of("fwd", fake)
    assert (p.pad, p.rows, p.copied, p.flags["WIDE"]) == (True, 2064, [True] * 3, True)
    assert p.flags["ALIGN"] == layout.ALIGN_DECLARED

    x = make_inputs(device="cpu", batch=2, dim=16, seqlen=2048, dtype=torch.bfloat16)
    x["u"] = torch.randn(2, 16, 2049, dtype=torch.bfloat16)[..., :2048]  # rows off T
    with FakeTensorMode() as mode:
        fake = [None if x.get(k) is None else mode.from_tensor(x[k]) for k in SCAN_INPUTS]
        p = plan_of("fwd", fake)
    assert (p.pad, p.copied) == (False, [False] * 3)

    def trace(steps: int, exporting: bool = False):
        """(plan, graph, example inputs, guards on the length) of the forward's plan traced
        with a symbolic length; the graph returns u's padded rows and their crop."""
        plans = []

        def symbolic_plan(u, delta, A, B, C, D, z, delta_bias):
            plans.append(plan_of("fwd", (u, delta, A, B, C, D, z, delta_bias)))
            rows = layout.staged(u, plans[0].layout)
            return rows, layout.unpadded(rows, plans[0].layout)

        x = make_inputs(device="cpu", batch=2, dim=16, seqlen=steps, dtype=torch.bfloat16)
        with mock.patch("torch.compiler.is_exporting", return_value=exporting):
            graph = make_fx(symbolic_plan, tracing_mode="symbolic")(
                *[x[k] for k in SCAN_INPUTS[:8]]
            )  # fmt: skip
        u = next(iter(graph.graph.nodes)).meta["val"]
        seqlen = u.shape[-1].node.expr.free_symbols
        # (The tile choice guards on dstate's power of two.)
        guards = [str(g.expr) for g in u.fake_mode.shape_env.guards
                  if g.expr.free_symbols & seqlen]  # fmt: skip
        return plans[0], graph, x, [g.replace(str(next(iter(seqlen))), "seqlen") for g in guards]

    p, graph, x, guards = trace(37)
    T = p.cfg["T"]
    assert (p.pad, p.copied, p.flags["WIDE"]) == (True, [True] * 3, True)
    assert p.flags["ALIGN"] == layout.ALIGN_DECLARED
    assert guards == [f"Ne(Mod(seqlen, {T}), 0)"]
    # The traced pad and crop: u, then zeros to a multiple of T; right at any length.
    for steps in (37, 48):
        v = torch.randn(2, 16, steps, dtype=torch.bfloat16)
        rows, cropped = graph(v, *[x[k] for k in SCAN_INPUTS[1:8]])
        assert rows.shape[2] == -(-steps // T) * T and rows.is_contiguous()
        assert torch.equal(rows[..., :steps], v) and not rows[..., steps:].any()
        assert torch.equal(cropped, v) and cropped.is_contiguous()

    p, _, _, guards = trace(48)
    assert (p.pad, p.copied, p.flags["ALIGN"]) == (False, [False] * 3, layout.ALIGN_CHECKED)
    assert guards == [f"Eq(Mod(seqlen, {p.cfg['T']}), 0)"]
    p, _, _, guards = trace(37, exporting=True)
    assert (p.pad, p.copied, p.flags["WIDE"], guards) == (False, [False] * 3, False, [])
    assert p.flags["ALIGN"] == layout.ALIGN_CHECKED
    # A length with no value to guard on (unbacked, data-dependent): rows of its own, no error.
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        unbacked = mode.from_tensor(torch.tensor(37)).item()
        assert not layout.padded(unbacked, 8) and env.guards == []


# Tiles of the example: 4 lanes, PRE / 2, EPI; 999 steps get padded rows.
@pytest.mark.parametrize("seqlen", [256, 1024, 999])
def test_traced_launcher_guards_alike_for_any_size(seqlen):
    """The forward's launcher traced with symbolic sizes (as torch.compile(dynamic=True) traces
    it; the backward op is opaque to the compiler): every guard holds for other batches,
    channel counts and for lengths alike, so that new sizes compile nothing again: lengths
    alike are those whose rows are padded or not, as the example's (layout.padded, the one
    guard on the length's value but its range). Range buffers shaped (ranges, ...) were tested
    for a count of 1 (contiguity): true at 256 steps, false at 999 (cut into ranges)."""

    def scan_forward(u, delta, A, B, C, D, z, delta_bias):
        return scan.scan_fwd(u, delta, A, B, C, D, z, delta_bias, None, None, True)

    x = make_inputs(device="cpu", batch=2, dim=32, dstate=16, seqlen=seqlen)
    graphs = []
    launches = offline.record_launches(
        lambda: graphs.append(make_fx(scan_forward, tracing_mode="symbolic")(
            *[x[k] for k in SCAN_INPUTS[:8]]))
    )  # fmt: skip
    assert len(launches) >= 2  # blocking, forward: recorded, not run
    forward = next(flags for kernel, _, flags, _ in launches
                   if kernel is _scan_fwd_kernel and not flags["LOCAL"])  # fmt: skip
    assert (forward["NS"], forward["PRE"] > 0, forward["EPI"]) == {
        256: (4, True, 0),
        1024: (2, False, 1),
        999: (2, False, 1),
    }[seqlen]
    # The range entries' launches stay in the graph for a symbolic count of ranges, with no
    # program where it is 1 (their programs took 5-14 us of compiled forwards on the H200).
    entries = [common.size_hint(grid[0]) for kernel, grid, *_ in launches
               if kernel is _range_entries_kernel]  # fmt: skip
    assert len(entries) == 1 and (entries[0] > 0) == (seqlen != 256), entries
    u = next(iter(graphs[0].graph.nodes)).meta["val"]
    env = u.fake_mode.shape_env
    hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # renamed in torch 2.13
    batch, dim, seqlen_symbol = (next(iter(s.node.expr.free_symbols)) for s in u.shape)
    guards = [g.expr for g in env.guards]
    assert guards  # e.g. buffers of at least 2 elements
    # The forward pads rows to its T (16 for these examples).
    alike = [L for L in (2, 7, 16, 129, 256, 999, 1000, 4096, 100_003, 100_000)
             if (L % 16 == 0) == (seqlen % 16 == 0)]  # fmt: skip
    scans = [(flags["ALIGN"], grid[0]) for kernel, grid, flags, _ in launches
             if kernel is _scan_fwd_kernel]  # fmt: skip
    if seqlen % 16:  # padded rows: the declaring kernel alone, no run-time check
        assert scans and all(align == layout.ALIGN_DECLARED for align, _ in scans)
    else:  # rows of their own: each launch the declaring kernel and the plain one
        assert [align for align, _ in scans] == [layout.ALIGN_DECLARED, layout.ALIGN_PLAIN] * (
            len(scans) // 2
        )
    for sizes in itertools.product((2, 3, 8), (16, 64, 1536, 5120), alike):
        values = {**hints, **dict(zip((batch, dim, seqlen_symbol), sizes, strict=True))}
        for expr in guards:
            assert bool(expr.xreplace(values)), (sizes, expr)
        programs = [int(torch.sym_int(g).node.expr.xreplace(values)) for _, g in scans]
        if seqlen % 16:
            assert min(programs) > 0, sizes
            continue
        # For any such sizes exactly one kernel of a pair has programs, all the launch's.
        for declared, plain in zip(programs[::2], programs[1::2], strict=True):
            assert declared + plain > 0 and (declared == 0) == (sizes[2] % 16 != 0), sizes


def test_symbolic_plan_has_plain_constants():
    """Under symbolic sizes (torch.compile(dynamic=True)) the kernels' compile-time flags are
    Python values: dstate is specialized, not carried on. Its next power of two, symbolic, was
    a sympy expression of bit operations in every tile size and grid; Inductor's first compile
    of S1's forward took 190 s on the H200 (the traced call alone, 235 s on this CPU)."""
    plans = []

    def symbolic_plans(u, delta, A, B, C, D, z, delta_bias):
        for tiles in ("fwd", "bwd"):
            plans.append(plan_of(tiles, (u, delta, A, B, C, D, z, delta_bias)))
        return u.new_empty(())

    x = make_inputs(device="cpu", batch=2, dim=16, dstate=12, seqlen=300, dtype=torch.bfloat16)
    graph = make_fx(symbolic_plans, tracing_mode="symbolic")(*[x[k] for k in SCAN_INPUTS[:8]])
    dim = next(iter(graph.graph.nodes)).meta["val"].shape[1].node.expr  # its symbol
    for p in plans:
        assert type(p.dstate) is int and type(p.NP) is int and p.NP == 16
        assert all(not isinstance(v, torch.SymInt) for v in (*p.flags.values(), *p.cfg.values()))
        # The sizes stay symbolic, the count of ranges a compact expression: written with
        # (a + b - 1) // b, its divisions repeated dim 16 times, and Inductor's compile of
        # sums over range-sized buffers took seconds more (see common.cdiv).
        assert p.n_ranges.node.expr.count(dim) <= 4


@pytest.mark.parametrize(
    "seqlen, dout_layout, align",
    [
        (264, "contiguous", layout.ALIGN_DECLARED),
        (264, "channels_last", layout.ALIGN_PLAIN),  # its rows do not start at multiples of T
        (2048, "contiguous", layout.ALIGN_PLAIN),  # Triton's own specialization
        (2048, "rows_of_2056", layout.ALIGN_DECLARED),  # multiples of T, not of 16
        (2048, "channels_last", layout.ALIGN_PLAIN),
    ],
)
def test_backward_align(seqlen, dout_layout, align):
    """The backward declares aligned rows only when dout's rows are multiples of T too."""
    x = make_inputs(device="cpu", batch=2, dim=16, seqlen=seqlen, dtype=torch.bfloat16)
    p = plan_of("bwd", [x.get(k) for k in SCAN_INPUTS])
    dout = torch.randn(2, 16, seqlen, dtype=torch.bfloat16)
    if dout_layout == "channels_last":
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    if dout_layout == "rows_of_2056":
        dout = torch.randn(2, 16, 2056, dtype=torch.bfloat16)[..., :seqlen]
    assert scan.backward_align(p, dout)[0] == align


TARGET = DEFAULT_POLICY.target_warps


def test_ranges_only_for_idle_gpus():
    """Sequences are cut into ranges only when few (sequence, channel) pairs exist, never for
    packed sequences, and the ranges cover the sequence in CKPT multiples."""
    B = torch.empty(1, 16, 8)
    cfg = DEFAULT_POLICY.bwd(1536, 16, torch.bfloat16, B, B)
    count, length = ranges(cfg, 1, 1536, 16384, False, TARGET)
    assert count > 1 and length % CKPT == 0 and (count - 1) * length < 16384 <= count * length
    assert count == 32  # S3: 192 warps would take 10 ranges; once cut, FINER (4) times finer
    fwd = DEFAULT_POLICY.fwd(1536, 16, torch.bfloat16, B, B, 1, 16384)  # 2 lanes, 96 warps, FINER 2
    assert ranges(fwd, 1, 1536, 16384, False, TARGET)[0] == 32
    assert ranges(cfg, 8, 5120, 2048, False, TARGET)[0] == 1
    assert ranges(cfg, 8, 1536, 2048, False, TARGET)[0] == 1  # S1: not cut, nor finer
    assert ranges(cfg, 1, 5120, 256, False, TARGET)[0] == 1  # S6: 2 ranges would not pay
    assert ranges(cfg, 1, 5120, 384, False, TARGET)[0] == MIN_RANGES
    assert ranges(cfg, 1, 1536, 16384, True, TARGET)[0] == 1


def traced(*sizes):
    """The sizes as torch.compile(dynamic=True) traces them (backed symbols, the example's
    values as hints), and the ShapeEnv that records guards on them."""
    env = ShapeEnv()
    return env, [
        env.create_unspecified_symint_and_symbol(v, ConstantSource(f"size{i}"), DimDynamic.DYNAMIC)
        for i, v in enumerate(sizes)
    ]


def test_forward_lanes():
    """The forward takes 2 lanes a channel where 2-lane programs fill the GPU (S5, S7) or
    where 4 lanes would cut the sequence into ranges (S3), else 4 (S1, S6, packed sequences,
    sizes unknown until run time)."""
    B = torch.empty(1, 16, 8)

    def lanes(num_states, dim, seqlen, varlen=False):
        return DEFAULT_POLICY.fwd(dim, 16, torch.bfloat16, B, B, num_states, seqlen, varlen)["NS"]

    assert lanes(16, 2048, 1024) == lanes(8, 5120, 2048) == lanes(1, 1536, 16384) == 2
    assert lanes(8, 1536, 2048) == lanes(1, 5120, 256) == lanes(1, 1536, 16384, True) == 4
    assert lanes(1, 1536, ShapeEnv().create_unbacked_symint()) == 4


@pytest.mark.parametrize("sizes", [(1, 1536, 16384), (8, 5120, 2048), (8, 1536, 2048),
                                   (1, 5120, 256), (2, 64, 999)])  # fmt: skip
def test_traced_forward_tiles_are_the_examples(sizes):
    """Traced with symbolic sizes, the forward takes the tiles (lanes, EPI, PRE) an eager call
    of the example's sizes takes, and guards on nothing for them: S3's compiled forward took
    0.423 ms on the H200 with the 4 lanes symbolic sizes used to get, against 0.354 eager."""
    B = torch.empty(1, 16, 8)
    env, symbols = traced(*sizes)
    expected = DEFAULT_POLICY.fwd(sizes[1], 16, torch.bfloat16, B, B, sizes[0], sizes[2])
    tiles = DEFAULT_POLICY.fwd(symbols[1], 16, torch.bfloat16, B, B, symbols[0], symbols[2])
    assert tiles == dict(expected, T=16)  # a symbolic length keeps T = 16 (see padded)
    assert env.guards == []


def test_forward_pre_pass_and_epilogue():
    """Delta's PRE pass only for launches of few warps in one range (S6, small calls), not for
    fuller ones (S1, S5, S7), cut sequences, or sizes unknown until run time; the epilogue in
    the steps each lane selects (EPI) with 2-lane tiles only."""
    B = torch.empty(1, 16, 8)

    def pre(num_states, dim, seqlen, varlen=False):
        return DEFAULT_POLICY.fwd(dim, 16, torch.bfloat16, B, B, num_states, seqlen, varlen)["PRE"]

    assert pre(1, 5120, 256) == pre(2, 8, 64) == pre(1, 8, 150, True) == DEFAULT_POLICY.pre_steps
    assert pre(8, 1536, 2048) == pre(1, 5120, 384) == pre(2, 8, 300) == pre(8, 5120, 2048) == 0
    assert pre(16, 2048, 1024) == 0
    epi = {(dim, seqlen): DEFAULT_POLICY.fwd(dim, 16, torch.bfloat16, B, B, 8, seqlen)["EPI"]
           for dim, seqlen in ((5120, 2048), (1536, 2048))}  # fmt: skip
    assert epi == {(5120, 2048): 1, (1536, 2048): 0}
    assert pre(1, 5120, ShapeEnv().create_unbacked_symint()) == 0


def test_forward_lanes_kernel():
    """The lanes kernel (scan_fwd_lanes.py) where PRE would be chosen, for a known length of at
    most 256 steps and a multiple of 16, without packed sequences, with variable B and C, in
    float32 arithmetic on a GPU (here: as the offline compile sees a GPU), and only where every
    per-step row loads as whole 16-byte vectors."""
    gpu = DEFAULT_POLICY.replace(fast_math=True)

    def lanes(num_states, dim, seqlen, varlen=False, dtype=torch.bfloat16, B=None, u=None,
              policy=gpu):  # fmt: skip
        B = torch.empty(1, 16, seqlen if isinstance(seqlen, int) else 8) if B is None else B
        rows = () if u is None else (u,)
        return policy.fwd(dim, 16, dtype, B, B, num_states, seqlen, varlen, rows)["LANES"]

    assert lanes(1, 5120, 256) == lanes(2, 8, 48) == lanes(1, 8, 16, dtype=torch.float32) == 16
    assert lanes(1, 5120, 257) == lanes(1, 8, 160, True) == lanes(8, 5120, 256) == 0
    assert lanes(2, 8, 41) == lanes(1, 8, 7) == 0  # rows not whole vectors
    assert lanes(1, 8, 64, dtype=torch.float64) == 0
    assert lanes(1, 8, ShapeEnv().create_unbacked_symint()) == 0
    assert lanes(1, 8, 64, B=torch.empty(8, 16)) == 0  # constant B
    assert lanes(1, 8, 64, B=torch.empty(1, 16, 64, 2)[..., 0]) == 0  # a strided row
    assert lanes(1, 8, 64, u=torch.empty(1, 8, 65)[..., 1:]) == 0  # rows not 16-byte aligned
    assert lanes(1, 8, 64, u=torch.empty(1, 8, 64)) == 16
    assert lanes(1, 5120, 256, policy=gpu.replace(lanes=False)) == 0
    # CPU tensors: the tile kernel (see test_forward_lanes)
    assert lanes(1, 5120, 256, policy=DEFAULT_POLICY) == 0


def test_dependent_launch_right_after_blocking_only():
    """The forward's scan launch may start while the B/C blocking launch runs (PDL, on GPUs
    that have it) only where that launch is the one right before it, and where the scan has a
    PRE pass to run before it waits for the blocks: not after rows staged for padding (a copy
    in between, which the PRE pass reads), not without variable B/C, not for full launches."""
    hopper = DEFAULT_POLICY.replace(pdl=True)

    def pdl(seqlen, batch=1, dim=8, **forms):
        x = make_inputs(device="cpu", batch=batch, dim=dim, dstate=4, seqlen=seqlen, **forms)
        return plan_of("fwd", [x.get(k) for k in SCAN_INPUTS], hopper).pdl

    assert pdl(64) and pdl(64, b_form="constant")
    assert not pdl(64, b_form="constant", c_form="constant")
    assert not pdl(70)  # padded rows: u, delta and z are copied after the blocking launch
    assert not pdl(64, batch=2, dim=8192)  # 2048 warps: no PRE pass
    assert pdl(64, cu_seqlens=[0, 30, 64])  # packed rows of whole tiles: nothing copied


def test_pre_pass_writes_own_steps_only(monkeypatch):
    """The PRE pass of a packed sequence writes its own steps only: the steps of a whole tile
    that belong to a neighbour are that neighbour's program's (programs run concurrently on a
    GPU, in order under the interpreter, where a stray write would go unseen but for the
    padded rows' tail, which no sequence owns and which must keep its poison)."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    inputs = make_inputs(device=DEVICE, batch=1, dim=8, dstate=4, seqlen=150,
                         cu_seqlens=[0, 10, 10, 64, 131, 150])  # fmt: skip
    with recording(launch=True) as launches:
        selective_scan_fn(**inputs, delta_softplus=True)
    pre = next(kw["pre_ptr"] for kernel, _, kw, _ in launches if kernel is _scan_fwd_kernel)
    pre = pre[: 8 * 160].view(1, 8, 160)  # PRE's scratch (flat): rows of 160 for 150 steps
    assert not pre[..., :150].isnan().any()
    assert pre[..., 150:].isnan().all()


def test_grids_take_large_batches():
    """Sequences share the grid's first axis (2^31 - 1 programs) with the blocks of channels,
    so a batch beyond 65535, the limit of the other axes, still launches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = make_inputs(device="cpu", batch=1, dim=16, seqlen=8, dtype=torch.bfloat16)
    big = {k: v.expand(70000, *v.shape[1:]).contiguous() if v.dim() == 3 else v
           for k, v in x.items() if v is not None}  # fmt: skip
    with FakeTensorMode() as mode:
        big = {k: mode.from_tensor(v) for k, v in big.items()}
        for tiles in ("fwd", "bwd"):
            p = plan_of(tiles, [big.get(k) for k in SCAN_INPUTS])
            grids = [grid for _, grid, _ in p.launches()]
            assert grids == [(p.n_blocks * 70000, 1, 1)]


@pytest.mark.parametrize("dstate", [1, 4, 8, 16, 64])
@pytest.mark.parametrize(("dim", "groups"), [(4, 2), (6, 2), (24, 4), (8, 1), (96, 3), (4096, 4)])
def test_tiles_fill_the_warp(dim, groups, dstate):
    """Every tile, forward and backward, full and local pass, has a whole warp's (channel,
    lane) pairs, whatever the channels of a group: grouped B/C narrow the channels a program
    covers (BLOCK), never the tile (BD). Tiles of fewer rows got layouts that Triton's scan
    lowering got wrong on the H200 (test_sm90_compile.py)."""
    form = "grouped" if groups > 1 else "variable"
    x = make_inputs(device="cpu", batch=2, dim=dim, dstate=dstate, seqlen=4096, groups=groups,
                    b_form=form, c_form=form)  # fmt: skip
    for tiles in ("fwd", "bwd"):
        p = plan_of(tiles, [x.get(k) for k in SCAN_INPUTS])
        assert groups == 1 or (dim // groups) % p.cfg["BLOCK"] == 0
        assert p.cfg["BLOCK"] <= p.cfg["BD"]
        for local, grid, override in p.launches():
            t = p.cfg | override
            lanes = t.get("LANES") or t["NS"]
            assert t["BD"] * lanes == 32 * t["num_warps"], (local, t)
            assert grid[0] == common.cdiv(dim, t["BLOCK"]) * 2


def test_local_pass_tiles():
    """The ranges' local pass takes its own tiles (LOCAL_NS) and grid; the full pass keeps the
    plan's. By default the forward's local pass has 1 lane a channel (its full pass 2: the
    sequence is cut), the backward's 2 (its full pass 4)."""
    x = make_inputs(device="cpu", batch=1, dim=64, dstate=16, seqlen=1024, dtype=torch.bfloat16)
    inputs = [x.get(k) for k in SCAN_INPUTS]
    (local, local_grid, tiles), (full, grid, full_tiles) = plan_of("fwd", inputs).launches()
    assert (local, full, full_tiles) == (True, False, {})
    assert tiles == dict(NS=1, NI=16, BD=32, BLOCK=32) and (local_grid[0], grid[0]) == (2, 4)
    assert local_grid[2] == grid[2] - 1 > 0  # every range but the first
    (_, local_grid, tiles), (_, grid, _) = plan_of("bwd", inputs).launches()
    assert tiles == dict(NS=2, NI=8, BD=16, BLOCK=16) and (local_grid[0], grid[0]) == (4, 8)
    policy = DEFAULT_POLICY.replace(fwd_overrides={"LOCAL_NS": 2})
    (_, local_grid, tiles), (_, grid, _) = plan_of("fwd", inputs, policy).launches()
    assert tiles == dict(NS=2, NI=8, BD=16, BLOCK=16) and local_grid[0] == grid[0] == 4


@pytest.mark.parametrize("dstate", [17, 64, 100, 256, 300])
def test_many_states_split_over_lanes(dstate):
    """Beyond 16 states the tiles split a channel's states over more lanes (tiles.STATE_LANES):
    a thread holds at most 16 in the forward and 8 in the backward (past 256 states, a warp's
    share), in every pass, cut into ranges or not; the backward's full pass never over 8 lanes
    (offline, Triton spread those tiles' steps over lanes)."""
    n_pad = 1 << (dstate - 1).bit_length()
    for batch, dim, seqlen in ((8, 1536, 2048), (1, 8, 1024)):
        x = make_inputs(device="cpu", batch=batch, dim=dim, dstate=dstate, seqlen=seqlen,
                        dtype=torch.bfloat16)  # fmt: skip
        inputs = [x.get(k) for k in SCAN_INPUTS]
        for tiles, most in (("fwd", 16), ("bwd", 8)):
            p = plan_of(tiles, inputs)
            launches = list(p.launches())
            assert len(launches) == (1 if batch == 8 else 2)  # the short one is cut
            for is_local, _, local in launches:
                lanes, per_thread = local.get("NS", p.cfg["NS"]), local.get("NI", p.cfg["NI"])
                assert lanes * per_thread == p.NP == n_pad and per_thread <= max(most, n_pad // 32)
                assert tiles == "fwd" or is_local or lanes != 8


@pytest.mark.parametrize(
    "programs, T, NP, CH, eager, capped",
    [
        (1536, 8, 16, 1, True, True),  # S1: 1.45 waves of 8 per SM -> one wave of 12
        (1056, 8, 16, 1, True, False),  # one wave of 8 already
        (2048, 8, 16, 1, True, False),  # 1.94 waves of 8, 1.29 of 12: two either way
        (4096, 8, 16, 1, True, True),  # 3.88 waves of 8 -> 2.59 of 12
        (2112, 8, 16, 1, True, False),  # 16 programs an SM: two waves either way
        (5120, 8, 16, 1, True, True),  # S7: 4.85 waves of 8 -> 3.23 of 12
        (1536, 4, 16, 1, True, False),  # float64 tiles: not the kernel measured
        (1536, 8, 8, 1, True, False),  # 8 padded states: not the kernel measured
        (1536, 8, 16, 2, True, False),  # 2 channels a thread: spills under the cap
        (1536, 8, 16, 1, False, False),  # traced: wrap_triton takes no cap
    ],
)
def test_wave_cap(programs, T, NP, CH, eager, capped):
    """The backward's register cap (eager launches on the GPU) only where it fits the grid of
    one-warp programs into fewer waves of 12 per SM than of 8 (kernels/scan.py, wave_cap)."""
    p = types.SimpleNamespace(cfg=dict(T=T, CH=CH), NP=NP, n_blocks=programs // 8, num_states=8,
                              n_ranges=1, policy=DEFAULT_POLICY.replace(sm_count=132))  # fmt: skip
    u = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    launchers = {} if eager else None  # the call's (see ScanPlan.direct)
    assert scan.wave_cap(p, u, launchers) == ({"maxnreg": 168} if capped else {})


@pytest.mark.parametrize(
    "batch, dim, dstate, seqlen, groups, dtype, channels",
    [
        (8, 1536, 16, 2048, 1, torch.bfloat16, 1),  # S1: 768 programs of 2, a wave 0.73 full
        (4, 4096, 16, 2048, 1, torch.bfloat16, 2),  # S2: 1024, 0.97
        (1, 1536, 16, 16384, 1, torch.bfloat16, 2),  # S3: 96 programs x 32 ranges, 0.97
        (1, 5120, 16, 1024, 1, torch.bfloat16, 1),  # 320 programs x 8 ranges, 0.81
        (8, 1536, 16, 2048, 1, torch.float32, 2),  # S4: 0.73, no KEEP_STEPS
        (16, 2048, 16, 1024, 4, torch.bfloat16, 2),  # S5: 2048, two waves 0.97 full
        (1, 5120, 16, 256, 1, torch.bfloat16, 1),  # S6: 320 programs, 0.30
        (8, 5120, 16, 2048, 1, torch.bfloat16, 1),  # S7: 2560, three waves 0.81 full
        (8, 2048, 64, 2048, 1, torch.bfloat16, 1),  # S8: 64 states, not the tiles measured
        (16, 2048, 16, 1024, 256, torch.bfloat16, 1),  # 8 channels a group: no 16-row blocks
        (16, 2048, 16, 1024, 1, torch.float64, 1),  # float64 tiles (T = 4)
        (16, 2048, 8, 1024, 1, torch.bfloat16, 1),  # 8 padded states
    ],
)
def test_backward_two_channel_tiles(batch, dim, dstate, seqlen, groups, dtype, channels):
    """The backward takes 2 channels a thread where its programs fill their waves of 8 an SM
    (tiles.two_channels; 132 SMs, an H100's or H200's), a program a range, 1 elsewhere;
    sequences cut into ranges keep the ranges of 1 channel a thread. Packed sequences, and a
    device whose SMs the policy cannot count (the interpreter's CPU tensors), keep 1."""
    policy = DEFAULT_POLICY.replace(sm_count=132)
    u = torch.empty(batch, dim, 1, dtype=dtype)
    B = torch.empty(batch, groups, dstate, 1, dtype=dtype)

    def tiles(policy, varlen=False) -> dict:
        return policy.bwd(dim, dstate, dtype, B, B, batch, seqlen, varlen, (u, None, None))

    cfg = tiles(policy)
    ones = DEFAULT_POLICY.bwd(dim, dstate, dtype, B, B, batch, seqlen, False, ())
    assert cfg["CH"] == channels
    assert (cfg["BD"], cfg["BLOCK"]) == (ones["BD"] * channels, ones["BLOCK"] * channels)
    assert ranges(cfg, batch, dim, seqlen, False, 2048) == ranges(ones, batch, dim, seqlen, False,
                                                                  2048)  # fmt: skip
    assert tiles(policy, varlen=True)["CH"] == tiles(DEFAULT_POLICY)["CH"] == 1


@pytest.mark.parametrize("dstate, deeper", [(4, True), (16, True), (32, False), (64, False)])
def test_recompute_prefetch(dstate, deeper):
    """The backward's chunk pass and recompute prefetch deeper than its tile walk up to 16
    states, and as deep beyond: 64 states, 16 lanes of 4 (as many a lane as 16 states have),
    lost 16% with the deeper prefetch (design §5)."""
    B = torch.zeros(2, dstate, 64)
    cfg = bwd_tiles(1536, dstate, torch.bfloat16, B, B)
    assert (cfg["RECOMPUTE_STAGES"] > cfg["STAGES"]) == deeper
    assert cfg["RECOMPUTE_STAGES"] >= cfg["STAGES"]


@pytest.mark.parametrize(
    "dtype, b_form, c_form, optional, blocks, seqlen, dstate, wide",
    [
        (torch.float64, "variable", "grouped", True, 6, 40, 5, False),  # cut tile and states
        (torch.float64, "variable", "grouped", True, 6, 40, 5, True),  # the same in BM 1024
        (torch.bfloat16, "grouped", "constant", False, 6, 32, 16, False),  # bf16, no D/bias
        (torch.float32, "constant", "variable", True, 640, 16, 16, False),  # S6's many blocks
    ],
)
def test_grad_sums(dtype, b_form, c_form, optional, blocks, seqlen, dstate, wide):
    """The backward's partial sums reduced by kernels/grad_sums.py in one launch: each gradient
    the float64 sum of its partials over programs (dA, dD, ddelta_bias, constant dB/dC) or over
    a group's blocks (variable dB/dC, (batch, blocks, tiles, NP, T) partials), cut to dstate
    states and seqlen steps, in its input's shape and dtype; the same bits when run again.
    These sizes take BM 16 (few programs); `wide` forces the widest tile (large shapes')."""
    policy = DEFAULT_POLICY.replace(sum_programs=1) if wide else DEFAULT_POLICY
    batch, dim, T, programs = 2, 12, 8, 3
    NP, tiles = 1 << (dstate - 1).bit_length(), layout.bc_tiles(seqlen, T)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    p = types.SimpleNamespace(batch=batch, dim=dim, NP=NP, cfg=dict(T=T), seqlen=seqlen,
                              dstate=dstate, num_states=programs, n_ranges=1, n_blocks=blocks,
                              cdt=acc, flags=dict(ACC=common.tl_dtype(acc)), sums=None,
                              policy=policy, unused_buffer=lambda u: u.new_empty((0,)))  # fmt: skip

    def like(form):
        shape = {"constant": (dim, dstate), "variable": (batch, dstate, seqlen),
                 "grouped": (batch, 3, dstate, seqlen)}[form]  # fmt: skip
        return torch.empty(shape, dtype=dtype, device=DEVICE)

    A, B, C = torch.empty(dim, dstate, dtype=acc, device=DEVICE), like(b_form), like(c_form)
    D = delta_bias = torch.empty(dim, dtype=dtype, device=DEVICE) if optional else None

    def part(t):
        shape = (programs, dim, NP) if t.dim() < 3 else (batch, blocks, tiles, NP, T)
        part_dtype = dtype if t.dim() > 2 and dtype == torch.bfloat16 else acc
        return torch.randn(shape, dtype=torch.float64, device=DEVICE).to(part_dtype)

    parts = (part(A), part(B), part(C), *[torch.randn(programs, dim, device=DEVICE).to(acc)] * 2)
    named = dict(zip(("dA_part", "dB_part", "dC_part", "dD_part", "dbias_part"), parts,
                     strict=True))  # fmt: skip
    args = ScanArgs(None, None, A, B, C, D, delta_bias=delta_bias)

    def exact(part, t):
        if t.dim() < 3:  # over programs; (programs, dim[, NP])
            summed = part.double().sum(0)
            return summed if t.dim() == 1 else summed[:, :dstate]
        groups = 1 if t.dim() == 3 else t.shape[1]
        rows = part.double().view(batch, groups, blocks // groups, tiles, NP, T).sum(2)
        rows = rows.transpose(2, 3).reshape(batch, groups, NP, tiles * T)[:, :, :dstate, :seqlen]
        return rows.reshape(t.shape)

    def grad_sums():
        outs, tensors = scan.grad_sum_tensors(p, args, named)
        scan.launch_grad_sums(p, None, tensors, args)
        return outs

    got, again = grad_sums(), grad_sums()
    for grad, repeat, part_, t in zip(got, again, parts, (A, B, C, D, delta_bias), strict=True):
        if t is None:
            assert grad is None
            continue
        assert grad.shape == t.shape and grad.dtype == t.dtype and grad.is_contiguous()
        assert torch.equal(grad, repeat)
        want = exact(part_, t)
        tol = 1e-12 if dtype == torch.float64 else 2**-7
        torch.testing.assert_close(grad.double(), want, rtol=tol, atol=tol * want.abs().max())


def test_broadcast_steps_are_copied(monkeypatch):
    """A per-step tensor whose steps are a broadcast (time stride 0, such as the gradient of a
    sum) is copied into fresh rows before the kernels read it (Triton lays a broadcast load's
    steps across lanes, kernels/scan.py): the gradients equal those from a contiguous copy."""
    assert layout.restaged(torch.ones(()).expand(2, 16, 64), False, 8)
    assert not layout.restaged(torch.ones(()).expand(2, 16, 1), False, 8)  # one step: no broadcast
    assert not layout.restaged(torch.ones(2, 16, 64), False, 8)
    # Traced with symbolic sizes too (the stride is a plain 0): Inductor would otherwise
    # materialize the broadcast once for each launch that reads it.
    traced = []

    def trace(x):
        traced.append(layout.restaged(x.new_ones(()).expand(x.shape), False, 8))
        traced.append(layout.restaged(x, False, 8))
        return x.sum()

    make_fx(trace, tracing_mode="symbolic")(torch.randn(2, 16, 64))
    assert traced == [True, False]

    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    x = make_inputs(device=DEVICE, batch=2, dim=8, dstate=4, seqlen=64)
    names = float_inputs(x)

    def grads(dout_of):
        leaves = {k: v.detach().clone().requires_grad_(k in names) if torch.is_tensor(v) else v
                  for k, v in x.items()}  # fmt: skip
        out = selective_scan_fn(**leaves, delta_softplus=True)
        out.backward(dout_of(out))
        return [leaves[k].grad for k in sorted(names)]

    expanded = grads(lambda out: out.new_full((), 0.5).expand_as(out))
    contiguous = grads(lambda out: torch.full_like(out, 0.5))
    for a, b in zip(expanded, contiguous, strict=True):
        assert torch.equal(a, b)


def test_range_entries_launchers_keyed_by_dlast():
    """A backward plan is keyed by the scan's inputs; dlast_state is not one of them. The range
    entries' launcher (cached in the plan for eager calls) must be picked by whether dlast is
    given and by its strides, or a call reads dlast as an earlier call laid it out. (Keyed by
    its options only, the backward's opcheck failed on the H200 in a process that had run other
    calls of its layout, and passed in a fresh one.) Launches are recorded, not run."""
    from selective_scan.kernels.range_entries import _range_entries_kernel

    inputs = make_inputs(device="cpu", batch=1, dim=8, dstate=4, seqlen=300)
    ckpt = torch.zeros(1, 8, checkpoint_slots(300, CKPT), 4)
    dout = torch.randn(1, 8, 300)
    tensors = [inputs[k] for k in SCAN_INPUTS]
    with recording() as launches:
        for dlast in (None, torch.randn(1, 8, 4), torch.randn(1, 1, 1).expand(1, 8, 4)):
            scan.scan_bwd(dout, dlast, *tensors, checkpoints=ckpt, delta_softplus=True)
    entries = [key for kernel, _, _, key in launches if kernel is _range_entries_kernel]
    assert len(entries) == 3 and len(set(entries)) == 3


def test_strided_cu_seqlens(monkeypatch):
    """cu_seqlens as a strided view (every other element of a longer tensor) gives what the
    dense one gives, forward and backward: the kernels read it as a dense array."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    inputs = make_inputs(batch=1, seqlen=40, cu_seqlens=[0, 9, 25, 40], initial_state=True)
    cu = inputs["cu_seqlens"]
    strided = torch.stack([cu, torch.full_like(cu, 7)], dim=1)[:, 0]
    assert strided.stride() == (2,)
    results = []
    for cu_seqlens in (cu, strided):
        leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in inputs.items()
                  if isinstance(v, torch.Tensor)}  # fmt: skip
        out, last = selective_scan_fn(**leaves | {"cu_seqlens": cu_seqlens}, delta_softplus=True,
                                      return_last_state=True)  # fmt: skip
        (out.sum() + last.sum()).backward()
        grads = [t.grad for t in leaves.values() if t.requires_grad]
        results.append([out, last, *grads])
    for dense, strided_result in zip(*results, strict=True):
        assert torch.equal(dense, strided_result)


@pytest.mark.parametrize(
    ("position", "change", "match"),
    [
        (0, lambda t: t[:, :-1], r"dout must have shape"),
        (12, lambda t: t[:1], r"checkpoints must have shape .* as the forward returned"),
    ],
    ids=["dout", "checkpoints"],
)
def test_triton_backward_checks_its_own_inputs(position, change, match):
    """The Triton backward op checks dout and checkpoints (a batch-1 checkpoint tensor would
    otherwise be read as every row's)."""
    fwd, bwd = ops.triton_ops()
    inputs = make_inputs(seqlen=40)
    tensors = [inputs[k] for k in SCAN_INPUTS]
    out, last, checkpoints = fwd(*tensors, True)
    args = [torch.randn_like(out), torch.randn_like(last), *tensors, checkpoints, True]
    args[position] = change(args[position])
    with pytest.raises(ValueError, match=match):
        bwd(*args)


def test_eager_forward_allocates_only_what_it_uses():
    """The eager forward of one range without a PRE pass allocates its three outputs and one
    buffer that its B/C blocks are carved from, nothing more: its launches get the cached
    plan's empty tensor for the range buffers and the PRE scratch they do not use (each
    allocation costs more host time than a view, design §11). Launches are recorded, not
    run."""
    x = make_inputs(device=DEVICE, batch=8, dim=1024, dstate=16, seqlen=64)  # 1024 warps
    inputs = [x[k] for k in SCAN_INPUTS[:8]]
    modes = [RecordOps(), RecordOps()]

    def forward(mode):
        with mode:
            scan.scan_fwd(*inputs, None, None, True)

    launches = offline.record_launches(lambda: [forward(mode) for mode in modes])
    flags = next(kw for kernel, _, kw, _ in launches if kernel is _scan_fwd_kernel)
    assert (flags["PRE"], flags["LOCAL"]) == (0, False)
    allocations = [op for op in modes[1].ops if "empty" in str(op)]
    assert len(allocations) == 4, allocations  # out, last_state, checkpoints, B/C blocks


@pytest.fixture(scope="module")
def bf16_forward():
    """(inputs, out, checkpoints) of one interpreted bfloat16 forward, shared by the backward's
    cases (each interpreted forward costs seconds of CI time)."""
    x = make_inputs(device=DEVICE, batch=2, dim=64, dstate=16, seqlen=64, dtype=torch.bfloat16)
    inputs = [x[k] for k in SCAN_INPUTS[:8]]
    out, _, ckpt = scan.scan_fwd(*inputs, None, None, True)
    return inputs, out, ckpt


@pytest.mark.parametrize("for_autograd", [False, True], ids=["op", "autograd"])
def test_eager_backward_allocates_its_gradients_and_one_scratch(bf16_forward, for_autograd):
    """The eager backward allocates the gradients it returns (the op: an empty one for each
    absent input; what autograd calls, scan_bwd_autograd: None instead) and one buffer that its
    internal ones are carved from (partial sums, B/C blocks, the chunks' scratch, range
    results): views starting at multiples of 256 bytes into it, as aligned as allocations of
    their own. Launches are recorded, not run."""
    inputs, out, ckpt = bf16_forward
    modes = [RecordOps(), RecordOps()]
    backward_fn = scan.scan_bwd_autograd if for_autograd else scan.scan_bwd
    grads = []

    def backward(mode):
        with mode:
            grads.append(backward_fn(torch.randn_like(out), None, *inputs, None, None, ckpt, True))

    launches = offline.record_launches(lambda: [backward(mode) for mode in modes])
    allocations = [op for op in modes[1].ops if "empty" in str(op)]
    # du, ddelta, dz, the scratch, dA, dB, dC, dD, ddelta_bias (, an empty dinitial_state)
    assert len(allocations) == 10 - for_autograd, allocations
    assert (grads[1][-1] is None) == for_autograd
    kw = next(kw for kernel, _, kw, _ in launches if kernel is _scan_bwd_kernel)
    carved = [kw[k] for k in ("dA_ptr", "dB_ptr", "dC_ptr", "dD_ptr", "dbias_ptr", "scratch_ptr")]
    (base,) = {t.untyped_storage().data_ptr() for t in carved}
    assert all((t.data_ptr() - base) % common.CARVE_ALIGN == 0 for t in carved)
    assert kw["dB_ptr"].dtype == torch.bfloat16 and kw["dA_ptr"].dtype == torch.float32


def test_traced_calls_allocate_each_buffer():
    """Traced calls (fake tensors: torch.compile, export) give each internal buffer an
    allocation of its own, no view of a carved one: Inductor then sees no kernel outputs that
    are views of one base. Launches are recorded, not run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = make_inputs(device=DEVICE, batch=2, dim=64, dstate=16, seqlen=64, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(x[k]) for k in SCAN_INPUTS[:8]]
        launches = offline.record_launches(lambda: scan.scan_fwd(*inputs, None, None, True))
    kw = next(kw for kernel, _, kw, _ in launches if kernel is _scan_fwd_kernel)
    names = ("B_ptr", "C_ptr", "hloc_ptr", "dtsum_ptr")
    assert all(kw[k]._base is None for k in names), [k for k in names if kw[k]._base is not None]


def test_replayed_launch_sequences(monkeypatch):
    """A plan's later calls replay the launchers of an earlier call with the same option and
    layouts of dout, dlast_state and checkpoints (launch.launch_sequence), and equal calls that
    derive their launches afresh (while launches are recorded, nothing is replayed), for each
    change of that key: dout contiguous, broadcast in time (staged) or strided in time, with and
    without dlast_state, with and without softplus. On a GPU only direct launches replay; here
    the plans hand out their launchers for CPU tensors too (ScanPlan.direct), which then launch
    through Triton's interpreter. The first call of a layout records; the next ones replay."""
    monkeypatch.setattr(plan.ScanPlan, "direct", lambda self, u: self.launchers)
    x = make_inputs(device=DEVICE, batch=2, dim=8, dstate=4, seqlen=24, initial_state=True)
    args = [x[k] for k in SCAN_INPUTS]
    cases = replay_cases(x["u"], 4)

    def fwd_bwd(dout, dlast_state, softplus):
        fwd = scan.scan_fwd(*args, softplus)
        return [*fwd, *scan.scan_bwd(dout, dlast_state, *args, fwd[2], softplus)]

    policy = DEFAULT_POLICY.replace(sm_count=132)  # plans of its own; no device query
    with use_policy(policy), recording(launch=True):  # launched, never replayed
        expected = [fwd_bwd(*case) for case in cases]
    check_replays(policy, fwd_bwd, cases, expected, rounds=2)


def test_backward_takes_its_forwards_policy(monkeypatch):
    """A backward runs under the tile policy of its forward, on whatever thread autograd runs
    it: use_policy holds on its own thread only, and autograd runs a CUDA backward on a thread
    of its own. Here the backward runs on another Python thread, outside use_policy, and still
    plans under the forward's policy."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    x = make_inputs(device=DEVICE, batch=1, dim=8, dstate=4, seqlen=16)
    leaves = {k: v.detach().clone().requires_grad_(True) if k == "u" else v for k, v in x.items()}
    policy = DEFAULT_POLICY.replace(sm_count=132)  # plans of its own
    with use_policy(policy):
        out = selective_scan_fn(**leaves)
    backward = threading.Thread(target=out.sum().backward)
    backward.start()
    backward.join()
    assert leaves["u"].grad is not None
    keys = [key for key in plan._PLANS if key[0] is policy]
    assert sorted(key[1] for key in keys) == [False, True]  # the forward's plan, the backward's
