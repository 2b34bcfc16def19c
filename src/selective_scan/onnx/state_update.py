"""ONNX translation of the decode step (``state_update`` and ``state_update_triton``).

Both operators write into ``state``. Before translating, the exporter functionalizes the graph:
a call of a mutating operator becomes a call of the higher-order operator
``auto_functionalized_v2`` (``auto_functionalized`` in older graphs), which takes the operator
and its arguments and returns the operator's outputs followed by the new values of the
mutated tensors. Those higher-order calls are what is translated here: out and the new state
are computed as values, with no mutation left in the ONNX graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx_ir as ir
import torch

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


def _state_update_ops() -> set:
    """The mutating step operators this module translates (the Triton one where registered)."""
    from .. import state_update as module  # registers the operators

    found = {torch.ops.selective_scan.state_update.default}
    if module.state_update_triton is not None:
        found.add(torch.ops.selective_scan.state_update_triton.default)
    return found


def _view_of_base(base: ir.Value, kwargs: dict[str, Any], prefix: str):
    """(the mutated argument read from its base, a function writing a new value of it back
    into the base), from auto_functionalized's view information for that argument."""
    if f"{prefix}_storage_offset" in kwargs:
        raise NotImplementedError(
            "selective_scan.onnx: the decode step's state is a strided view of another tensor "
            "(as_strided); pass the state tensor itself, or a slice along one dimension"
        )
    if f"{prefix}_slice_dim" in kwargs:
        axis = kwargs[f"{prefix}_slice_dim"]
        start, end = kwargs[f"{prefix}_slice_start"], kwargs[f"{prefix}_slice_end"]
        if not all(isinstance(v, int) for v in (axis, start, end)):
            raise NotImplementedError(
                "selective_scan.onnx: the decode step's state is a slice of another tensor "
                "with bounds that vary with the inputs; pass the state tensor itself"
            )
        bounds = (ints(op, start), ints(op, end), ints(op, axis))
        size = static_size(base, axis, "the sliced dimension of the state's base")
        view = op.Slice(base, *bounds)

        def write(new: ir.Value) -> ir.Value:
            parts = [op.Slice(base, ints(op, 0), ints(op, start), ints(op, axis)), new]
            if end < size:
                parts.append(op.Slice(base, ints(op, end), ints(op, size), ints(op, axis)))
            return op.Concat(*parts, axis=axis)

        return view, write
    return base, lambda new: new  # the base itself, or an alias of it


def auto_functionalized(target: torch._ops.OpOverload, /, **kwargs: Any) -> Sequence[ir.Value]:
    """The functionalized call of a mutating operator: (out, new state) for the decode step.

    Translates ``auto_functionalized_v2`` (the state passed as ``_all_bases`` and view
    information) and ``auto_functionalized`` (the state passed by name)."""
    if target not in _state_update_ops():
        raise NotImplementedError(
            f"selective_scan.onnx: no ONNX translation for the mutating operator {target}"
        )
    step_args = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    if "_all_bases" not in kwargs:  # auto_functionalized: the state is an argument
        out, new_state = state_update(**step_args)
        return [out, new_state]
    bases = list(kwargs["_all_bases"])
    index = kwargs["_state_base_index"]
    state, write = _view_of_base(bases[index], kwargs, "_state")
    out, new_state = state_update(state, **step_args)
    bases[index] = write(new_state)
    return [out, *bases]
