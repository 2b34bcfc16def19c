"""The decode step as a functional operator, for export.

``selective_scan::state_update`` (and ``state_update_triton``) write into ``state``. Exporting
functionalizes the graph, which turns such a call into the higher-order operator
``auto_functionalized_v2(op, **arguments)``; torch.onnx's exporter (torch 2.13) cannot translate
that node whatever the translation table holds, as it reads the operator argument as a graph
value. ``prepare`` therefore rewrites each step call of an exported program, before it is
functionalized, into a call of ``selective_scan_onnx::state_update_values``, which returns the
output and the new state as values, followed by ``state.copy_(new_state)``; functionalization
then turns the copy into plain data flow (into a view of a larger tensor too), and
``state_update_values`` has an ONNX translation (state_update.py).
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .. import state_update as _step


@torch.library.custom_op("selective_scan_onnx::state_update_values", mutates_args=())
def state_update_values(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    state_batch_indices: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``selective_state_update`` without the mutation: (out, the new state), state unchanged.
    Shapes as ``selective_state_update``; the new state is shaped like ``state``."""
    new_state = state.clone()
    out = _step._state_update_torch(
        new_state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices
    )
    return out, new_state


@state_update_values.register_fake
def _fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    out = _step._fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    return out, state.new_empty(state.shape)


_VALUES_OP = torch.ops.selective_scan_onnx.state_update_values.default


def step_ops() -> set:
    """The mutating decode-step operators (the Triton one where registered)."""
    found = {torch.ops.selective_scan.state_update.default}
    if _step.state_update_triton is not None:
        found.add(torch.ops.selective_scan.state_update_triton.default)
    return found


_STEP_ARGS = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus",
              "state_batch_indices")  # fmt: skip
_DEFAULTS = {"D": None, "z": None, "dt_bias": None, "dt_softplus": False,
             "state_batch_indices": None}  # fmt: skip


def prepare(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """An exported program ready for torch.onnx.export: each in-place decode step replaced by
    ``state_update_values`` and a copy into the state. ``program`` is modified; a program with
    no decode step is returned as it is.

    ``selective_scan.onnx.export`` calls this itself; call it when exporting to ONNX with
    ``torch.onnx.export(prepare(torch.export.export(model, args)), ...)`` directly."""
    graph = program.graph_module.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in step_ops()]
    if not calls:
        return program
    for node in calls:
        given = dict(zip(_STEP_ARGS, node.args, strict=False)) | dict(node.kwargs)
        args = tuple(given.get(name, _DEFAULTS.get(name)) for name in _STEP_ARGS)
        with graph.inserting_after(node):
            values = graph.call_function(_VALUES_OP, args)
        with graph.inserting_after(values):
            out = graph.call_function(operator.getitem, (values, 0))
        with graph.inserting_after(out):
            new_state = graph.call_function(operator.getitem, (values, 1))
        with graph.inserting_after(new_state):
            graph.call_function(torch.ops.aten.copy_.default, (args[0], new_state))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    program.graph_module.recompile()
    # Re-tracing functionalizes the copies (and fills in the new nodes' metadata).
    return program.run_decompositions({})
