"""Small helpers for writing translations with onnxscript ops, shared by every translation.

Two builders are in play: in the exporter's graph, ops are ``onnxscript.opset18`` calls recorded
by the exporter; in a ``Scan`` body, ops are calls on the ``OpBuilder`` that
``onnxscript.build_graph`` passes. Helpers take ``op`` as their first argument and only use what
both accept: tensor inputs, explicit ``Constant`` nodes (no Python scalars, whose promotion
differs between the two), and attributes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxscript

# ONNX operator set the translations are written against; every op used has kept its semantics
# in later sets, so a model exported at a higher opset runs them unchanged.
OPSET = 18
op = onnxscript.opset18

FLOAT = ir.DataType.FLOAT
DOUBLE = ir.DataType.DOUBLE
INT64 = ir.DataType.INT64

_names = itertools.count()


def const(op: Any, value: Any, dtype: ir.DataType) -> ir.Value:
    """A Constant node holding ``value`` (a scalar gives a 0-d tensor) in ``dtype``."""
    array = np.asarray(value, dtype=dtype.numpy())
    return op.Constant(value=ir.tensor(array, dtype=dtype))


def ints(op: Any, *values: int) -> ir.Value:
    """A 1-D int64 Constant (shapes, axes, slice bounds)."""
    return const(op, list(values), INT64)


def dim(op: Any, x: ir.Value, axis: int) -> ir.Value:
    """x.shape[axis] (axis >= 0) as a 1-D int64 tensor of one element (dynamic sizes)."""
    return op.Shape(x, start=axis, end=axis + 1)


def slice_(op: Any, x: ir.Value, start: int, end: int, axis: int = 0) -> ir.Value:
    """x[start:end] along ``axis`` with static bounds."""
    return op.Slice(x, ints(op, start), ints(op, end), ints(op, axis))


def static_size(x: ir.Value, axis: int, what: str) -> int:
    """A size the translation needs at export time (model dimensions: dim, dstate, groups)."""
    size = x.shape[axis] if x.shape is not None else None
    if not isinstance(size, int):
        raise NotImplementedError(
            f"selective_scan.onnx: {what} must be a static size in the exported graph, got "
            f"{size}; mark only batch and sequence length as dynamic"
        )
    return size


def float_dtype(*values: ir.Value | None) -> ir.DataType:
    """The compute dtype: float64 when any input is float64, else float32 (as the op)."""
    if any(v is not None and v.dtype == DOUBLE for v in values):
        return DOUBLE
    return FLOAT


def cast(op: Any, x: ir.Value, dtype: ir.DataType) -> ir.Value:
    """x in dtype, without a node when it already is."""
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


def softplus(op: Any, x: ir.Value, dtype: ir.DataType) -> ir.Value:
    """torch's softplus: log1p(exp(x)), x itself above the threshold 20.

    ONNX has no log1p, and log(1 + e) loses e's digits for small e = exp(x) (a relative error
    of 1e-4 at x = -7, where Mamba's delta starts); log(u) * e / (u - 1) with u = 1 + e is
    accurate to a few ulps (Goldberg), and e itself where u rounds to 1. Written out rather than
    with ONNX's Softplus, which ONNX Runtime computes about 2x slower on CPU."""
    e = op.Exp(x)
    u = op.Add(e, const(op, 1.0, dtype))
    u_minus_1 = op.Sub(u, const(op, 1.0, dtype))
    log1p = op.Mul(op.Log(u), op.Div(e, u_minus_1))
    small = op.Equal(u_minus_1, const(op, 0.0, dtype))
    large = op.Greater(x, const(op, 20.0, dtype))
    return op.Where(large, x, op.Where(small, e, log1p))


def silu(op: Any, x: ir.Value) -> ir.Value:
    """x * sigmoid(x)."""
    return op.Mul(x, op.Sigmoid(x))


def tensor_value(name: str, dtype: ir.DataType, shape: Sequence[int | str | None]) -> ir.Value:
    """A fresh graph input of a subgraph."""
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)))


def build_body(
    fn: Callable[..., Sequence[ir.Value]],
    inputs: Sequence[ir.Value],
    num_outputs: int,
    name: str,
) -> ir.Graph:
    """A subgraph (Scan or Loop body) traced from fn(op, *inputs) -> outputs.

    Every value of the body gets a name unique in the model: ONNX wants names unique across a
    graph and its subgraphs, and two bodies traced alike would otherwise share names.
    """
    prefix = f"{name}_{next(_names)}"
    for value in inputs:
        value.name = f"{prefix}_{value.name}"
    outputs = [ir.Value(name=f"{prefix}_out_{i}") for i in range(num_outputs)]
    graph = onnxscript.build_graph(
        fn, inputs=inputs, outputs=outputs, opset_imports={"": OPSET}, name=prefix
    )
    for node in graph:
        node.name = f"{prefix}_{node.name}"
        for value in node.outputs:
            if not value.name.startswith(prefix):
                value.name = f"{prefix}_{value.name}"
    return graph


def multi_output(
    first: ir.Value, count: int, types: Sequence[tuple[ir.DataType, Any]]
) -> list[ir.Value]:
    """All outputs of a variadic-output node (Scan, Loop) given its first one.

    The exporter's recorder sizes a node's outputs from its schema, one for a variadic output
    (it does not count a Scan body's outputs as onnxscript's own evaluator does); the node is
    resized to ``count`` outputs and each output typed from ``types`` ((dtype, shape) pairs)
    so that later ops can bind their type constraints."""
    node = first.producer()
    node.resize_outputs(count)
    for value, (dtype, shape) in zip(node.outputs, types, strict=True):
        value.type = ir.TensorType(dtype)
        value.shape = ir.Shape(list(shape)) if shape is not None else None
    return list(node.outputs)
