"""ONNX translation of the scan's forward operators (``scan_fwd`` and ``scan_fwd_triton``).

Standard ONNX only: a ``Scan`` over chunks of steps (``chunk_length``), with elementwise ops and
MatMul.

Per chunk of T steps, in time-major (T, batch, dim, dstate) tensors: the decays
a_t = exp(delta_t A) and inputs x_t = delta_t u_t B_t of all T steps at once; then the states
h_t = a_t h_{t-1} + x_t one step after another (a multiply and an add each, so as accurate as
the sequential loop); then y_t = sum_n C_t h_t of all T steps at once. The sequence is padded to
whole chunks with delta = 0 and u = 0, steps that leave the state unchanged (decay exp(0) = 1,
input 0), so the state after the padding is the last state.

Packed sequences (cu_seqlens, batch 1): at the first step of each sequence the decay is zeroed
and the sequence's initial state, decayed, added to the input (as cpu.py does); each sequence's
last state is gathered from the chunk that holds its last step.

The checkpoints output (the backward's state every few steps) is zeros of the fake's shape: an
inference graph never reads it, and unless the model returns it the optimizer removes it.
"""

from __future__ import annotations

import os
from typing import Any

import onnx_ir as ir

from ._graph import (
    INT64,
    build_body,
    cast,
    const,
    dim,
    float_dtype,
    ints,
    multi_output,
    op,
    silu,
    slice_,
    softplus,
    static_size,
    tensor_value,
)

# Steps per chunk: the largest power of two up to MAX_CHUNK whose (T, dim, dstate) chunk
# buffers hold at most CHUNK_ELEMENTS floats per batch row. Timed in ONNX Runtime on one thread
# (bench/results/onnx_cpu.json, batch 1, dstate 16, 1024 steps): at dim 64 chunks of 16-32
# steps took 4.4-4.6 ms against 7.9 for a Scan iteration per step, whose overhead dominates
# small steps; at dim 384, 8-32 steps about 10% less than one; at dim 1536 every length from 1
# to 32 within 5% (75-79 ms), the per-step work dominating.
CHUNK_ELEMENTS = 1 << 16
MAX_CHUNK = 32
# A fixed chunk length instead of the rule, read at export (tests and benchmarks set it).
CHUNK_VARIABLE = "SELECTIVE_SCAN_ONNX_CHUNK"


def chunk_length(dim: int, dstate: int) -> int:
    """Steps per chunk for a scan of dim channels and dstate states ($SELECTIVE_SCAN_ONNX_CHUNK
    when set)."""
    if fixed := os.environ.get(CHUNK_VARIABLE):
        if not fixed.isdigit() or int(fixed) < 1:
            raise ValueError(f"selective_scan: {CHUNK_VARIABLE} must be a positive integer, got "
                             f"{fixed!r}")  # fmt: skip
        return int(fixed)
    steps = 1
    while 2 * steps <= MAX_CHUNK and 2 * steps * dim * dstate <= CHUNK_ELEMENTS:
        steps *= 2
    return steps


class _Weight:
    """B or C in one of its forms, as a chunk sees it.

    constant (dim, dstate): taken from the outer graph; variable (batch, dstate, L): a scanned
    input, (T, batch, dstate) per chunk; grouped (batch, groups, dstate, L): (T, batch, groups,
    dstate) per chunk, channel c using group c // (dim // groups).
    """

    def __init__(self, t: ir.Value, dim_: int, dstate: int, cdt: ir.DataType, name: str):
        self.rank = len(t.shape)
        self.dim, self.dstate = dim_, dstate
        self.value = cast(op, t, cdt)
        self.groups = static_size(t, 1, f"{name}'s groups") if self.rank == 4 else 1
        self.scanned = self.rank != 2

    def time_major(self, pad: ir.Value, chunk: int) -> ir.Value:
        """(nchunks, T, batch, [groups,] dstate) from (batch, [groups,] dstate, L)."""
        lead = [0] * (self.rank - 1)
        x = op.Pad(self.value, op.Concat(ints(op, *lead, 0, *lead), pad, axis=0))
        x = op.Reshape(x, ints(op, *lead, -1, chunk))
        return op.Transpose(x, perm=[self.rank - 1, self.rank, *range(self.rank - 1)])

    def times(self, o: Any, w: ir.Value, block: ir.Value | None, chunk: int) -> ir.Value:
        """(T, batch, dim, dstate) <- w (T, batch, dim) times this weight (block: the chunk's
        part of a scanned weight)."""
        if self.rank == 2:
            return o.Mul(o.Unsqueeze(w, ints(o, -1)), self.value)
        if self.rank == 3:
            return o.Mul(o.Unsqueeze(w, ints(o, -1)), o.Unsqueeze(block, ints(o, 2)))
        g = self.groups
        split = o.Reshape(w, ints(o, chunk, -1, g, self.dim // g, 1))
        product = o.Mul(split, o.Unsqueeze(block, ints(o, 3)))  # (T, b, g, dim / g, dstate)
        return o.Reshape(product, ints(o, chunk, -1, self.dim, self.dstate))

    def contract(self, o: Any, h: ir.Value, block: ir.Value | None, chunk: int) -> ir.Value:
        """(T, batch, dim) <- sum_n h[t, b, d, n] * weight[t, b, group(d), n]."""
        if self.rank == 2:
            return o.ReduceSum(o.Mul(h, self.value), ints(o, -1), keepdims=0)
        if self.rank == 3:  # (T, b, dim, dstate) @ (T, b, dstate, 1)
            return o.Squeeze(o.MatMul(h, o.Unsqueeze(block, ints(o, -1))), ints(o, -1))
        g = self.groups  # (T, b, g, dim / g, dstate) @ (T, b, g, dstate, 1)
        split = o.Reshape(h, ints(o, chunk, -1, g, self.dim // g, self.dstate))
        y = o.MatMul(split, o.Unsqueeze(block, ints(o, -1)))
        return o.Reshape(y, ints(o, chunk, -1, self.dim))


def _states(o: Any, a: ir.Value, x: ir.Value, h: ir.Value, chunk: int) -> ir.Value:
    """The states h_t = a_t h_{t-1} + x_t (T, batch, dim, dstate) of a chunk from its decays
    a and inputs x and the state h (batch, dim, dstate) entering it.

    One step after another: a log-depth (Hillis-Steele) scan over the chunk, log2(T) levels of
    whole-chunk ops, measured 1.5-3x slower in ONNX Runtime, as it does log2(T) times the work.
    """
    decays = o.Split(a, num_outputs=chunk, axis=0, _outputs=chunk) if chunk > 1 else [a]
    inputs = o.Split(x, num_outputs=chunk, axis=0, _outputs=chunk) if chunk > 1 else [x]
    state = o.Unsqueeze(h, ints(o, 0))
    states = []
    for a_t, x_t in zip(decays, inputs, strict=True):
        state = o.Add(o.Mul(a_t, state), x_t)
        states.append(state)
    return o.Concat(*states, axis=0) if chunk > 1 else state


def scan_fwd(
    u: ir.Value,
    delta: ir.Value,
    A: ir.Value,
    B: ir.Value,
    C: ir.Value,
    D: ir.Value | None,
    z: ir.Value | None,
    delta_bias: ir.Value | None,
    initial_state: ir.Value | None,
    cu_seqlens: ir.Value | None,
    delta_softplus: bool,
    *,
    checkpoint_interval: int,
    chunk: int | None = None,
) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The forward op in ONNX: (out (batch, dim, L) in u's dtype, last_state (batch or
    num_seqs, dim, dstate), checkpoints (batch, dim, ceil(L / checkpoint_interval) + 1,
    dstate), zeros); states in float32, float64 when an input is. ``chunk``: steps per chunk
    (default: ``chunk_length``)."""
    cdt = float_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    dim_, dstate = static_size(A, 0, "dim"), static_size(A, 1, "dstate")
    T = chunk or chunk_length(dim_, dstate)
    Bw = _Weight(B, dim_, dstate, cdt, "B")
    Cw = _Weight(C, dim_, dstate, cdt, "C")
    uc, dt, Ac = cast(op, u, cdt), cast(op, delta, cdt), cast(op, A, cdt)
    if delta_bias is not None:
        dt = op.Add(dt, op.Unsqueeze(cast(op, delta_bias, cdt), ints(op, -1)))
    if delta_softplus:
        dt = softplus(op, dt, cdt)
    init = None if initial_state is None else cast(op, initial_state, cdt)

    batch, length = dim(op, u, 0), dim(op, u, 2)
    steps = ints(op, T)
    pad = op.Mod(op.Sub(steps, op.Mod(length, steps)), steps)
    padded = op.Squeeze(op.Add(length, pad), ints(op, 0))

    def time_major(x: ir.Value) -> ir.Value:
        """(batch, dim, L) -> (nchunks, T, batch, dim), padded with zeros."""
        x = op.Pad(x, op.Concat(ints(op, 0, 0, 0, 0, 0), pad, axis=0))
        return op.Transpose(op.Reshape(x, ints(op, 0, 0, -1, T)), perm=[2, 3, 0, 1])

    # The Scan's inputs: carried states, then per-chunk inputs (with their body shapes).
    zeros = op.Expand(const(op, 0.0, cdt), op.Concat(batch, ints(op, dim_, dstate), axis=0))
    carried = [init if init is not None and cu_seqlens is None else zeros]
    scanned = [time_major(dt), time_major(op.Mul(dt, uc))]
    shapes = [(cdt, [T, None, dim_]), (cdt, [T, None, dim_])]
    for w in (Bw, Cw):
        if w.scanned:
            scanned.append(w.time_major(pad, T))
            shapes.append((cdt, [T, None, *([w.groups] if w.rank == 4 else []), dstate]))
    packed = cu_seqlens is not None
    if packed:
        cu = cast(op, cu_seqlens, INT64)
        num_seqs = op.Sub(dim(op, cu, 0), ints(op, 1))
        zero, one = const(op, 0, INT64), const(op, 1, INT64)
        positions = op.Range(zero, padded, one)
        # A step's sequence: the entries of cu_seqlens at or before it, less one (the last of
        # several equal entries is the non-empty sequence that starts there).
        at_or_before = op.LessOrEqual(
            op.Unsqueeze(cu, ints(op, 0)), op.Unsqueeze(positions, ints(op, 1))
        )
        seq = op.Sub(op.ReduceSum(op.Cast(at_or_before, to=INT64), ints(op, 1), keepdims=0), one)
        seq = op.Min(seq, op.Squeeze(op.Sub(num_seqs, ints(op, 1)), ints(op, 0)))
        # Padding steps (from L on) start nothing, though cu_seqlens ends at L.
        starts = op.And(
            op.Equal(op.Gather(cu, seq, axis=0), positions),
            op.Less(positions, op.Squeeze(length, ints(op, 0))),
        )
        scanned.append(op.Reshape(op.Cast(starts, to=cdt), ints(op, -1, T)))
        shapes.append((cdt, [T]))
        if init is not None:
            scanned.append(op.Reshape(seq, ints(op, -1, T)))
            shapes.append((INT64, [T]))
        scanned.append(op.Range(zero, padded, const(op, T, INT64)))  # each chunk's first step
        shapes.append((INT64, []))
        ends = op.Sub(slice_(op, cu, 1, 2**62), one)
        nonempty = op.Greater(slice_(op, cu, 1, 2**62), slice_(op, cu, 0, -1))
        # An empty sequence's last state is its initial state (zeros without one).
        if init is None:
            init_shape = op.Concat(num_seqs, ints(op, dim_, dstate), axis=0)
        carried.append(init if init is not None else op.Expand(const(op, 0.0, cdt), init_shape))

    def body(o: Any, h: ir.Value, *values: ir.Value) -> list[ir.Value]:
        """One chunk: (state entering it, [last states,] its inputs) -> (state leaving it,
        [last states,] y (T, batch, dim))."""
        values = list(values)
        last = values.pop(0) if packed else None
        dt_c, dtu_c = values.pop(0), values.pop(0)
        blocks = [values.pop(0) if w.scanned else None for w in (Bw, Cw)]
        a = o.Exp(o.Mul(o.Unsqueeze(dt_c, ints(o, -1)), Ac))  # (T, batch, dim, dstate)
        x = Bw.times(o, dtu_c, blocks[0], T)
        if packed:
            first = o.Reshape(values.pop(0), ints(o, T, 1, 1, 1))
            if init is not None:  # a sequence's first step decays its initial state
                seq_c = values.pop(0)
                h_init = o.Unsqueeze(o.Gather(init, seq_c, axis=0), ints(o, 1))
                x = o.Add(x, o.Mul(o.Mul(a, h_init), first))
            a = o.Mul(a, o.Sub(const(o, 1.0, cdt), first))
            t0 = values.pop(0)
        states = _states(o, a, x, h, T)
        y = Cw.contract(o, states, blocks[1], T)
        h = o.Squeeze(slice_(o, states, T - 1, T), ints(o, 0))
        if not packed:
            return [h, y]
        local = o.Sub(ends, t0)  # each sequence's last step, counted from this chunk's first
        inside = o.And(
            o.And(o.GreaterOrEqual(local, const(o, 0, INT64)), o.Less(local, const(o, T, INT64))),
            nonempty,
        )
        index = o.Clip(local, const(o, 0, INT64), const(o, T - 1, INT64))
        picked = o.Squeeze(o.Gather(states, index, axis=0), ints(o, 1))  # batch is 1
        last = o.Where(o.Unsqueeze(inside, ints(o, 1, 2)), picked, last)
        return [h, last, y]

    state_shape = (cdt, [None, dim_, dstate])
    inputs = [tensor_value(f"carried{i}", *state_shape) for i in range(len(carried))]
    inputs += [tensor_value(f"scanned{i}", *s) for i, s in enumerate(shapes)]
    graph = build_body(body, inputs, len(carried) + 1, "selective_scan_chunk")
    first = op.Scan(*carried, *scanned, body=graph, num_scan_inputs=len(scanned))
    types = [state_shape] * len(carried) + [(cdt, [None, T, None, dim_])]
    *finals, y = multi_output(first, len(carried) + 1, types)
    last = finals[-1]

    # (nchunks, T, batch, dim) -> (batch, dim, L)
    y = op.Reshape(y, op.Concat(ints(op, -1), op.Shape(y, start=2), axis=0))
    y = op.Transpose(op.Slice(y, ints(op, 0), length, ints(op, 0)), perm=[1, 2, 0])
    if D is not None:
        y = op.Add(y, op.Mul(uc, op.Unsqueeze(cast(op, D, cdt), ints(op, -1))))
    if z is not None:
        y = op.Mul(y, silu(op, cast(op, z, cdt)))
    interval = ints(op, checkpoint_interval)
    slots = op.Add(op.Div(op.Sub(op.Add(length, interval), ints(op, 1)), interval), ints(op, 1))
    shape = op.Concat(batch, ints(op, dim_), slots, ints(op, dstate), axis=0)
    return cast(op, y, u.dtype), last, op.Expand(const(op, 0.0, cdt), shape)
