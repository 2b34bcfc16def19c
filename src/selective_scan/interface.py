"""Public entry points of the selective scan, and the choice of backend."""

from __future__ import annotations

import os

from torch import Tensor

from . import ops
from ._checks import check_flag, check_no_forward_ad
from .kernels.launch import direct_call_ok, is_plain_eager

_BACKENDS = ("auto", "triton", "torch")


def use_triton(u: Tensor) -> bool:
    """Whether the Triton kernels run for inputs like ``u``.

    SELECTIVE_SCAN_BACKEND=auto (default) picks Triton for CUDA tensors when triton is
    installed; ``triton`` forces it (CPU tensors then need TRITON_INTERPRET=1, other devices
    raise an error); ``torch`` forces the chunked PyTorch implementation on every device.
    """
    backend = os.environ.get("SELECTIVE_SCAN_BACKEND", "auto")
    if backend not in _BACKENDS:
        raise ValueError(
            f"selective_scan: SELECTIVE_SCAN_BACKEND must be one of {_BACKENDS}, got {backend!r}"
        )
    if backend == "auto":
        return isinstance(u, Tensor) and u.is_cuda and ops.HAS_TRITON
    if backend == "torch" or not isinstance(u, Tensor) or u.is_cuda:
        return backend == "triton"  # a non-tensor fails the inputs' checks
    if u.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"selective_scan: SELECTIVE_SCAN_BACKEND=triton runs on CUDA tensors, or on CPU "
            f"tensors with TRITON_INTERPRET=1 set before triton is imported; got tensors on "
            f"{u.device}"
        )
    return True


def scan_ops(u: Tensor, A: Tensor | None = None):
    """(forward op, backward op) of the backend chosen for ``u``; the PyTorch ops for complex
    ``A`` on every device (the Triton ops are real-valued; the PyTorch ops run complex kernels
    of their own on the Triton backend, complex_scan.py)."""
    complex_a = isinstance(A, Tensor) and A.is_complex()
    if not complex_a and use_triton(u):
        return ops.triton_ops()
    return ops.scan_fwd, ops.scan_bwd


def _forward(inputs: tuple):
    """The forward op of the inputs' backend; in plain eager calls, what computes the same
    without the dispatcher's host time, which short scans wait on (design §1.5): the op's
    implementation where there is nothing to differentiate (``kernels.launch.direct_call_ok``),
    else an autograd.Function with the op's backward (``ops.EAGER_FUNCTIONS``)."""
    fwd, _ = scan_ops(inputs[0], inputs[2])
    if direct_call_ok(inputs):
        return ops.FORWARD_IMPLEMENTATIONS[fwd]
    if is_plain_eager(inputs):
        return ops.EAGER_FUNCTIONS[fwd].apply
    return fwd


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan (Mamba's S6 recurrence); drop-in for mamba_ssm's ``selective_scan_fn``.

    u, delta, z: (batch, dim, seqlen) float32/float16/bfloat16; A: (dim, dstate) float32;
    B, C: constant (dim, dstate), variable (batch, dstate, seqlen) or grouped
    (batch, groups, dstate, seqlen); D, delta_bias: (dim,) float32.

    delta <- softplus(delta + delta_bias) if delta_softplus;
    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t;  y_t = sum_n C_t h_t + D * u_t;
    out = y * silu(z). Arithmetic in float32 (float64 for float64 inputs).

    Complex A (complex64/complex128, as in mamba_ssm): constant B/C complex (dim, dstate),
    variable B/C real with real and imaginary parts interleaved along time, (batch, [groups,]
    dstate, 2 * seqlen); y = 2 Re(sum_n C h) + D u; last_state complex. It runs on the PyTorch
    ops on every device, which on the Triton backend launch complex kernels (not with
    cu_seqlens).

    Returns out (batch, dim, seqlen) in u's dtype, and with return_last_state also
    last_state (batch, dim, dstate) float32, whose gradient is propagated when used.

    Beyond mamba_ssm: ``initial_state`` (batch, dim, dstate) starts the scan from a given,
    differentiable state; ``cu_seqlens`` (num_seqs + 1,) int32/int64 marks packed sequences
    along seqlen (batch must be 1): the state restarts at each boundary (from
    ``initial_state[i]`` of shape (num_seqs, dim, dstate) when given) and last_state is
    (num_seqs, dim, dstate).
    """
    check_flag("selective_scan_fn", "delta_softplus", delta_softplus)
    check_flag("selective_scan_fn", "return_last_state", return_last_state)
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    check_no_forward_ad("selective_scan_fn", inputs)
    out, last_state, _ = _forward(inputs)(*inputs, delta_softplus)
    return (out, last_state) if return_last_state else out
