"""Causal depthwise conv1d, drop-in for the causal-conv1d package, written with PyTorch ops.

A valid depthwise conv over the input preceded by its history (zeros, or given states):
``F.conv1d`` in eager mode, a sum of shifted products under ``torch.compile`` and
``torch.export`` (see ``_depthwise_conv``). Differentiable, no custom op, no graph break.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_shape, check_tensor

_ACTIVATIONS = (None, "silu", "swish")
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_conv_inputs(
    name: str, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> None:
    """x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); activation in
    (None, "silu", "swish"). ``name`` is the public function, for the messages."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    check_tensor("x", x, (3,))
    dim = x.shape[1]
    check_tensor("weight", weight, (2,))
    check_shape(name, "weight", weight, (dim, None), "(dim, width)")
    if bias is not None:
        check_tensor("bias", bias, (1,))
        check_shape(name, "bias", bias, (dim,), "(dim,)")


def _depthwise_conv(
    x_hist: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> Tensor:
    """Valid (unpadded) depthwise conv1d, then the activation, in weight's dtype.

    x_hist: (batch, dim, width - 1 + seqlen), the inputs preceded by their width - 1
    predecessors; weight: (dim, width); returns (batch, dim, seqlen).
    """
    x_hist = x_hist.to(weight.dtype)
    if torch.compiler.is_compiling():
        # Under torch.compile / torch.export: Inductor's lowering of the conv backward fixes
        # every size of the graph (a recompilation for each new batch or seqlen), while this
        # sum of width shifted products fuses into one kernel and keeps the sizes symbolic.
        width = weight.shape[1]
        seqlen = x_hist.shape[-1] - width + 1
        out = x_hist[..., :seqlen] * weight[:, :1]
        for k in range(1, width):
            out = out + x_hist[..., k : k + seqlen] * weight[:, k : k + 1]
        if bias is not None:
            out = out + bias[:, None]
    else:  # eager: one library conv (cuDNN / oneDNN) beats width separate passes
        out = F.conv1d(x_hist, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return out if activation is None else F.silu(out)


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal depthwise conv1d: out[t] = act(bias + sum_k weight[:, k] * x[t - width + 1 + k]).

    x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); initial_states:
    (batch, dim, width - 1), the inputs before x (zeros when None); activation None, "silu" or
    "swish". Returns out (batch, dim, seqlen) in x's dtype, and with return_final_states also
    the last width - 1 inputs (batch, dim, width - 1), written into final_states_out when given.
    Differentiable in x, weight, bias and initial_states.

    Not supported: seq_idx (packed sequences); passing it raises ValueError.
    """
    _check_conv_inputs("causal_conv1d_fn", x, weight, bias, activation)
    if seq_idx is not None:
        raise ValueError(
            "causal_conv1d_fn: seq_idx (sequences packed along seqlen) is not supported; "
            "run the sequences as separate batch rows"
        )
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    if initial_states is None:
        x_hist = F.pad(x, (width - 1, 0))
    else:
        check_tensor("initial_states", initial_states, (3,))
        check_shape(
            "causal_conv1d_fn", "initial_states", initial_states, (batch, dim, width - 1),
            "(batch, dim, width - 1)",
        )  # fmt: skip
        x_hist = torch.cat([initial_states.to(x.dtype), x], dim=-1)
    out = _depthwise_conv(x_hist, weight, bias, activation).to(x.dtype)
    if not return_final_states:
        return out
    final_states = x_hist[..., seqlen:]
    if final_states_out is not None:
        final_states_out.copy_(final_states)
        final_states = final_states_out
    return out, final_states


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: Tensor | None = None,
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """Continue a causal conv1d by a few steps, updating ``conv_state`` in place.

    x: (batch, dim) or (batch, dim, seqlen), the new inputs; conv_state: (batch, dim,
    state_len) with state_len >= width - 1, the latest inputs (oldest first); weight:
    (dim, width); bias: (dim,); conv_state_indices: (batch,) int32/int64, the rows of a larger
    conv_state (num_rows, dim, state_len) that x's rows continue (continuous batching).
    Returns out shaped like x, in x's dtype; conv_state then ends with the new inputs.

    Not supported: cache_seqlens (conv_state as a circular buffer); passing it raises ValueError.
    """
    if cache_seqlens is not None:
        raise ValueError(
            "causal_conv1d_update: cache_seqlens (a circular-buffer conv_state) is not "
            "supported; keep conv_state in order, latest input last"
        )
    one_step = isinstance(x, Tensor) and x.dim() == 2
    x3 = x.unsqueeze(-1) if one_step else x
    fn = "causal_conv1d_update"
    _check_conv_inputs(fn, x3, weight, bias, activation)
    batch, dim, seqlen = x3.shape
    width = weight.shape[1]
    check_tensor("conv_state", conv_state, (3,))
    if conv_state_indices is None:
        state = conv_state
        check_shape(fn, "conv_state", conv_state, (batch, dim, None), "(batch, dim, state_len)")
    else:
        check_tensor("conv_state_indices", conv_state_indices, (1,), dtypes=_INDEX_DTYPES)
        check_shape(fn, "conv_state_indices", conv_state_indices, (batch,), "(batch,)")
        check_shape(fn, "conv_state", conv_state, (None, dim, None), "(num_rows, dim, state_len)")
        state = conv_state.index_select(0, conv_state_indices)
    state_len = state.shape[-1]
    if state_len < width - 1:
        raise ValueError(
            f"{fn}: conv_state must hold state_len >= width - 1 = {width - 1} inputs, "
            f"got {state_len}"
        )
    window = torch.cat([state, x3.to(state.dtype)], dim=-1)  # (batch, dim, state_len + seqlen)
    out = _depthwise_conv(window[..., state_len - (width - 1) :], weight, bias, activation)
    new_state = window[..., seqlen:]
    if conv_state_indices is None:
        conv_state.copy_(new_state)
    else:
        conv_state.index_copy_(0, conv_state_indices.long(), new_state)
    out = out.to(x3.dtype)
    return out.squeeze(-1) if one_step else out
