"""ONNX export of models built on the selective scan, for ONNX Runtime or any ONNX runtime.

    import selective_scan.onnx
    selective_scan.onnx.export(model, (input_ids,), "model.onnx", dynamic_shapes=...)

or, calling torch.onnx.export directly:

    torch.onnx.export(model, args, dynamo=True,
                      custom_translation_table=selective_scan.onnx.translation_table())

The translations use standard ONNX operators only (Scan, elementwise ops, MatMul): the scan's
forward operators (scan.py) and the functionalized decode step (state_update.py); the causal
convolutions are plain PyTorch code and need none. Needs the ``onnx``, ``onnxscript`` and
``onnxruntime`` packages (``pip install "selective-scan[onnx]"``); importing ``selective_scan``
alone does not import them. ``decoding`` exports a language model's prefill and decode step and
runs greedy generation in ONNX Runtime.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from onnxscript.onnx_types import TensorType

from .. import ops
from ..cpu import CHUNK as _TORCH_CHECKPOINT_INTERVAL
from .functional import prepare
from .scan import scan_fwd as _scan_fwd
from .state_update import state_update as _state_update

# The translations' tensor arguments are the exporter's graph values. TensorType (any tensor)
# is the annotation the exporter can read when it infers a translation's signature.
Tensor = TensorType


def scan_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Translation of ``selective_scan::scan_fwd``: (out (batch, dim, L), last_state (batch or
    num_seqs, dim, dstate), checkpoints (batch, dim, ceil(L / 64) + 1, dstate) of zeros)."""
    return _scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus,
        checkpoint_interval=_TORCH_CHECKPOINT_INTERVAL,
    )  # fmt: skip


def scan_fwd_triton(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Translation of ``selective_scan::scan_fwd_triton``: as ``scan_fwd``, with the Triton
    backend's checkpoint interval in the checkpoints' shape."""
    from ..kernels.scan import CKPT

    return _scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus,
        checkpoint_interval=CKPT,
    )  # fmt: skip


def state_update_values(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Translation of ``selective_scan_onnx::state_update_values``, the decode step as values
    (functional.py): (out (batch, dim) or (batch, nheads, dim), the new state)."""
    return _state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def translation_table() -> dict[Callable, Callable]:
    """{operator: ONNX translation} for ``torch.onnx.export(..., dynamo=True,
    custom_translation_table=...)``: the scan's forward ops (both backends) and the decode
    step as values (a model that calls the in-place step needs ``prepare`` first)."""
    table: dict[Callable, Callable] = {
        torch.ops.selective_scan.scan_fwd.default: scan_fwd,
        torch.ops.selective_scan_onnx.state_update_values.default: state_update_values,
    }
    if ops.HAS_TRITON:
        table[torch.ops.selective_scan.scan_fwd_triton.default] = scan_fwd_triton
    return table


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple,
    path: str | os.PathLike,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    external_data: bool | None = None,
    custom_translation_table: dict[Callable, Callable] | None = None,
    **onnx_kwargs: Any,
) -> torch.onnx.ONNXProgram:
    """Export ``model(*args, **kwargs)`` to the ONNX file ``path``; returns the ONNX program.

    The model is captured with ``torch.export.export(model, args, kwargs=kwargs,
    dynamic_shapes=dynamic_shapes)`` (torch.export's Dim specs; an ExportedProgram is taken
    as it is), its decode steps made functional (``prepare``), and converted by
    ``torch.onnx.export(..., dynamo=True)`` with this package's translations plus
    ``custom_translation_table`` (whose entries win). ``onnx_kwargs`` go to torch.onnx.export
    (``input_names``, ``output_names``, ``opset_version``, ``optimize``, ``verify``...). The
    weights go into the file itself unless ``external_data`` is True (or the model is over
    2 GB, ONNX's limit for one file).
    """
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    else:
        program = torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    table = translation_table()
    table.update(custom_translation_table or {})
    onnx_kwargs.setdefault("verbose", False)
    # The registry warns about every torchvision op it cannot register (torchvision missing):
    # noise about someone else's package.
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)
    try:
        onnx_program = torch.onnx.export(
            prepare(program), (), dynamo=True, custom_translation_table=table, **onnx_kwargs
        )
    finally:
        registry_log.setLevel(level)
    onnx_program.save(path, external_data=external_data)
    return onnx_program


__all__ = ["export", "prepare", "translation_table"]
