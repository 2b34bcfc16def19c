"""mamba_inner_fn: the whole inner path of a Mamba layer from xz to the output projection.

Built from differentiable PyTorch ops and ``selective_scan_fn``, so autograd, ``torch.compile``
and ``torch.export`` see ordinary nodes and the scan's own custom op, and no graph break.

Memory-saving backward (checkpoint_lvl=1), as in mamba_ssm: the conv output and delta are not
kept for the backward but recomputed there. This is selective activation checkpointing
(``torch.utils.checkpoint`` with a policy) around conv -> x_proj -> delta_proj -> scan: every op
of that region is recomputed in the backward except the scan's forward op, whose outputs (out,
last_state and the per-chunk state checkpoints) are kept, so the scan itself never runs twice.
Eager autograd, torch.compile (the partitioner honours the policy) and torch.export (which
traces the region's ops) all handle it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._checks import (
    _COMPLEX_DTYPES,
    _FLOAT_DTYPES,
    check_flag,
    check_no_forward_ad,
    check_non_empty,
    check_shape,
    check_tensor,
)
from .conv import causal_conv1d_fn
from .interface import scan_ops, selective_scan_fn
from .kernels.launch import is_plain_eager
from .ops import FORWARD_IMPLEMENTATIONS, forward_policy, run_backward


def _keep_scan_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what the scan's forward op returns (either backend's op lives in the selective_scan
    namespace); recompute everything else of the region in the backward."""
    if getattr(op, "namespace", None) == "selective_scan":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_RECOMPUTE_ALL_BUT_SCAN = functools.partial(
    create_selective_checkpoint_contexts, _keep_scan_outputs
)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension in float32 (float64 for float64 x), returned in x's
    dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * weight.to(wide)).to(x.dtype)


def _bc_columns(A: Tensor) -> int:
    """x_proj's columns for a variable B or C: dstate, or 2 * dstate for complex A (a state's
    real and imaginary parts side by side, as mamba_ssm lays them out)."""
    return A.shape[-1] * (2 if A.is_complex() else 1)


def _time_major(t: Tensor, A: Tensor) -> Tensor:
    """A variable B or C from x_proj, (batch, seqlen, columns), as the scan takes it: (batch,
    dstate, seqlen), or for complex A (batch, dstate, 2 * seqlen) with the parts interleaved
    along time (mamba_ssm's "(dstate two) -> dstate (l two)")."""
    if not A.is_complex():
        return t.transpose(1, 2)
    batch, seqlen, _ = t.shape
    return t.unflatten(-1, (-1, 2)).permute(0, 2, 1, 3).reshape(batch, -1, 2 * seqlen)


class _Region(NamedTuple):
    """The checkpointed region's arguments: x (batch, dim, seqlen) before the conv, z, the
    weights, the scan's other inputs and options."""

    x: Tensor
    z: Tensor | None
    conv_weight: Tensor
    conv_bias: Tensor | None
    x_proj_weight: Tensor
    delta_proj_weight: Tensor
    A: Tensor
    B: Tensor | None
    C: Tensor | None
    D: Tensor | None
    delta_bias: Tensor | None
    B_proj_bias: Tensor | None
    C_proj_bias: Tensor | None
    b_rms_weight: Tensor | None
    c_rms_weight: Tensor | None
    dt_rms_weight: Tensor | None
    eps: float
    delta_softplus: bool


def _scan_inputs(r: _Region) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The region's ops before the scan: (u, delta, B, C) as the scan takes them, u the conv's
    output (batch, dim, seqlen), delta (batch, dim, seqlen), B and C given or from x_proj."""
    A, eps, B, C = r.A, r.eps, r.B, r.C
    dstate = _bc_columns(A)
    delta_rank = r.delta_proj_weight.shape[1]
    x = causal_conv1d_fn(r.x, r.conv_weight, r.conv_bias, activation="silu")
    # Per-token projections in (batch, seqlen, features) layout; the transposes back to
    # (batch, features, seqlen) are views, and the scan accepts any strides.
    x_dbl = F.linear(x.transpose(1, 2), r.x_proj_weight)  # (batch, seqlen, rank + 2 * dstate)
    delta = F.linear(x_dbl[..., :delta_rank], r.delta_proj_weight)  # (batch, seqlen, dim)
    if r.dt_rms_weight is not None:
        delta = _rms_norm(delta, r.dt_rms_weight, eps)
    if B is None:  # variable B from x_proj, as mamba_ssm lays it out: after the rank columns
        B = x_dbl[..., delta_rank : delta_rank + dstate]
        if r.B_proj_bias is not None:
            B = B + r.B_proj_bias.to(B.dtype)
        if r.b_rms_weight is not None:
            B = _rms_norm(B, r.b_rms_weight, eps)
        B = _time_major(B, A)
    if C is None:  # variable C: the last dstate columns
        C = x_dbl[..., x_dbl.shape[-1] - dstate :]
        if r.C_proj_bias is not None:
            C = C + r.C_proj_bias.to(C.dtype)
        if r.c_rms_weight is not None:
            C = _rms_norm(C, r.c_rms_weight, eps)
        C = _time_major(C, A)
    return x, delta.transpose(1, 2), B, C


def _conv_and_scan(*args) -> Tensor:
    """The checkpointed region (``_Region``'s arguments): conv, projections and the scan;
    returns y (batch, dim, seqlen)."""
    r = _Region(*args)
    u, delta, B, C = _scan_inputs(r)
    return selective_scan_fn(u, delta, r.A, B, C, r.D, r.z, r.delta_bias,
                             delta_softplus=r.delta_softplus)  # fmt: skip


class _EagerRegion(torch.autograd.Function):
    """checkpoint_lvl=1 in plain eager calls: what the selective checkpoint computes, without
    the dispatch mode it puts on every op of the region, twice, which makes an eager layer's
    training step host-bound (design §1.6). The forward runs the region without grad and keeps
    its inputs and the scan's checkpoints; the backward reruns the ops before the scan with
    grad (under the forward's autocast state), runs the scan's backward (ops.run_backward),
    and backpropagates through the rerun ops into the region's inputs. The scan's forward runs
    once."""

    @staticmethod
    def forward(ctx, *args):
        r = _Region(*args)
        device = r.x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device),
                        torch.is_autocast_enabled(device))  # fmt: skip
        u, delta, B, C = _scan_inputs(r)
        fwd, ctx.bwd_op = scan_ops(u, r.A)
        out, _, checkpoints = FORWARD_IMPLEMENTATIONS[fwd](
            u, delta, r.A, B, C, r.D, r.z, r.delta_bias, None, None, r.delta_softplus
        )
        ctx.save_for_backward(*args[:-2], checkpoints)
        ctx.options = args[-2:]
        ctx.policy = forward_policy()
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        *saved, checkpoints = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in saved]
        r = _Region(*leaves, *ctx.options)
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            u, delta, B, C = _scan_inputs(r)
        args = (dout, None, u, delta, r.A, B, C, r.D, r.z, r.delta_bias, None, None, checkpoints)
        du, ddelta, dA, dB, dC, dD, dz, dbias, _ = run_backward(ctx.bwd_op, args, r.delta_softplus,
                                                                ctx.policy)  # fmt: skip
        rerun = [(t, g) for t, g in ((u, du), (delta, ddelta), (B, dB), (C, dC))
                 if t.requires_grad]  # fmt: skip
        if rerun:  # into the leaves that the rerun ops (or a given B, C) came from
            outputs, output_grads = zip(*rerun, strict=True)
            torch.autograd.backward(outputs, output_grads)
        # The scan's own inputs that no rerun op reads (A only lends its shape to them).
        scan_grads = {"A": dA, "D": dD, "z": dz, "delta_bias": dbias}
        grads = [
            None if t is None or not t.requires_grad else scan_grads.get(name, t.grad)
            for name, t in zip(_Region._fields, leaves, strict=False)
        ]
        return (*grads, None, None)


def _check_inner_inputs(
    xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
    out_proj_bias, A, B, C, B_proj_bias, C_proj_bias, rms_weights, delta_softplus, checkpoint_lvl,
):  # fmt: skip
    """What the later ops would reject with less clear messages, or not at all (a projection
    with too many rows, a broadcast bias); the scan checks B, C, D and delta_bias."""
    fn = "mamba_inner_fn"
    check_tensor("xz", xz, (3,), fn=fn)
    d_inner = xz.shape[1] // 2
    check_shape(fn, "xz", xz, (None, 2 * d_inner, None), "(batch, 2 * d_inner, seqlen)")
    check_non_empty(fn, "xz", xz, "(batch, 2 * d_inner, seqlen)")
    device = xz.device
    check_tensor("A", A, (2,), dtypes=_FLOAT_DTYPES + _COMPLEX_DTYPES, device=device, ref="xz",
                 fn=fn)  # fmt: skip
    dstate = _bc_columns(A)
    check_tensor("delta_proj_weight", delta_proj_weight, (2,), device=device, ref="xz", fn=fn)
    rank = delta_proj_weight.shape[1]
    check_shape(fn, "delta_proj_weight", delta_proj_weight, (d_inner, None), "(d_inner, rank)")
    rows = rank + (dstate if B is None else 0) + (dstate if C is None else 0)
    b_rms, c_rms, dt_rms = rms_weights
    for name, given, weight in (("B", B, b_rms), ("C", C, c_rms)):
        if given is not None and weight is not None:
            raise ValueError(
                f"{fn}: {name.lower()}_rms_weight normalizes the {name} computed from "
                f"x_proj; it needs {name}=None"
            )
    weights = (
        ("conv1d_weight", conv1d_weight, (d_inner, 1, None), "(d_inner, 1, width)"),
        ("conv1d_bias", conv1d_bias, (d_inner,), "(d_inner,)"),
        ("x_proj_weight", x_proj_weight, (rows, d_inner),
         "(rank + dstate [B from x_proj] + dstate [C from x_proj], d_inner), rank from "
         "delta_proj_weight's columns, dstate from A's (doubled for complex A)"),
        ("out_proj_weight", out_proj_weight, (None, d_inner), "(d_model, d_inner)"),
        ("B_proj_bias", B_proj_bias, (dstate,), "(dstate,)"),
        ("C_proj_bias", C_proj_bias, (dstate,), "(dstate,)"),
        ("b_rms_weight", b_rms, (dstate,), "(dstate,)"),
        ("c_rms_weight", c_rms, (dstate,), "(dstate,)"),
        ("dt_rms_weight", dt_rms, (d_inner,), "(d_inner,)"),
    )  # fmt: skip
    required = ("conv1d_weight", "x_proj_weight", "out_proj_weight")
    for name, t, expected, labels in weights:
        if t is not None or name in required:
            check_tensor(name, t, (len(expected),), device=device, ref="xz", fn=fn)
            check_shape(fn, name, t, expected, labels)
    if out_proj_bias is not None:
        check_tensor("out_proj_bias", out_proj_bias, (1,), device=device, ref="xz", fn=fn)
        check_shape(fn, "out_proj_bias", out_proj_bias, (out_proj_weight.shape[0],), "(d_model,)")
    if not torch.is_autocast_enabled(device.type):  # autocast casts the convolution and linears
        for name, t in (
            ("conv1d_weight", conv1d_weight), ("conv1d_bias", conv1d_bias),
            ("x_proj_weight", x_proj_weight), ("delta_proj_weight", delta_proj_weight),
            ("out_proj_weight", out_proj_weight), ("out_proj_bias", out_proj_bias),
        ):  # fmt: skip
            if t is not None and t.dtype != xz.dtype:
                raise TypeError(
                    f"{fn}: {name} must have xz's dtype {xz.dtype} outside autocast, got {t.dtype}"
                )
    check_flag(fn, "delta_softplus", delta_softplus)
    if type(checkpoint_lvl) is not int or checkpoint_lvl not in (0, 1):
        raise ValueError(f"{fn}: checkpoint_lvl must be 0 or 1, got {checkpoint_lvl!r}")


def mamba_inner_fn(
    xz: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    x_proj_weight: Tensor,
    delta_proj_weight: Tensor,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    A: Tensor,
    B: Tensor | None = None,
    C: Tensor | None = None,
    D: Tensor | None = None,
    delta_bias: Tensor | None = None,
    B_proj_bias: Tensor | None = None,
    C_proj_bias: Tensor | None = None,
    delta_softplus: bool = True,
    checkpoint_lvl: int = 1,
    b_rms_weight: Tensor | None = None,
    c_rms_weight: Tensor | None = None,
    dt_rms_weight: Tensor | None = None,
    b_c_dt_rms_eps: float = 1e-6,
) -> Tensor:
    """Mamba's inner path; drop-in for mamba_ssm's ``mamba_inner_fn``.

    xz: (batch, 2 * d_inner, seqlen), the input projection (x, then the gate z);
    conv1d_weight: (d_inner, 1, width), conv1d_bias: (d_inner,); x_proj_weight:
    (rank + dstate [if B is None] + dstate [if C is None], d_inner); delta_proj_weight:
    (d_inner, rank); out_proj_weight: (d_model, d_inner), out_proj_bias: (d_model,);
    A: (d_inner, dstate); B, C: None for input-dependent B/C taken from the x_proj output
    (plus B_proj_bias / C_proj_bias (dstate,)), or any form ``selective_scan_fn`` accepts;
    D, delta_bias: (d_inner,); b_rms_weight, c_rms_weight: (dstate,), dt_rms_weight:
    (d_inner,): RMSNorm of B, C and delta (before delta_bias) with eps b_c_dt_rms_eps.

    x <- silu(causal_conv1d(x)); (dt, B, C) <- x_proj(x); delta <- delta_proj(dt);
    y <- selective_scan(x, delta, A, B, C, D, z, delta_bias, delta_softplus);
    returns out_proj(y): (batch, seqlen, d_model).

    checkpoint_lvl=1 recomputes the conv output and delta in the backward instead of keeping
    them (the scan is not rerun); 0 keeps them. Gradients are the same either way.
    """
    rms_weights = (b_rms_weight, c_rms_weight, dt_rms_weight)
    _check_inner_inputs(
        xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
        out_proj_bias, A, B, C, B_proj_bias, C_proj_bias, rms_weights, delta_softplus,
        checkpoint_lvl,
    )  # fmt: skip
    x, z = xz.chunk(2, dim=1)
    args = (
        x, z, conv1d_weight[:, 0], conv1d_bias, x_proj_weight, delta_proj_weight, A, B, C, D,
        delta_bias, B_proj_bias, C_proj_bias, *rms_weights, b_c_dt_rms_eps, delta_softplus,
    )  # fmt: skip
    check_no_forward_ad("mamba_inner_fn", args[:-2])  # out_proj's tangents are torch's own
    # Without grad mode nothing is saved, so there is nothing to recompute.
    if checkpoint_lvl == 1 and torch.is_grad_enabled():
        if is_plain_eager(args[:-2]):
            y = _EagerRegion.apply(*args)
        else:
            y = checkpoint(
                _conv_and_scan, *args, use_reentrant=False, context_fn=_RECOMPUTE_ALL_BUT_SCAN
            )
    else:
        y = _conv_and_scan(*args)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)
