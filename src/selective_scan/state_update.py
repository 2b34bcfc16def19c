"""One decode step of the selective scan, ``selective_state_update``, updating the state in place.

Drop-in for mamba_ssm's ``selective_state_update`` (mamba_ssm/ops/triton/selective_state_update.py),
in both of its forms (plain Mamba-1 and multi-head Mamba-2 shapes, see _state_update_checks.py).

Two operators with one schema, each declaring that it writes into ``state``:

* ``selective_scan::state_update``: plain PyTorch (this file), a ``custom_op``; the CPU path and
  a fallback on any device.
* ``selective_scan::state_update_triton``: the Triton kernel (kernels/state_update.py), a
  ``triton_op``, so Inductor and AOTInductor compile the kernel into their generated code.

The public function picks one as ``selective_scan_fn`` does (``interface.use_triton``,
SELECTIVE_SCAN_BACKEND). The step has no autograd formula: it is an inference step (PyTorch
allows none on an operator that mutates its inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_flag, check_no_forward_ad
from ._state_update_checks import as_heads, check_state_update_inputs, out_shape
from .interface import use_triton
from .kernels.launch import direct_call_ok


def _state_update_torch(
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
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """The step in PyTorch, in float32 (float64 when an input is float64); see
    :func:`selective_state_update`."""
    *_, cdt = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    out = x.new_empty(out_shape(state, x))
    slots, x, dt, A, B, C, D, z, dt_bias = as_heads(state, x, dt, A, B, C, D, z, dt_bias)
    h, kept = slots, None
    if state_batch_indices is not None:  # the rows' slots; others (padding) are left alone
        kept = (state_batch_indices >= 0) & (state_batch_indices < slots.shape[0])
        h = slots[torch.where(kept, state_batch_indices, 0)]
    xc, dt = x.to(cdt), dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20, as in mamba_ssm

    def per_head(t: Tensor) -> Tensor:  # (batch, ngroups, dstate) -> (batch, nheads, 1, dstate)
        return t.to(cdt).repeat_interleave(h.shape[1] // t.shape[1], dim=1).unsqueeze(2)

    new = h.to(cdt) * torch.exp(dt.unsqueeze(-1) * A) + (dt * xc).unsqueeze(-1) * per_head(B)
    if kept is None:
        h.copy_(new)
    else:
        slots[state_batch_indices[kept]] = new[kept].to(slots.dtype)
    # The output reads the float32 state before it is rounded to state's dtype, as the kernels do.
    y = (new * per_head(C)).sum(-1)
    if D is not None:
        y = y + xc * D
    if z is not None:
        y = y * F.silu(z.to(cdt))
    if kept is not None:  # padding rows: out 0, as mamba_ssm
        y = torch.where(kept[:, None, None], y, 0.0)
    out.copy_(y.reshape(out.shape))
    return out


def _fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices=None):
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    return x.new_empty(out_shape(state, x))


state_update = torch.library.custom_op(
    "selective_scan::state_update", _state_update_torch, mutates_args=("state",)
)
state_update.register_fake(_fake)


def _register_triton():
    """(the Triton operator, its eager launcher), or (None, None) where triton is missing."""
    try:
        from .kernels import state_update as kernel
    except ImportError:
        return None, None
    op = torch.library.triton_op(
        "selective_scan::state_update_triton", kernel.state_update, mutates_args=("state",)
    )
    return op, kernel.state_update_eager


state_update_triton, _triton_eager = _register_triton()


def selective_state_update(
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
) -> Tensor:
    """One step of the selective scan from ``state``, which is updated in place.

    Plain form: state (batch, dim, dstate); x, dt, z (batch, dim); A (dim, dstate); B, C
    (batch, dstate); D, dt_bias (dim,). Multi-head form (as mamba_ssm): state (batch, nheads,
    dim, dstate); x, dt, z (batch, nheads, dim); A (nheads, dim, dstate); B, C (batch, ngroups,
    dstate) with ngroups dividing nheads; D, dt_bias (nheads, dim). Any float dtypes and strides.

    dt <- softplus(dt + dt_bias) if dt_softplus; state <- exp(A dt) * state + B dt x;
    out = sum_n(state * C) + D x, times silu(z). Arithmetic in float32 (float64 when an input is
    float64); the new state is stored in state's dtype and out is computed before that rounding.

    An argument may also take the other form than state's where the axis the plain form lacks
    has size 1 (nheads = 1, or B and C with one group), as in mamba_ssm.

    state_batch_indices (batch,), int32 or int64, as in mamba_ssm: the state's first axis holds
    slots (any number of them) and batch row b steps slot state_batch_indices[b]. A row whose
    index is negative (padding), or not below the number of slots, leaves every slot alone and
    gets out 0. Each slot must be named at most once (rows naming the same slot race).

    Returns out in x's dtype and the state's form: (batch, dim) or (batch, nheads, dim).

    A decode step is short, so the dispatcher's cost matters (about 100 us per call of an
    operator that mutates an input, measured on the 2-core development CPU): in plain eager
    mode the implementation is called directly, with the op's effect on state's version
    counter (and the Triton one reuses the launch plan of earlier calls of the same layout);
    under torch.compile, torch.export and any mode or transform, the op is called.
    """
    check_flag("selective_state_update", "dt_softplus", dt_softplus)
    grad = isinstance(state, Tensor) and state.requires_grad and torch.is_grad_enabled()
    if grad and state.is_leaf:
        raise RuntimeError(
            "selective_state_update: state is a leaf tensor that requires grad, and the step "
            "writes into it; pass state.detach(), or call it under torch.no_grad()"
        )
    args = (state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    check_no_forward_ad("selective_state_update", args[:9])
    op, implementation = _backend(state)
    if direct_call_ok((*args[:9], state_batch_indices)):
        out = implementation(*args)
        torch.autograd.graph.increment_version(state)
        return out
    return op(*args)


def _backend(state: Tensor) -> tuple:
    """(operator, its direct implementation) of the backend chosen for state (see
    ``interface.use_triton``)."""
    if not use_triton(state):
        return state_update, _state_update_torch
    if state_update_triton is None:
        raise RuntimeError(
            "selective_state_update: the triton backend needs the 'triton' package (it ships "
            "with CUDA builds of torch); install it or set SELECTIVE_SCAN_BACKEND=torch"
        )
    return state_update_triton, _triton_eager
