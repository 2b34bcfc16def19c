"""The conformance grid: seeded random samples of the option space mamba_ssm's users reach, for
selective_scan_fn, mamba_inner_fn and selective_state_update, each checked against a float64
oracle (outputs and every gradient). The same configurations and checks serve the GPU run
(test_gpu_conformance.py: thousands of configurations in families that share compiled kernels,
against a chunked float64 oracle) and CI (test_conformance.py: the PyTorch path and the Triton
kernels under the interpreter, on smaller sizes); the tolerances live here, in one table.

A configuration is a frozen dataclass whose ``id`` names every option, so a failure message
says exactly what to rerun (``check_*`` returns the failed comparisons instead of raising, so a
chunk of configurations reports all of its failures at once).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import model_helpers
import torch
from helpers import (
    float_inputs,
    leaves,
    make_inputs,
    make_weights,
    oracle,
    rel_err,
    run_scan,
    to_float64,
)
from test_state_update import oracle as step_oracle
from test_state_update import step_inputs

from selective_scan import (
    mamba_inner_fn,
    selective_scan_fn,
    selective_scan_ref,
    selective_state_update,
)

# ---- tolerances -------------------------------------------------------------------------------
#
# Relative error ||out - ref|| / ||ref|| over all elements, against float64 run on the very same
# (rounded) inputs and output weights: rounding the inputs is no error here, only what the
# implementation rounds is. Unit roundoff u (half an ulp of 1): 2^-24 float32, 2^-11 float16,
# 2^-8 bfloat16. The bound for a compared tensor is g * u of the dtype that tensor is stored in,
# g a growth factor argued from the computation (rounding to nearest gives |error| <= u per
# element, and a norm-wise error <= u for a tensor rounded once).
#
# float32 (u = 2^-24), g = 2^9: everything is float32 arithmetic on exact inputs. The longest
# accumulation behind one number is a gradient reduction over batch * seqlen <= 2 * 4096 = 2^13
# steps (dA, dD, ddelta_bias, constant dB/dC; the state itself sums at most 4096 decayed terms).
# Rounding errors of a sum of n terms grow like sqrt(n) u (probabilistic analysis, Higham and
# Mary 2019): 2^6.5. On a GPU exp and log are MUFU approximations (relative error about 2^-22 =
# 4 u) entering every step's decay: another factor 4. 2^6.5 * 4 = 2^8.5, rounded up to 2^9:
# 3.1e-5. This also holds float32 results of low-precision inputs (last_state, dA, dD,
# ddelta_bias, constant dB/dC): their inputs are exact and nothing on their path is stored in
# 16 bits.
#
# float16 and bfloat16, g = 4: the float32 error above (3e-5) is far below u (4.9e-4, 3.9e-3);
# what counts is how often a value is rounded to 16 bits on its way. out, du, ddelta, dz: once
# at the end, plus at most one 16-bit intermediate in the Triton kernels (measured under the
# interpreter: about 0.8 u against 0.42 u, the root mean square of a single rounding, on the
# PyTorch path). Variable dB/dC in bfloat16: each partial sum over a block of channels is rounded
# (kernels/scan.py, bc_part_dtype), the partials summed in float32 and rounded again: 2 u, plus
# the partials' own rounding amplified where they cancel. At dstate 64 with z, dB/dC measured
# 1.5 u under the interpreter (states split over lanes, each lane's partial rounded). So at most
# 3 roundings of at most u each: 3 u, and 4 u leaves one more rounding of margin, not slack for
# a wrong result (a wrong term is O(1) relative, 100-1000x more).
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
GROWTH = {torch.float32: 2**9, torch.float16: 4, torch.bfloat16: 4}
TOLERANCE = {dtype: GROWTH[dtype] * U[dtype] for dtype in U}
# mamba_inner_fn in 16 bits rounds every stage's result: the conv output, x_proj's output, delta,
# B and C (after their RMSNorm), the scan's y and out_proj's output, and in the backward the
# gradient of each; the longest chain has 8 roundings of at most u each. Carried through maps of
# gain about one (silu, softplus, RMSNorm, linears of random weights scaled by 1/sqrt(fan-in)),
# that is g = 8 for every tensor, whatever its own dtype (dA is float32 but computed from rounded
# intermediates); float32: the scan's bound (the linears add sums of at most d_inner = 1536
# terms, shorter than the scan's reductions). But the gains are not always about one: a weight
# gradient summed over tokens with cancelling signs, or a small layer, can be ill-conditioned
# (dx_proj_weight of a bf16 layer with d_inner 4 and one state moved by 12 u when a float64 run
# moved its inputs by u). So the bound also scales with the problem's own sensitivity, measured
# for each configuration: the largest relative change of each tensor over INNER_PROBES float64
# runs on inputs each moved by a random factor in [1 - u, 1 + u]. Each of the 8 roundings is a
# perturbation of at most u of one stage, taken to be as sensitive as the inputs: at most 8
# times that change. Bound: max(g u, 8 * sensitivity).
INNER_GROWTH = {torch.float32: 2**9, torch.float16: 8, torch.bfloat16: 8}
INNER_TOLERANCE = {dtype: INNER_GROWTH[dtype] * U[dtype] for dtype in U}
INNER_ROUNDINGS = 8
INNER_PROBES = 2
# selective_state_update: out and the new state are computed in float32 from exact inputs (a
# handful of operations and one sum over dstate <= 64) and rounded once to their dtype: the
# scan's table, keyed by the compared tensor's dtype, bounds them with room to spare.
STEP_TOLERANCE = TOLERANCE

# ---- the option space ---------------------------------------------------------------------------

SEQLENS = (1, 8, 16, 32, 64, 128, 256, 372, 512, 784, 1024, 1134, 2048, 4096)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DIMS = (4, 8, 24, 768, 1536)
DSTATES = (1, 4, 8, 16, 32, 64, 256)
GROUPS = (1, 2, 4)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _flags(cfg, names: tuple) -> str:
    return "".join(f"-{n}" if getattr(cfg, n) else f"-no_{n}" for n in names)


@dataclass(frozen=True)
class ScanConfig:
    """One call of selective_scan_fn. B and C: constant (dim, dstate) or variable; variable ones
    take groups (batch, groups, dstate, seqlen), or with groups 1 and flat, mamba's
    (batch, dstate, seqlen)."""

    seqlen: int
    dtype: str
    batch: int
    dim: int
    dstate: int
    b_var: bool
    c_var: bool
    groups: int
    flat: bool  # variable B/C with one group as (batch, dstate, seqlen)
    last_state: bool
    delta_bias: bool
    softplus: bool
    z: bool
    D: bool
    seed: int
    name: str = ""  # set on the named regression cases

    @property
    def id(self) -> str:
        def form(var):
            if not var:
                return "const"
            return "var" if self.flat and self.groups == 1 else f"g{self.groups}"

        head = f"{self.name}:" if self.name else ""
        return (
            f"{head}scan-L{self.seqlen}-{self.dtype}-b{self.batch}-d{self.dim}-n{self.dstate}"
            f"-B_{form(self.b_var)}-C_{form(self.c_var)}"
            + _flags(self, ("last_state", "delta_bias", "softplus", "z", "D"))
            + f"-seed{self.seed}"
        )

    @property
    def key(self) -> tuple:
        """What the Triton kernels specialize on besides sizes: the options, dtype and states."""
        return tuple(getattr(self, name) for name in OPTION_AXES)

    def inputs(self, device) -> dict:
        def form(var):
            if not var:
                return "constant"
            return "variable" if self.flat and self.groups == 1 else "grouped"

        return make_inputs(
            batch=self.batch, dim=self.dim, dstate=self.dstate, seqlen=self.seqlen,
            b_form=form(self.b_var), c_form=form(self.c_var), groups=self.groups,
            dtype=BY_NAME[self.dtype], device=device, D=self.D, z=self.z,
            delta_bias=self.delta_bias, seed=self.seed,
        )  # fmt: skip


# The GPU regression (peer suite, on the H200): grouped B and C, every option on, silently wrong
# gradients from 512 steps on; 128 and 256 steps were right. Named so a failure says what it is.
REGRESSION = dict(
    dtype="fp32", batch=2, dim=4, dstate=8, b_var=True, c_var=True, groups=2, flat=False,
    last_state=True, delta_bias=True, softplus=True, z=True, D=True, seed=0,
)  # fmt: skip


def regression_cases(seqlens) -> list[ScanConfig]:
    return [ScanConfig(seqlen=L, name="grouped_bc_regression", **REGRESSION) for L in seqlens]


# ---- the generator ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """Where a sample runs: the sizes it may take and a cost model with a cap. ``cost(batch,
    seqlen, dim, dstate)`` estimates one configuration's seconds (operator and oracle, forward
    and backward) on that target; configurations above ``max_cost`` are redrawn smaller."""

    name: str
    seqlens: tuple
    dims: tuple
    dstates: tuple
    cost: Callable[[int, int, int, int], float]
    max_cost: float
    dtypes: tuple = DTYPES
    batches: tuple = (2, 1)


def _cpu_cost(batch, seqlen, dim, dstate):
    # Measured on the 2-core development Xeon: 65 us a step of the float64 oracle (forward and
    # backward), 0.25 us an element of a step (768 x 16 x 2 at 512 steps: 3 s).
    return 0.01 + seqlen * (6.5e-5 + 2.5e-7 * batch * dim * dstate)


def _interpreter_cost(batch, seqlen, dim, dstate):
    # Under TRITON_INTERPRET every program runs in Python. Measured on the development machine
    # (forward and backward, 12 configurations, within a factor 2): 0.5 s of launches and
    # checks, then about 5 ms a batch row, channel (at least 8: one program covers them) and
    # step (plus 4: the per-tile work), times n/4 beyond 16 states, which split over lanes
    # (dim 24, 64 states, one step: 7-9 s).
    n_pad = 1 << (dstate - 1).bit_length()
    lanes = n_pad / 4 if n_pad > 16 else 1
    return 0.5 + 0.005 * batch * max(dim, 8) * lanes * (4 + seqlen)


def _inner_cpu_cost(batch, seqlen, dim, dstate):
    # mamba_inner_fn adds the projections, whose 16-bit matmuls are slow on a CPU: 1024 steps
    # at d_inner 768 in float16 took 11 s (about 2e-8 s a multiply of the d_inner^2 ones).
    return _cpu_cost(batch, seqlen, dim, dstate) + 2e-8 * batch * seqlen * dim * dim


CI_TORCH = Profile("torch", SEQLENS, DIMS, DSTATES, _cpu_cost, max_cost=0.3)
CI_INNER = Profile("inner-torch", SEQLENS, DIMS, DSTATES, _inner_cpu_cost, max_cost=0.5)
CI_INTERPRETER = Profile(
    "interpreter", (1, 8, 16, 32), (4, 8, 24), (1, 4, 8, 16, 32, 64), _interpreter_cost,
    max_cost=4.0,
)  # fmt: skip


class _Deck:
    """Values dealt in shuffled rounds: over a sample every value comes up equally often (to
    within one round), in random combination with the other axes."""

    def __init__(self, rng: random.Random, values):
        self.rng, self.values, self.cards = rng, list(values), []

    def draw(self):
        if not self.cards:
            self.cards = self.values[:]
            self.rng.shuffle(self.cards)
        return self.cards.pop()


def _decks(rng, axes: dict) -> dict:
    return {name: _Deck(rng, values) for name, values in axes.items()}


def _fit_sizes(rng, profile: Profile, seqlen, dim, dstate):
    """(batch, seqlen): the largest batch that fits the cost cap, else the longest of a random
    half of the lengths that fit with batch 1 (dim and dstate stay as dealt)."""
    for batch in profile.batches:
        if profile.cost(batch, seqlen, dim, dstate) <= profile.max_cost:
            return batch, seqlen
    shorter = [L for L in profile.seqlens if profile.cost(1, L, dim, dstate) <= profile.max_cost]
    if not shorter:
        return None
    return 1, rng.choice(shorter)


# The options of a scan configuration, what the Triton kernels compile a specialization for
# (with some size classes): dtype and dstate are constexprs, and so is each option.
OPTION_AXES = dict(
    dtype=tuple(DTYPE_NAMES.values()), dstate=DSTATES, b_var=(True, False), c_var=(True, False),
    groups=GROUPS, flat=(True, False), last_state=(True, False), delta_bias=(True, False),
    softplus=(True, False), z=(True, False), D=(True, False),
)  # fmt: skip


def _normalized(key: dict) -> dict:
    """Groups and the flat layout mean something only for variable B or C."""
    if not (key["b_var"] or key["c_var"]):
        return key | {"groups": 1, "flat": False}
    return key


def sample_scan(n: int, seed: int, profile: Profile) -> list[ScanConfig]:
    """n scan configurations of ``profile``'s sizes: every axis dealt from its own deck, sizes
    cut to the profile's cost cap (a (dim, dstate) pair that fits no length is redealt)."""
    rng = random.Random(f"scan-{profile.name}-{seed}")
    axes = OPTION_AXES | dict(
        seqlen=profile.seqlens, dim=profile.dims, dstate=profile.dstates,
        dtype=tuple(DTYPE_NAMES[d] for d in profile.dtypes),
    )  # fmt: skip
    deck = _decks(rng, axes)
    configs = []
    while len(configs) < n:
        options = _normalized({name: deck[name].draw() for name in OPTION_AXES})
        dim = deck["dim"].draw()
        fit = _fit_sizes(rng, profile, deck["seqlen"].draw(), dim, options["dstate"])
        if fit is None:
            continue
        batch, seqlen = fit
        configs.append(ScanConfig(seqlen=seqlen, batch=batch, dim=dim, **options,
                                  seed=rng.randrange(2**31)))  # fmt: skip
    return configs


# ---- the GPU sample: families that share compiled kernels ----------------------------------------
#
# On a GPU the Triton kernels compile for every distinct specialization: their constexprs (dtype,
# dstate, each option, and tiles from the sizes: padded rows where 8 or 16 does not divide the
# length, a block of channels from dim and groups, the ranges' local pass where few channels
# meet a long sequence) and, for every int argument, whether it is 1 and whether 16 divides it
# (dim, seqlen, strides, tiles, ranges, blocks...). A forward takes 2-4 s to compile on the H200,
# a backward 7-9 s (12 s and more at 64 and 256 states: README, bench/results/h200.json),
# about 20-25 s a configuration with the smaller kernels around them; checking one takes well
# under a second. Counted from the launches a sample records (launch.recording under the
# interpreter, with the H200's fast math, PDL and direct launches), 2,000 configurations each
# with options and sizes of their own need some 5,000 specializations: 24,000 s of compiling
# at those rates. So the GPU's sample is made of families: one option combination, one class
# of dims and one of lengths below, batch 1 to 8, shapes repeated with a new seed at most once.
# Within a class nearly every kernel is shared (lengths 2048 and 4096 differ in no argument's
# divisibility, nor do dims 8 and 24; batch changes the grid and the ranges' count, rarely a
# specialization): a family costs one or two configurations' compiles (13-84 s by the same
# count). The coverage asked for is over option values and the listed sizes, not over every
# pairing of them: every length, dim and dstate, every combination of the five flags and every
# pair of option values are in every run.
LENGTH_CLASSES = ((1,), (8,), (16, 32, 64), (128, 256), (372,), (512, 1024), (784,), (1134,),
                  (2048, 4096))  # fmt: skip
DIM_CLASSES = ((4,), (8, 24), (768, 1536))
FAMILY_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)
SEEDS_PER_SHAPE = 2  # at most: a family of few shapes stays small
# The fixed core's classes: the small dims at every length from 512 on (the grouped-B/C
# regression appeared there, where few channels cut a sequence into ranges).
CORE_CLASSES = tuple((dims, lengths) for dims in DIM_CLASSES[:2] for lengths in LENGTH_CLASSES
                     if lengths[0] >= 512)  # fmt: skip
FLAGS = ("last_state", "delta_bias", "softplus", "z", "D")


def _gpu_cost(batch, seqlen, dim, dstate):
    # Seconds a configuration takes on the H200 host beside its compiles (estimated from the
    # counts; the CPU figures scaled): its inputs drawn on the CPU (about 6e-8 s an element of
    # u, delta, z), the chunked float64 oracle's passes over (batch, dim, dstate, seqlen)
    # (about 40, 1e-10 s an element at 3 TB/s) and its kernels' launches (about 60 plus 6 a
    # chunk of 64 steps, 15 us each, per slice of ORACLE_ELEMENTS). The cap (1 s) leaves out
    # only the largest states at the largest sizes.
    elements = batch * dim * dstate * seqlen
    slices = max(1, -(-elements // ORACLE_ELEMENTS))
    return 6e-8 * batch * dim * seqlen + 1e-10 * elements + slices * (60 + seqlen / 10) * 1.5e-5


GPU = Profile("gpu", SEQLENS, DIMS, DSTATES, _gpu_cost, max_cost=1.0)


def covering_keys() -> list[dict]:
    """Option combinations, the same in every run: each of the 32 combinations of the five
    flags (FLAGS) once, the other axes filled greedily so that every pair of values of any two
    axes of OPTION_AXES occurs in some row, then rows added (from the first missing pair) until
    none is missing. Rows are normalized as they are built: groups and the flat layout only
    with variable B or C."""
    names = list(OPTION_AXES)
    missing = {(a, x, b, y) for a, b in itertools.combinations(names, 2)
               for x in OPTION_AXES[a] for y in OPTION_AXES[b]}  # fmt: skip

    used = collections.Counter()

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}

    def gain(row, name, value):  # missing pairs that setting name to value would cover
        def pair(other, v):
            first = names.index(name) < names.index(other)
            return (name, value, other, v) if first else (other, v, name, value)

        return sum(pair(other, v) in missing for other, v in row.items())

    def fill(row):
        for name in names:  # b_var and c_var before groups and flat
            if name in row:
                continue
            values = OPTION_AXES[name]
            if name in ("groups", "flat") and not (row["b_var"] or row["c_var"]):
                values = (1,) if name == "groups" else (False,)
            elif name == "c_var" and not row["b_var"] and row.get("groups", 1) != 1:
                values = (True,)  # the row's groups need a variable B or C
            elif name == "c_var" and not row["b_var"] and row.get("flat", False):
                values = (True,)  # and so does its flat layout
            # Ties to the value used least so far: the rows spread each axis evenly.
            row[name] = max(values, key=lambda v, name=name: (gain(row, name, v),
                                                              -used[name, v]))  # fmt: skip
        for name in names:
            used[name, row[name]] += 1
        return {name: row[name] for name in names}

    keys = []
    for flags in itertools.product((True, False), repeat=len(FLAGS)):
        keys.append(fill(dict(zip(FLAGS, flags, strict=True))))
        missing -= pairs(keys[-1])
    while missing:
        a, x, b, y = min(missing, key=str)
        keys.append(fill({a: x, b: y}))
        missing -= pairs(keys[-1])
    return keys


def family(options: dict, dims, lengths, size: int, rng, profile=GPU, name="") -> list:
    """Up to ``size`` configurations of one option combination (a family's kernels compile
    once): the shapes of FAMILY_BATCHES, ``dims`` and ``lengths`` within the profile's cost cap,
    in random order, repeated with new seeds (at most SEEDS_PER_SHAPE times each)."""

    def fits(batch, dim, seqlen):
        return profile.cost(batch, seqlen, dim, options["dstate"]) <= profile.max_cost

    shapes = [(batch, dim, seqlen) for dim in dims for seqlen in lengths
              for batch in FAMILY_BATCHES if fits(batch, dim, seqlen)]  # fmt: skip
    rng.shuffle(shapes)
    count = min(size, SEEDS_PER_SHAPE * len(shapes))
    return [ScanConfig(seqlen=seqlen, batch=batch, dim=dim, **options, seed=rng.randrange(2**31),
                       name=name)
            for batch, dim, seqlen in itertools.islice(itertools.cycle(shapes), count)]  # fmt: skip


def scan_families(n: int, seed: int, size: int) -> list[list[ScanConfig]]:
    """Families (``family``) of ``size`` configurations or fewer, at least n configurations in
    all. The fixed core, the same in every run: a family for each row of ``covering_keys``, and
    for the grouped-B/C regression's options (REGRESSION) in each dtype and group count, each
    on a class of CORE_CLASSES (small dims, lengths from 512), dealt in turn. Then families
    drawn with ``seed``: options from decks of each axis, classes from a deck of every dim
    class with every length class."""
    core = random.Random("families-core")
    classes = _Deck(core, CORE_CLASSES)
    families = [family(key, *classes.draw(), size, core) for key in covering_keys()]
    regression = {k: v for k, v in REGRESSION.items() if k in OPTION_AXES}
    for dtype in DTYPE_NAMES.values():
        for groups in GROUPS:
            options = regression | dict(dtype=dtype, groups=groups)
            families.append(family(options, *classes.draw(), size, core,
                                   name="grouped_bc_regression"))  # fmt: skip
    rng = random.Random(f"families-{seed}")
    deck = _decks(rng, OPTION_AXES)
    classes = _Deck(rng, [(dims, lengths) for dims in DIM_CLASSES for lengths in LENGTH_CLASSES])
    while sum(map(len, families)) < n:
        options = _normalized({name: deck[name].draw() for name in OPTION_AXES})
        configs = family(options, *classes.draw(), size, rng)
        if configs:  # none where the class's shapes all exceed the cap at these states
            families.append(configs)
    return families


# ---- the GPU run's float64 oracle ----------------------------------------------------------------
#
# selective_scan_ref (helpers.oracle) steps through time in Python: about 12 small kernels a
# step forward and backward (on the CPU 60-110 us a step, measured), 50,000 at 4096 steps, and
# some 20 million over the GPU's sample. The GPU's test workers are processes of their own, and
# kernels of different processes do not run side by side without MPS: the loop, not the
# operator, would set the run's time. chunked_scan_ref is the same recurrence in float64, in
# chunks of steps: within a chunk h_t = a_t h_(t-1) + x_t is exactly h_t = e^(S_t) (h_in +
# sum_(s <= t) e^(-S_s) x_s) with S_t = sum_(r <= t) log a_r = sum_(r <= t) delta_r A, cumulative
# sums over the steps (vectorized); from chunk to chunk the states pass in a Python loop over
# chunks, not steps (64 at 4096 steps: some 500 kernels forward and backward). A chunk is short
# enough that |S| <= CHUNK_LOG_DECAY = 64: the rescaled terms stay within e^(+-64) (float64
# spans e^(+-709)), and S's own rounding (at most 64 additions of partial sums below 64: 64 *
# 64 * 2^-53 = 5e-13 absolute) moves each factor e^(+-S) by at most 5e-13 relative, eight
# orders of magnitude under the float32 bound. The sum's rounding is bounded as the loop's is,
# by u times the sum of the magnitudes of the decayed terms. selective_scan_ref stays the
# oracle of record (tests/test_reference.py checks it against a naive loop);
# test_gpu_conformance.py checks in every run that the two agree to 1e-12 (measured on the CPU:
# 8e-15 at worst over 150 configurations, every form of B and C, 1 to 4096 steps).
CHUNK_LOG_DECAY = 64.0
CHUNK_STEPS = 64  # at most; fewer where the decay is steeper
# Channels are taken in slices of at most this many (batch, channel, state, step) elements: the
# chunked form keeps about ten such float64 tensors for its backward (over 100 GB at the
# largest sizes of the sample, about 3 GB a slice), and the test workers share the GPU's memory.
ORACLE_ELEMENTS = 1 << 25


def _bc_rows(t: torch.Tensor, dim: int, channels: slice) -> torch.Tensor:
    """B or C for ``channels``, broadcastable to (batch, channels, seqlen, dstate): constant
    (dim, dstate) rows, or each channel's group of a variable one (batch, [groups,] dstate,
    seqlen)."""
    if t.dim() == 2:
        return t[channels][None, :, None, :]
    rows = t if t.dim() == 4 else t.unsqueeze(1)
    group = torch.arange(dim, device=t.device)[channels] // (dim // rows.shape[1])
    return rows[:, group].transpose(-1, -2)


def chunked_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                     return_last_state=False, channels: slice | None = None):  # fmt: skip
    """selective_scan_ref's semantics (real A, no initial state or packed sequences), computed
    in chunks of steps (see CHUNK_LOG_DECAY), in the inputs' dtype (float64 here). ``channels``:
    compute only these channels (out and last_state then hold those)."""
    dim, seqlen = u.shape[1:]
    sl = slice(None) if channels is None else channels
    u, delta, A = u[:, sl], delta[:, sl], A[sl]
    dt = delta if delta_bias is None else delta + delta_bias[sl, None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    dA = dt.unsqueeze(-1) * A[:, None, :]  # (batch, channels, seqlen, dstate), log a_t <= 0
    x = (dt * u).unsqueeze(-1) * _bc_rows(B, dim, sl)
    Cr = _bc_rows(C, dim, sl)
    steep = dA.abs().max().item() if dA.numel() else 0.0
    K = CHUNK_STEPS
    while K > 1 and K * steep > CHUNK_LOG_DECAY:
        K //= 2
    n_chunks = -(-seqlen // K)
    pad = (0, 0, 0, n_chunks * K - seqlen)  # padded steps: no decay, no input

    def chunked(t):
        return torch.nn.functional.pad(t.expand(dA.shape), pad).unflatten(2, (n_chunks, K))

    S = chunked(dA).cumsum(3)  # (batch, channels, chunks, K, dstate)
    growth = S.exp()
    x = chunked(x)
    # Each chunk entered with h = 0: x_t plus the earlier steps' terms, an exclusive cumulative
    # sum, so that a step's own input takes no factor e^(S_t) e^(-S_t) (exactly x_t, and no
    # rounding-sized gradient w.r.t. A where the loop's is exactly 0, as at one step).
    local = x
    if K > 1:  # (with one step a chunk, e^(-S) may overflow where no term needs it)
        earlier = (x * (-S).exp()).cumsum(3)[:, :, :, :-1]
        local = x + growth * torch.nn.functional.pad(earlier, (0, 0, 1, 0))
    # The state entering each chunk. unbind, not indexing chunk c: autograd then stacks the
    # chunks' gradients once instead of scattering each into a zero tensor of the full size.
    decays, ends = growth[:, :, :, -1].unbind(2), local[:, :, :, -1].unbind(2)
    entries = [local.new_zeros(local.shape[:2] + local.shape[4:])]
    for c in range(n_chunks - 1):
        entries.append(decays[c] * entries[-1] + ends[c])
    h = local + growth * torch.stack(entries, 2).unsqueeze(3)
    y = (h * chunked(Cr)).sum(-1).flatten(2)[..., :seqlen]
    out = y if D is None else y + u * D[sl, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z[:, sl])
    last = h.flatten(2, 3)[:, :, seqlen - 1]
    return (out, last) if return_last_state else out


def chunked_oracle(inputs: dict, delta_softplus: bool, weights,
                   max_elements: int = ORACLE_ELEMENTS):  # fmt: skip
    """helpers.oracle computed by chunked_scan_ref: float64 (out, last_state) and the gradients
    of sum(out * w_out) + sum(last_state * w_last) w.r.t. every float input, a slice of channels
    of at most max_elements (batch x dstate x seqlen each) at a time."""
    assert inputs.get("initial_state") is None and inputs.get("cu_seqlens") is None
    names = float_inputs(inputs)
    ref = {k: v.requires_grad_(True) if k in names else v for k, v in to_float64(inputs).items()
           if k not in ("initial_state", "cu_seqlens")}  # fmt: skip
    batch, dim, seqlen = inputs["u"].shape
    per_channel = batch * inputs["A"].shape[1] * max(seqlen, 1)
    width = max(1, min(dim, max_elements // per_channel))
    w_out, w_last = (w.double() for w in weights)
    outs, lasts = [], []
    for start in range(0, dim, width):
        sl = slice(start, start + width)
        out, last = chunked_scan_ref(**ref, delta_softplus=delta_softplus,
                                     return_last_state=True, channels=sl)  # fmt: skip
        loss = (out * w_out[:, sl]).sum() + (last * w_last[:, sl]).sum()
        loss.backward()  # accumulates into each input's .grad
        outs.append(out.detach())
        lasts.append(last.detach())
    grads = {k: ref[k].grad for k in names}
    return torch.cat(outs, 1), torch.cat(lasts, 1), grads


# The chunked float64 oracle (conformance.chunked_oracle) against the step loop it replaces
# here (helpers.oracle), in float64 (on the GPU and in CI): sizes that cut into several chunks,
# padded last chunks, channel slices, every form of B and C. The two are the same recurrence,
# rounded differently: they agree to about 1e-14 (measured on the CPU over 150 configurations).
ORACLE_CASES = [
    ScanConfig(seqlen=L, dtype=dtype, batch=2, dim=dim, dstate=n, b_var=b_var, c_var=True,
                  groups=groups, flat=flat, last_state=True, delta_bias=bias, softplus=softplus,
                  z=z, D=D, seed=i)
    for i, (L, dtype, dim, n, b_var, groups, flat, bias, softplus, z, D) in enumerate([
        (1, "fp32", 8, 16, True, 2, False, True, True, True, True),
        (64, "bf16", 4, 1, False, 1, True, False, True, False, True),
        (372, "fp16", 24, 8, True, 4, False, True, False, True, False),
        (1134, "fp32", 8, 64, True, 1, True, True, True, True, True),
        (2048, "bf16", 768, 4, False, 2, False, False, False, True, True),
    ])
]  # fmt: skip


def check_chunked_oracle(config: ScanConfig, device: str) -> None:
    """Raise unless chunked_oracle and helpers.oracle agree to 1e-12 relative on config's
    inputs (slices of 2**16 elements: several channel slices at ORACLE_CASES' sizes)."""
    inputs = config.inputs(device)
    weights = make_weights(inputs, seed=config.seed + 1)
    loop = oracle(inputs, config.softplus, weights)
    chunked = chunked_oracle(inputs, config.softplus, weights, max_elements=1 << 16)
    assert set(chunked[2]) == set(loop[2])
    pairs = [("out", chunked[0], loop[0]), ("last_state", chunked[1], loop[1])]
    pairs += [(f"d{k}", chunked[2][k], loop[2][k]) for k in loop[2]]
    errors = {name: rel_err(a, b) for name, a, b in pairs}
    assert max(errors.values()) < 1e-12, errors


# ---- checking one configuration -----------------------------------------------------------------


@dataclass
class Outcome:
    """A configuration's comparisons: the failed ones (messages), and the largest error over
    its bound among all (for the summary: how close the passing ones came)."""

    config: str
    failures: list = dataclasses.field(default_factory=list)
    worst: float = 0.0
    seconds: float = 0.0  # the check's wall time (set by run_chunk)

    def compare(self, name: str, actual, expected, tol: float) -> None:
        if actual is None or tuple(actual.shape) != tuple(expected.shape):
            shape = None if actual is None else tuple(actual.shape)
            self.failures.append(f"{name}: shape {shape} != {tuple(expected.shape)}")
            self.worst = math.inf
            return
        err = rel_err(actual, expected)  # inf where any element is not finite
        self.worst = max(self.worst, err / tol)
        if not err <= tol:
            self.failures.append(f"{name}: relative error {err:.3g} > {tol:.3g}")

    def identical(self, name: str, actual, expected) -> None:
        """actual must equal expected bit for bit (NaN where expected has NaN)."""
        if not torch.equal(actual.nan_to_num(), expected.nan_to_num()):
            self.failures.append(f"{name}: not bit for bit equal to the first call's")
            self.worst = math.inf

    def message(self) -> str:
        return f"{self.config}: " + "; ".join(self.failures)


def poison(device) -> None:
    """Fill the CUDA caching allocator's free blocks with NaN, so that an output element the op
    allocates but never writes shows up (on CPU the poison_uninitialized fixture does this)."""
    if torch.device(device).type == "cuda":
        torch.full((64 << 20,), float("nan"), device=device)


def check_scan(cfg: ScanConfig, device, reference=oracle) -> Outcome:
    """selective_scan_fn on ``cfg``: out, last_state (when returned) and the gradient of every
    float input, for the loss sum(out * w_out) [+ sum(last_state * w_last)] with random weights
    in the outputs' dtypes (so the oracle's dout is exactly the operator's). ``reference``:
    the float64 oracle, helpers.oracle (the step loop) or chunked_oracle.

    On a GPU the call runs twice, and the second is the one checked: eager calls of a layout
    already planned replay the first call's launches (kernels.launch.launch_sequence), and
    must equal it bit for bit (the backward is deterministic)."""
    outcome = Outcome(cfg.id)
    inputs = cfg.inputs(device)
    w_out, w_last = make_weights(inputs, seed=cfg.seed + 1)

    def call():
        poison(device)
        return run_scan(
            selective_scan_fn, leaves(inputs), cfg.softplus, (w_out, w_last), cfg.last_state
        )

    out, last, grads = call()
    if torch.device(device).type == "cuda":
        first = (out, last, grads)
        out, last, grads = call()
        outcome.identical("out", out, first[0])
        if cfg.last_state:
            outcome.identical("last_state", last, first[1])
        for name, grad in grads.items():
            outcome.identical(f"d{name}", grad, first[2][name])
    if not cfg.last_state:
        w_last = torch.zeros_like(w_last)
    ref_out, ref_last, ref_grads = reference(inputs, cfg.softplus, (w_out, w_last))
    outcome.compare("out", out, ref_out, TOLERANCE[out.dtype])
    if cfg.last_state:
        outcome.compare("last_state", last, ref_last, TOLERANCE[last.dtype])
    for name in float_inputs(inputs):
        grad = grads.get(name)
        tol = TOLERANCE[inputs[name].dtype]
        outcome.compare(f"d{name}", grad, ref_grads[name], tol)
    return outcome


# ---- mamba_inner_fn ------------------------------------------------------------------------------


@dataclass(frozen=True)
class InnerConfig:
    """One call of mamba_inner_fn. B and C each from x_proj (variable) or given (constant);
    rms: the RMSNorm weights of each B/C taken from x_proj, and of delta."""

    seqlen: int
    dtype: str
    batch: int
    d_inner: int
    dstate: int
    width: int
    b_var: bool
    c_var: bool
    rms: bool
    proj_bias: bool  # B_proj_bias / C_proj_bias for the variable ones
    out_bias: bool
    conv_bias: bool
    D: bool
    delta_bias: bool
    checkpoint_lvl: int
    seed: int

    @property
    def id(self) -> str:
        return (
            f"inner-L{self.seqlen}-{self.dtype}-b{self.batch}-d{self.d_inner}-n{self.dstate}"
            f"-w{self.width}-B_{'var' if self.b_var else 'const'}"
            f"-C_{'var' if self.c_var else 'const'}"
            + _flags(self, ("rms", "proj_bias", "out_bias", "conv_bias", "D", "delta_bias"))
            + f"-ckpt{self.checkpoint_lvl}-seed{self.seed}"
        )  # fmt: skip

    def inputs(self, device) -> dict:
        """Weights at the scales of tests/test_mamba_inner.py (every stage of order one): the
        projections and the conv in the dtype (mamba_inner_fn wants them in xz's), A, D,
        delta_bias, constant B/C, projection biases and RMSNorm weights float32, as a float32
        Mamba layer's parameters."""
        gen = torch.Generator().manual_seed(self.seed)
        dtype = BY_NAME[self.dtype]
        d_model = max(2, self.d_inner // 2)
        # mamba's dt_rank "auto", ceil(d_model / 16), is 1 for small layers: delta is then one
        # number a token times a fixed vector, and its RMSNorm is sign(dt) * w / rms(w), a step
        # function whose gradient no rounding bound survives (a float64 run on inputs moved by
        # u moved the gradients 10-40%). At least 4, as real layers (rank 48-256) are.
        rank = max(4, math.ceil(d_model / 16))
        n = self.dstate

        def rand(*shape, scale=1.0, dt=dtype):
            return (scale * torch.randn(shape, generator=gen)).to(dt).to(device)

        def uniform(*shape):
            return torch.rand(shape, generator=gen).to(device)

        rows = rank + n * (self.b_var + self.c_var)
        f32 = torch.float32
        inputs = {
            "xz": rand(self.batch, 2 * self.d_inner, self.seqlen),
            "conv1d_weight": rand(self.d_inner, 1, self.width, scale=0.5),
            "conv1d_bias": rand(self.d_inner) if self.conv_bias else None,
            "x_proj_weight": rand(rows, self.d_inner, scale=self.d_inner**-0.5),
            "delta_proj_weight": rand(self.d_inner, rank, scale=rank**-0.5),
            "out_proj_weight": rand(d_model, self.d_inner, scale=self.d_inner**-0.5),
            "out_proj_bias": rand(d_model) if self.out_bias else None,
            "A": -(0.5 * uniform(self.d_inner, n) + 0.1),
            "D": rand(self.d_inner, dt=f32) if self.D else None,
            "delta_bias": 0.5 * uniform(self.d_inner) - 1.0 if self.delta_bias else None,
        }
        for name, var in (("B", self.b_var), ("C", self.c_var)):
            if not var:
                inputs[name] = rand(self.d_inner, n, dt=f32)
            elif self.proj_bias:
                inputs[f"{name}_proj_bias"] = rand(n, dt=f32)
            if var and self.rms:
                inputs[f"{name.lower()}_rms_weight"] = 1 + rand(n, scale=0.1, dt=f32)
        if self.rms:
            inputs["dt_rms_weight"] = 0.5 + rand(self.d_inner, scale=0.1, dt=f32)
        return inputs


def sample_inner(n: int, seed: int, profile: Profile) -> list[InnerConfig]:
    """n mamba_inner_fn configurations of ``profile``'s sizes and cost cap. RMSNorm over one
    state is x / |x| (ill-conditioned near 0, no bound to defend), so dstate 1 takes no RMSNorm
    weights. delta_softplus stays on, as in every mamba_ssm caller (the Mamba layer passes
    True): without it delta, a linear projection, takes negative values, exp(delta * A) exceeds
    1 and the recurrence amplifies rounding exponentially in the length (a bf16 case measured
    18 u at 32 steps), a computation with no bound to defend; selective_scan_fn's grid covers
    softplus off, on positive deltas."""
    rng = random.Random(f"inner-{profile.name}-{seed}")
    deck = _decks(rng, dict(
        seqlen=profile.seqlens, dim=profile.dims, dstate=profile.dstates, dtype=profile.dtypes,
        width=(2, 3, 4), b_var=(True, False), c_var=(True, False), rms=(True, False),
        proj_bias=(True, False), out_bias=(True, False), conv_bias=(True, False),
        D=(True, False), delta_bias=(True, False), ckpt=(0, 1),
    ))  # fmt: skip
    configs = []
    while len(configs) < n:
        dim, dstate = deck["dim"].draw(), deck["dstate"].draw()
        fit = _fit_sizes(rng, profile, deck["seqlen"].draw(), dim, dstate)
        if fit is None:
            continue
        batch, seqlen = fit
        configs.append(InnerConfig(
            seqlen=seqlen, dtype=DTYPE_NAMES[deck["dtype"].draw()], batch=batch, d_inner=dim,
            dstate=dstate, width=deck["width"].draw(), b_var=deck["b_var"].draw(),
            c_var=deck["c_var"].draw(), rms=deck["rms"].draw() and dstate > 1,
            proj_bias=deck["proj_bias"].draw(), out_bias=deck["out_bias"].draw(),
            conv_bias=deck["conv_bias"].draw(), D=deck["D"].draw(),
            delta_bias=deck["delta_bias"].draw(), checkpoint_lvl=deck["ckpt"].draw(),
            seed=rng.randrange(2**31),
        ))  # fmt: skip
    return configs


def inner_families(n: int, seed: int, size: int, profile: Profile = GPU) -> list[list]:
    """mamba_inner_fn in families of ``size`` configurations (n or more in all), for the GPU
    (see LENGTH_CLASSES): what its scan compiles for fixed in a family (dtype, dstate, B and C
    variable or constant, D, delta_bias, d_inner, batch and a class of lengths), what only the
    PyTorch stages around the scan see dealt within it (conv width and bias, RMSNorm weights,
    projection and output biases, checkpoint level), with new seeds. A family of one option
    combination costs about one configuration's compiles (counted as for the scan). As in
    ``sample_inner``: no RMSNorm weights at one state, delta_softplus on."""
    rng = random.Random(f"inner-families-{seed}")
    deck = _decks(rng, dict(
        lengths=LENGTH_CLASSES, dim=profile.dims, dstate=profile.dstates, dtype=profile.dtypes,
        b_var=(True, False), c_var=(True, False), D=(True, False), delta_bias=(True, False),
    ))  # fmt: skip
    inside = _decks(rng, dict(
        width=(2, 3, 4), rms=(True, False), proj_bias=(True, False), out_bias=(True, False),
        conv_bias=(True, False), ckpt=(0, 1),
    ))  # fmt: skip
    families = []
    while sum(map(len, families)) < n:
        lengths, dim, dstate = deck["lengths"].draw(), deck["dim"].draw(), deck["dstate"].draw()
        batch = next((b for b in profile.batches
                      if all(profile.cost(b, L, dim, dstate) <= profile.max_cost
                             for L in lengths)), None)  # fmt: skip
        if batch is None:
            continue
        fixed = dict(dtype=DTYPE_NAMES[deck["dtype"].draw()], batch=batch, d_inner=dim,
                     dstate=dstate, b_var=deck["b_var"].draw(), c_var=deck["c_var"].draw(),
                     D=deck["D"].draw(), delta_bias=deck["delta_bias"].draw())  # fmt: skip
        families.append([InnerConfig(
            seqlen=lengths[i % len(lengths)], **fixed, width=inside["width"].draw(),
            rms=inside["rms"].draw() and dstate > 1, proj_bias=inside["proj_bias"].draw(),
            out_bias=inside["out_bias"].draw(), conv_bias=inside["conv_bias"].draw(),
            checkpoint_lvl=inside["ckpt"].draw(), seed=rng.randrange(2**31),
        ) for i in range(size)])  # fmt: skip
    return families


def check_inner(cfg: InnerConfig, device, scan_reference=selective_scan_ref) -> Outcome:
    """mamba_inner_fn's output and the gradient of every tensor input against mamba_ssm's
    inner path composed in float64 (model_helpers.mamba_inner_naive) on the same inputs, each
    within max(g u, 8 x the problem's measured sensitivity) (see INNER_ROUNDINGS).
    ``scan_reference``: the float64 scan inside that path (chunked_scan_ref on the GPU)."""
    outcome = Outcome(cfg.id)
    inputs = cfg.inputs(device)
    names = [k for k, v in inputs.items() if v is not None]
    poison(device)
    mine = {k: None if v is None else v.detach().clone().requires_grad_(True)
            for k, v in inputs.items()}  # fmt: skip
    out = mamba_inner_fn(**mine, checkpoint_lvl=cfg.checkpoint_lvl)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    w_out = torch.randn(out.shape, generator=gen).to(out.dtype).to(device)
    grads = torch.autograd.grad((out * w_out).sum(), [mine[k] for k in names])
    expected, ref_grads = _inner_reference(inputs, names, w_out, scan_reference)
    # The problem's sensitivity to rounding (see INNER_ROUNDINGS): float64 runs on inputs moved
    # by up to u each.
    dtype = BY_NAME[cfg.dtype]
    sensitivity = [0.0] * (1 + len(names))
    for probe in range(INNER_PROBES):
        gen.manual_seed(cfg.seed + 2 + probe)
        moved = {k: None if v is None else v.double() * (
                     1 + U[dtype] * (2 * torch.rand(v.shape, generator=gen, dtype=torch.float64)
                                     - 1).to(device))
                 for k, v in inputs.items()}  # fmt: skip
        moved_out, moved_grads = _inner_reference(moved, names, w_out, scan_reference)
        pairs = zip((moved_out, *moved_grads), (expected, *ref_grads), strict=True)
        changes = [rel_err(a, b) for a, b in pairs]
        sensitivity = [max(a, b) for a, b in zip(sensitivity, changes, strict=True)]
    tols = [max(INNER_TOLERANCE[dtype], INNER_ROUNDINGS * s) for s in sensitivity]
    outcome.compare("out", out, expected, tols[0])
    for name, grad, ref_grad, tol in zip(names, grads, ref_grads, tols[1:], strict=True):
        outcome.compare(f"d{name}", grad, ref_grad, tol)
    return outcome


def _inner_reference(inputs: dict, names: list, w_out, scan_reference) -> tuple:
    """(out, gradients of sum(out * w_out) w.r.t. ``names``) of mamba_ssm's inner path in
    float64, its scan by ``scan_reference``."""
    ref = {k: None if v is None else v.detach().double().requires_grad_(True)
           for k, v in inputs.items()}  # fmt: skip
    out = model_helpers.mamba_inner_naive(**ref, scan_ref=scan_reference)
    grads = torch.autograd.grad((out * w_out.double()).sum(), [ref[k] for k in names])
    return out.detach(), grads


# ---- selective_state_update ---------------------------------------------------------------------

STEP_DIMS = (2048, 2064, 4096)
STEP_DSTATES = (16, 32, 64)
HEADDIMS = (64, 48, 16)  # mamba2's 64, and smaller; those dividing the dim are used
STEP_GROUPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class StepConfig:
    """One decode step. layout "plain": mamba1's (batch, dim, dstate); "heads": (batch, nheads,
    headdim, dstate) with ngroups; "tied": heads, with dt, A, D and dt_bias one value a head
    broadcast over headdim (and dstate) by stride 0, as mamba2 passes them."""

    layout: str
    dtype: str
    state_dtype: str
    batch: int
    dim: int  # nheads * headdim in the heads layouts
    headdim: int
    ngroups: int
    dstate: int
    D: bool
    z: bool
    dt_bias: bool
    softplus: bool
    indices: bool  # state_batch_indices: rows step random slots; one row is padding (-1)
    seed: int

    @property
    def id(self) -> str:
        heads = "" if self.layout == "plain" else f"-h{self.dim // self.headdim}x{self.headdim}"
        groups = "" if self.layout == "plain" else f"-g{self.ngroups}"
        return (
            f"step-{self.layout}-{self.dtype}-state_{self.state_dtype}-b{self.batch}"
            f"-d{self.dim}{heads}{groups}-n{self.dstate}"
            + _flags(self, ("D", "z", "dt_bias", "softplus", "indices"))
            + f"-seed{self.seed}"
        )

    def inputs(self, device) -> tuple[dict, torch.Tensor | None]:
        """(step inputs, state_batch_indices or None). With indices the state has batch + 2
        slots; row 0 is padding when batch > 1."""
        heads = self.layout != "plain"
        kwargs = dict(nheads=self.dim // self.headdim, ngroups=self.ngroups) if heads else {}
        inputs = step_inputs(
            batch=self.batch, dim=self.headdim if heads else self.dim, dstate=self.dstate,
            dtype=BY_NAME[self.dtype], state_dtype=BY_NAME[self.state_dtype], D=self.D,
            z=self.z, dt_bias=self.dt_bias, seed=self.seed, **kwargs,
        )  # fmt: skip
        inputs = {k: None if v is None else v.to(device) for k, v in inputs.items()}
        if self.layout == "tied":  # one value a head, broadcast by stride 0
            inputs["dt"] = inputs["dt"][..., :1].expand_as(inputs["dt"])
            inputs["A"] = inputs["A"][:, :1, :1].expand_as(inputs["A"])
            for name in ("D", "dt_bias"):
                if inputs[name] is not None:
                    inputs[name] = inputs[name][:, :1].expand_as(inputs[name])
        if not self.indices:
            return inputs, None
        gen = torch.Generator().manual_seed(self.seed + 1)
        slots = self.batch + 2
        state = inputs["state"]
        pool = torch.randn((slots, *state.shape[1:]), generator=gen).to(state.dtype).to(device)
        rows = torch.randperm(slots, generator=gen)[: self.batch]
        if self.batch > 1:
            rows[0] = -1
        return inputs | {"state": pool}, rows.to(torch.int32).to(device)


def sample_step(n: int, seed: int, batches=(1, 2, 4, 8)) -> list[StepConfig]:
    """n decode-step configurations: layouts, dims, dstates, dtypes (the state's own or
    float32) and options dealt from decks; head sizes and group counts that divide."""
    rng = random.Random(f"step-{seed}")
    deck = _decks(rng, dict(
        layout=("plain", "heads", "tied"), dim=STEP_DIMS, dstate=STEP_DSTATES, dtype=DTYPES,
        state_f32=(True, False), batch=batches, headdim=HEADDIMS, ngroups=STEP_GROUPS,
        D=(True, False), z=(True, False), dt_bias=(True, False), softplus=(True, False),
        indices=(True, False),
    ))  # fmt: skip
    configs = []
    for _ in range(n):
        layout, dim, dtype = deck["layout"].draw(), deck["dim"].draw(), deck["dtype"].draw()
        headdim = deck["headdim"].draw()
        if dim % headdim:
            headdim = next(h for h in HEADDIMS if dim % h == 0)
        ngroups = deck["ngroups"].draw()
        while (dim // headdim) % ngroups:
            ngroups //= 2
        configs.append(StepConfig(
            layout=layout, dtype=DTYPE_NAMES[dtype],
            state_dtype="fp32" if deck["state_f32"].draw() else DTYPE_NAMES[dtype],
            batch=deck["batch"].draw(), dim=dim, headdim=headdim,
            ngroups=1 if layout == "plain" else ngroups, dstate=deck["dstate"].draw(),
            D=deck["D"].draw(), z=deck["z"].draw(), dt_bias=deck["dt_bias"].draw(),
            softplus=deck["softplus"].draw(), indices=deck["indices"].draw(),
            seed=rng.randrange(2**31),
        ))  # fmt: skip
    return configs


def step_families(n: int, seed: int, batches=(1, 2, 3, 4, 8)) -> list[list[StepConfig]]:
    """Decode steps for the GPU, n or more: each configuration of ``sample_step`` at every batch
    in ``batches``, with new seeds. The batch is the launch's grid, not an argument the kernel
    specializes on (but for a batch of one without indices: slots is then 1), so a family
    compiles once or twice where as many configurations of their own compiled each (286
    specializations for 300, counted as for the scan)."""
    rng = random.Random(f"step-families-{seed}")
    return [[dataclasses.replace(cfg, batch=batch, seed=rng.randrange(2**31)) for batch in batches]
            for cfg in sample_step(-(-n // len(batches)), seed)]  # fmt: skip


def check_step(cfg: StepConfig, device) -> Outcome:
    """One step against the float64 oracle of tests/test_state_update.py: out, and the state
    updated in place (with indices: the named slots stepped, the others untouched, padding rows'
    out 0)."""
    outcome = Outcome(cfg.id)
    inputs, indices = cfg.inputs(device)
    state = inputs["state"]
    before = state.double().clone()
    if indices is None:
        expected_state, expected_out = step_oracle(inputs, cfg.softplus)
    else:
        kept = indices >= 0
        rows = inputs | {"state": state[torch.where(kept, indices, 0).long()]}
        new, expected_out = step_oracle(rows, cfg.softplus)
        expected_out[~kept] = 0.0
        expected_state = before.clone()
        expected_state[indices[kept].long()] = new[kept]
    poison(device)
    out = selective_state_update(**inputs, dt_softplus=cfg.softplus, state_batch_indices=indices)
    outcome.compare("out", out, expected_out, STEP_TOLERANCE[out.dtype])
    outcome.compare("state", state, expected_state, STEP_TOLERANCE[state.dtype])
    return outcome


# ---- running chunks and the summary -------------------------------------------------------------


def chunks(configs: list, size: int) -> list[list]:
    return [configs[i : i + size] for i in range(0, len(configs), size)]


def run_chunk(check, configs: list, device, **options) -> list[Outcome]:
    """Every configuration of a chunk (``check(cfg, device, **options)``), whatever the others
    gave; an exception is a failure of that configuration. Each outcome carries its wall time
    (on CUDA to the end of its kernels)."""
    outcomes = []
    for cfg in configs:
        start = time.perf_counter()
        try:
            outcome = check(cfg, device, **options)
        except Exception as e:  # the configuration failed: report it, go on
            outcome = Outcome(cfg.id, [f"raised {type(e).__name__}: {e}"], math.inf)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        outcome.seconds = time.perf_counter() - start
        outcomes.append(outcome)
    return outcomes


def failure_report(outcomes: list[Outcome]) -> str:
    failed = [o for o in outcomes if o.failures]
    lines = [f"{len(failed)} of {len(outcomes)} configurations failed:"]
    return "\n".join([*lines, *(o.message() for o in failed)])


def record(path: str, function: str, outcomes: list[Outcome], header: dict) -> None:
    """Merge a chunk's outcomes into the JSON summary at ``path`` (under a lock: pytest-xdist's
    workers share it). The summary is rewritten after every chunk, so a run cut short leaves the
    counts so far. A file from another run (another ``header['run']``) is started over."""
    import fcntl
    import hashlib
    import tempfile

    # The lock lives outside the summary's folder (the GPU script's $OUT keeps few files).
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    with open(os.path.join(tempfile.gettempdir(), f"conformance-{digest}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = {}
        if summary.get("run") != header["run"]:
            summary = header | {"functions": {}}
        entry = summary["functions"].setdefault(
            function, {"configurations": 0, "passed": 0, "failed": 0, "worst_error_over_bound":
                       0.0, "seconds": 0.0, "first_of_chunk_seconds": 0.0, "failures": []}
        )  # fmt: skip
        # Worker seconds checking, and of that the chunks' first configurations: on a GPU a
        # chunk is a family, whose first configuration compiles its kernels (the rest, some).
        entry["seconds"] += sum(o.seconds for o in outcomes)
        entry["first_of_chunk_seconds"] += outcomes[0].seconds if outcomes else 0.0
        for o in outcomes:
            entry["configurations"] += 1
            entry["failed" if o.failures else "passed"] += 1
            entry["worst_error_over_bound"] = max(
                entry["worst_error_over_bound"], o.worst if math.isfinite(o.worst) else 1e300
            )
            if o.failures:
                entry["failures"].append(o.message())
        with open(path, "w") as f:  # readers take the lock too
            json.dump(summary, f, indent=1)


def tolerance_table() -> dict:
    """The bounds as written into the summary."""
    return {
        "scan_and_step": {DTYPE_NAMES[d]: t for d, t in TOLERANCE.items()},
        "mamba_inner_fn": {DTYPE_NAMES[d]: t for d, t in INNER_TOLERANCE.items()},
    }


def summary_header(device, seed: int, planned: dict) -> dict:
    """What the summary records besides the counts: the run (pytest-xdist's id shared by its
    workers, else this process), device, date, versions, commit, the sample's seed, the planned
    counts and the bounds."""
    import datetime

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "run": os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}",
        "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton_version,
        # GIT_COMMIT: set by the GPU script's caller where the copied tree's .git is stale.
        "commit": os.environ.get("GIT_COMMIT"),
        "backend": os.environ.get("SELECTIVE_SCAN_BACKEND", "auto"),
        "seed": seed,
        "planned": planned,
        "tolerance": tolerance_table(),
    }


def report(function: str, outcomes: list[Outcome], header: dict) -> None:
    """Record the outcomes in $CONFORMANCE_OUT (a JSON file) when it is set, then fail with
    every failed configuration named."""
    path = os.environ.get("CONFORMANCE_OUT")
    if path:
        record(path, function, outcomes, header)
    assert not any(o.failures for o in outcomes), failure_report(outcomes)
