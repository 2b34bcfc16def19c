"""ONNX translation of the decode step, as values: (out, the new state).

``state_update`` and ``state_update_triton`` write into ``state``; ``functional.prepare``
replaces their calls by ``selective_scan_onnx::state_update_values``, which this translates.
Same arithmetic as ``state_update._state_update_torch``: float32 (float64 when an input is),
the new state rounded to state's dtype after out is computed from it.
"""

from __future__ import annotations

import onnx_ir as ir

from ._graph import INT64, cast, const, float_dtype, ints, op, silu, softplus, static_size

# (rank in the heads form, axis a plain argument lacks), as in _state_update_checks._LIFT.
_LIFT = {
    "state": (4, 1), "x": (3, 1), "dt": (3, 1), "A": (3, 0), "B": (3, 1), "C": (3, 1),
    "D": (2, 0), "z": (3, 1), "dt_bias": (2, 0),
}  # fmt: skip


def _heads(name: str, t: ir.Value | None) -> ir.Value | None:
    """An argument in the heads form: a plain one gets its missing axis (of size 1)."""
    if t is None:
        return None
    rank, axis = _LIFT[name]
    return t if len(t.shape) == rank else op.Unsqueeze(t, ints(op, axis))


def state_update(
    state: ir.Value,
    x: ir.Value,
    dt: ir.Value,
    A: ir.Value,
    B: ir.Value,
    C: ir.Value,
    D: ir.Value | None = None,
    z: ir.Value | None = None,
    dt_bias: ir.Value | None = None,
    dt_softplus: bool = False,
    state_batch_indices: ir.Value | None = None,
) -> tuple[ir.Value, ir.Value]:
    """One decode step as values: (out in x's dtype and the state's form, (batch, dim) or
    (batch, nheads, dim); the new state, like ``state``).

    Plain form: state (batch, dim, dstate), x, dt, z (batch, dim), A (dim, dstate), B, C
    (batch, dstate), D, dt_bias (dim,); heads form: state (batch, nheads, dim, dstate) and the
    rest as ``selective_state_update`` documents. With state_batch_indices (batch,), row b
    reads and writes slot state_batch_indices[b]; rows with an index out of range leave every
    slot alone and get out 0.
    """
    plain = len(state.shape) == 3
    cdt = float_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    slots = _heads("state", state)
    nheads = 1 if plain else static_size(state, 1, "nheads")
    dstate = static_size(state, -1, "dstate")
    xh, dth, zh = _heads("x", x), _heads("dt", dt), _heads("z", z)
    Ah = _heads("A", A)
    Dh, biash = _heads("D", D), _heads("dt_bias", dt_bias)

    kept = None
    if state_batch_indices is None:
        h = cast(op, slots, cdt)
    else:
        index = cast(op, state_batch_indices, INT64)
        num_slots = op.Shape(slots, start=0, end=1)
        kept = op.And(
            op.GreaterOrEqual(index, const(op, 0, INT64)),
            op.Less(index, op.Squeeze(num_slots, ints(op, 0))),
        )
        safe = op.Where(kept, index, const(op, 0, INT64))
        h = cast(op, op.Gather(slots, safe, axis=0), cdt)

    xc, dtc = cast(op, xh, cdt), cast(op, dth, cdt)
    if biash is not None:
        dtc = op.Add(dtc, cast(op, biash, cdt))
    if dt_softplus:
        dtc = softplus(op, dtc, cdt)

    def per_head(t: ir.Value) -> ir.Value:
        """B or C -> (batch, nheads, 1, dstate), head h using group h // (nheads // ngroups)."""
        groups = static_size(t, 1, "B and C's groups") if len(t.shape) == 3 else 1
        t = cast(op, _heads("B", t), cdt)
        if groups != nheads:
            t = op.Expand(op.Unsqueeze(t, ints(op, 2)), ints(op, 1, 1, nheads // groups, 1))
            t = op.Reshape(t, ints(op, 0, nheads, dstate))
        return op.Unsqueeze(t, ints(op, 2))

    decay = op.Exp(op.Mul(op.Unsqueeze(dtc, ints(op, -1)), cast(op, Ah, cdt)))
    new = op.Add(op.Mul(h, decay), op.Mul(op.Unsqueeze(op.Mul(dtc, xc), ints(op, -1)), per_head(B)))
    # The output reads the new state before it is rounded to state's dtype, as the kernels do.
    y = op.ReduceSum(op.Mul(new, per_head(C)), ints(op, -1), keepdims=0)
    if Dh is not None:
        y = op.Add(y, op.Mul(xc, cast(op, Dh, cdt)))
    if zh is not None:
        y = op.Mul(y, silu(op, cast(op, zh, cdt)))
    new = cast(op, new, state.dtype)
    if kept is None:
        new_slots = new
    else:
        y = op.Where(op.Unsqueeze(kept, ints(op, 1, 2)), y, const(op, 0.0, cdt))
        rows = op.Compress(index, kept, axis=0)
        new_slots = op.ScatterND(
            slots, op.Unsqueeze(rows, ints(op, 1)), op.Compress(new, kept, axis=0)
        )
    out = cast(op, y, x.dtype)
    if plain:
        out = op.Squeeze(out, ints(op, 1))
        new_slots = op.Squeeze(new_slots, ints(op, 1))
    return out, new_slots
