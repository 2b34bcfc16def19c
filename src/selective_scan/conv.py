"""Causal depthwise conv1d, drop-in for the causal-conv1d package, written with PyTorch ops.

A valid depthwise conv over the input preceded by its history (zeros, or given states):
``F.conv1d`` in eager mode, a sum of shifted products under ``torch.compile`` and
``torch.export`` (see ``_depthwise_conv``). Sequences packed along seqlen (``seq_idx``, or
``cu_seqlens`` with a state per sequence in ``causal_conv1d_varlen_fn``) always take the sum of
products, each tap reading only inputs of its token's own sequence. Differentiable, no custom
op, no graph break, no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import (
    check_cu_seqlens_values,
    check_flag,
    check_non_empty,
    check_shape,
    check_tensor,
)

_ACTIVATIONS = (None, "silu", "swish")
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_conv_inputs(
    name: str, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> None:
    """x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); activation in
    (None, "silu", "swish"). ``name`` is the public function, for the messages."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    check_tensor("x", x, (3,), fn=name)
    check_non_empty(name, "x", x, "(batch, dim, seqlen)")
    dim = x.shape[1]
    check_tensor("weight", weight, (2,), device=x.device, ref="x", fn=name)
    check_shape(name, "weight", weight, (dim, None), "(dim, width)")
    if weight.shape[1] < 1:
        raise ValueError(f"{name}: weight must have width >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, (1,), device=x.device, ref="x", fn=name)
        check_shape(name, "bias", bias, (dim,), "(dim,)")


def _sum_of_taps(taps, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """act(bias + sum_k weight[:, k] * taps[k]): taps are width tensors (batch, dim, seqlen), tap
    k holding for each token the input width - 1 - k steps before it."""
    out = None
    for k, tap in enumerate(taps):
        term = tap * weight[:, k : k + 1]
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias[:, None]
    return out if activation is None else F.silu(out)


def _shifted(x_hist: Tensor, width: int):
    """The width taps of x_hist (batch, dim, width - 1 + seqlen): slices (batch, dim, seqlen)."""
    seqlen = x_hist.shape[-1] - width + 1
    return (x_hist[..., k : k + seqlen] for k in range(width))


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
        return _sum_of_taps(_shifted(x_hist, weight.shape[1]), weight, bias, activation)
    # eager: one library conv (cuDNN / oneDNN) beats width separate passes
    out = F.conv1d(x_hist, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return out if activation is None else F.silu(out)


def _conv_within_sequences(
    x_hist: Tensor, seq_hist: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> Tensor:
    """_depthwise_conv where a tap reading an input of another sequence reads zero instead.

    seq_hist: (batch, width - 1 + seqlen), the sequence index of each input of x_hist.
    """
    width = weight.shape[1]
    seq_now = seq_hist[:, None, width - 1 :]  # (batch, 1, seqlen): each token's sequence
    seq_taps = _shifted(seq_hist[:, None], width)
    taps = (
        torch.where(seq == seq_now, x, 0)  # where, not a product: keeps inf/NaN of others out
        for seq, x in zip(seq_taps, _shifted(x_hist.to(weight.dtype), width), strict=True)
    )
    return _sum_of_taps(taps, weight, bias, activation)


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

    x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); seq_idx: (batch, seqlen)
    int32/int64, the sequence of each token when several are packed along seqlen: a token only
    sees earlier inputs with its own seq_idx (the others read as zero); initial_states:
    (batch, dim, width - 1), the inputs before x (zeros when None); activation None, "silu" or
    "swish". Returns out (batch, dim, seqlen) in x's dtype, and with return_final_states also
    the last width - 1 inputs (batch, dim, width - 1), written into final_states_out when given
    (that shape, x's dtype and device).
    Differentiable in x, weight, bias and initial_states.

    As in the causal-conv1d package, seq_idx excludes initial and final states (a state does
    not say which sequence it belongs to): causal_conv1d_varlen_fn keeps one per sequence.
    """
    fn = "causal_conv1d_fn"
    _check_conv_inputs(fn, x, weight, bias, activation)
    check_flag(fn, "return_final_states", return_final_states)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    if return_final_states and final_states_out is not None:
        check_tensor("final_states_out", final_states_out, (3,), (x.dtype,), x.device, "x", fn)
        check_shape(fn, "final_states_out", final_states_out, (batch, dim, width - 1),
                    "(batch, dim, width - 1)")  # fmt: skip
    if initial_states is None:
        x_hist = F.pad(x, (width - 1, 0))
    else:
        check_tensor("initial_states", initial_states, (3,), device=x.device, ref="x", fn=fn)
        check_shape(
            fn, "initial_states", initial_states, (batch, dim, width - 1), "(batch, dim, width - 1)"
        )
        x_hist = torch.cat([initial_states.to(x.dtype), x], dim=-1)
    if seq_idx is None:
        out = _depthwise_conv(x_hist, weight, bias, activation)
    else:
        _check_seq_idx(x, seq_idx, initial_states, return_final_states)
        # The zero padding before x reads as zero whichever sequence it is given.
        seq_hist = F.pad(seq_idx, (width - 1, 0))
        out = _conv_within_sequences(x_hist, seq_hist, weight, bias, activation)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final_states = x_hist[..., seqlen:]
    if final_states_out is not None:
        final_states_out.copy_(final_states)
        final_states = final_states_out
    return out, final_states


def _check_seq_idx(
    x: Tensor, seq_idx: Tensor, initial_states: Tensor | None, return_final_states: bool
) -> None:
    """seq_idx: (batch, seqlen) int32/int64, with neither initial nor final states."""
    fn = "causal_conv1d_fn"
    check_tensor("seq_idx", seq_idx, (2,), dtypes=_INDEX_DTYPES, device=x.device, ref="x",
                 fn=fn)  # fmt: skip
    check_shape(fn, "seq_idx", seq_idx, (x.shape[0], x.shape[2]), "(batch, seqlen)")
    if initial_states is not None or return_final_states:
        raise ValueError(
            f"{fn}: seq_idx cannot be combined with initial_states or return_final_states, as "
            "in the causal-conv1d package; for one state per packed sequence use "
            "causal_conv1d_varlen_fn"
        )


def _check_varlen_inputs(
    x, weight, bias, cu_seqlens, initial_states, return_final_states, activation
) -> None:
    """x: (1, dim, total_len); cu_seqlens: (num_seqs + 1,) int32/int64 with num_seqs >= 1;
    initial_states: (num_seqs, dim, state_len) with state_len >= width - 1; return_final_states a
    bool."""
    fn = "causal_conv1d_varlen_fn"
    _check_conv_inputs(fn, x, weight, bias, activation)
    check_flag(fn, "return_final_states", return_final_states)
    check_shape(fn, "x", x, (1, None, None), "(1, dim, total_len)")  # packed along seqlen
    check_tensor("cu_seqlens", cu_seqlens, (1,), dtypes=_INDEX_DTYPES, device=x.device,
                 ref="x", fn=fn)  # fmt: skip
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 1:
        raise ValueError(
            f"{fn}: cu_seqlens must have shape (num_seqs + 1,) with num_seqs >= 1, "
            f"got {tuple(cu_seqlens.shape)}"
        )
    if not torch.compiler.is_compiling() and cu_seqlens.device.type == "cpu":
        check_cu_seqlens_values(cu_seqlens, x.shape[-1])  # reading a CPU tensor is no sync
    if initial_states is not None:
        check_tensor("initial_states", initial_states, (3,), device=x.device, ref="x", fn=fn)
        labels = "(num_seqs, dim, state_len)"
        check_shape(fn, "initial_states", initial_states, (num_seqs, x.shape[1], None), labels)
        if initial_states.shape[-1] < weight.shape[1] - 1:
            raise ValueError(
                f"{fn}: initial_states must hold state_len >= width - 1 = {weight.shape[1] - 1} "
                f"inputs, got shape {tuple(initial_states.shape)}"
            )


def causal_conv1d_varlen_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    activation: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal depthwise conv1d of sequences packed along seqlen, each with its own history.

    x: (1, dim, total_len), sequence i being x[..., c_i : c_(i+1)] for cu_seqlens = (c_0 = 0,
    ..., c_num_seqs = total_len), int32/int64, non-decreasing; weight: (dim, width); bias:
    (dim,); initial_states: (num_seqs, dim, state_len) with state_len >= width - 1, the inputs
    before each sequence, oldest first (zeros when None, state_len = width - 1).

    Equal to running each sequence as its own batch row of causal_conv1d_fn from the last
    width - 1 columns of its initial states. Returns out (1, dim, total_len) in x's dtype, and
    with return_final_states also the last state_len inputs of each sequence (num_seqs, dim,
    state_len), taken from its initial states where the sequence is shorter: the conv_state
    that causal_conv1d_update continues from. Differentiable in x, weight, bias and
    initial_states. No host sync: cu_seqlens's values are only checked for eager CPU tensors.
    """
    _check_varlen_inputs(
        x, weight, bias, cu_seqlens, initial_states, return_final_states, activation
    )
    _, dim, seqlen = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    if initial_states is None:
        initial_states = x.new_zeros(num_seqs, dim, width - 1)
    state_len = initial_states.shape[-1]
    # Every input a tap can read, as columns: the histories one after another, then x.
    histories = initial_states.to(x.dtype).transpose(0, 1).reshape(dim, num_seqs * state_len)
    inputs = torch.cat([histories, x[0]], dim=-1)
    cu = cu_seqlens.long()

    def column(seq: Tensor, rel: Tensor) -> Tensor:
        """Column of inputs holding position rel of sequence seq (rel < 0: its history)."""
        in_x = num_seqs * state_len + cu[seq] + rel
        return torch.where(rel >= 0, in_x, (seq + 1) * state_len + rel)

    positions = torch.arange(seqlen, device=x.device)
    # bucketize counts the entries of cu_seqlens at or before each token: its sequence + 1.
    seq = torch.bucketize(positions, cu, right=True) - 1
    delays = torch.arange(width - 1, -1, -1, device=x.device)[:, None]  # tap k: width - 1 - k
    taps = inputs.to(weight.dtype)[:, column(seq, positions - cu[seq] - delays)]
    out = _sum_of_taps(taps.unbind(1), weight, bias, activation)[None].to(x.dtype)
    if not return_final_states:
        return out
    seqs = torch.arange(num_seqs, device=x.device)[:, None]
    rel = (cu[1:] - cu[:-1])[:, None] - state_len + torch.arange(state_len, device=x.device)
    final_states = inputs[:, column(seqs, rel)].transpose(0, 1)  # (num_seqs, dim, state_len)
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
    conv_state (num_rows, dim, state_len) that x's rows continue (continuous batching); each
    row named at most once; a row of x whose index is negative (padding) or not below num_rows
    leaves every row alone and gets out 0, as in selective_state_update.
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
    check_tensor("conv_state", conv_state, (3,), device=x.device, ref="x", fn=fn)
    if conv_state_indices is None:
        state = conv_state
        check_shape(fn, "conv_state", conv_state, (batch, dim, None), "(batch, dim, state_len)")
    else:
        check_tensor("conv_state_indices", conv_state_indices, (1,), dtypes=_INDEX_DTYPES,
                     device=x.device, ref="x", fn=fn)  # fmt: skip
        check_shape(fn, "conv_state_indices", conv_state_indices, (batch,), "(batch,)")
        check_shape(fn, "conv_state", conv_state, (None, dim, None), "(num_rows, dim, state_len)")
        # A row whose index is negative (padding) or not below num_rows reads row 0 and
        # writes nothing (see _write_rows); its out is 0, as selective_state_update's.
        kept = (conv_state_indices >= 0) & (conv_state_indices < conv_state.shape[0])
        rows = torch.where(kept, conv_state_indices, 0).long()
        state = conv_state.index_select(0, rows)
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
        _write_rows(conv_state, rows, kept, new_state)
        out = torch.where(kept[:, None, None], out, 0.0)
    out = out.to(x3.dtype)
    return out.squeeze(-1) if one_step else out


def _write_rows(pool: Tensor, rows: Tensor, kept: Tensor, new: Tensor) -> None:
    """pool[rows[b]] = new[b] for the rows kept, without reading kept on the host (no
    synchronization in a decode step). The others were sent to row 0: they write what row 0
    holds after the step, the new row of the kept row that names row 0 if one does, else its
    old content, so that every write to row 0 carries the same value, whatever their order."""
    names_0 = kept & (rows == 0)
    first = names_0.int().argmax().reshape(1)  # the kept row naming row 0, if one does
    # index_select, not new[first]: indexing by a 0-d tensor reads it on the host
    row_0 = torch.where(names_0.any(), new.index_select(0, first)[0], pool[0])
    pool.index_copy_(0, rows, torch.where(kept[:, None, None], new, row_0))
