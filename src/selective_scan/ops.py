"""The ``selective_scan`` operators: schemas, fake implementations and autograd.

Two families with identical schemas:

* ``selective_scan::scan_fwd`` / ``scan_bwd``: the chunked PyTorch implementation (cpu.py). A
  ``custom_op``, opaque to the compiler; it runs on any device and is the CPU path.
* ``selective_scan::scan_fwd_triton`` / ``scan_bwd_triton``: the Triton kernels (kernels/). The
  forward is a ``triton_op``, so Inductor and AOTInductor compile its kernels into their
  generated code; the backward a ``custom_op``, whose compiled calls run the eager launches
  (design §1.1). Registered only where triton imports.

Forward: (u, delta, A, B, C, D?, z?, delta_bias?, initial_state?, cu_seqlens?, delta_softplus)
-> (out, last_state, checkpoints). Backward: (dout, dlast_state?, <the forward's tensor inputs>,
checkpoints, delta_softplus) -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state),
where the gradient of an absent optional input is an empty tensor (schemas have fixed arity).

Every output is freshly allocated and contiguous, in the kernels and in the fakes alike, so fake
and real tensors agree on shape, strides and dtype for every option and length. The forward
returns the per-chunk state checkpoints the backward needs; ``selective_scan_fn`` drops them.
"""

from __future__ import annotations

import torch

from . import cpu
from ._checks import (
    check_scan_grads,
    check_scan_inputs,
    checkpoint_slots,
    compute_dtype,
    state_dtype,
)
from .kernels.launch import direct_call_ok
from .scan_args import ScanArgs

try:  # the Triton family's tile policy (kernels/tiles.py)
    from .kernels.tiles import current_policy, run_with_policy
except ImportError:  # no triton: no policy
    current_policy = run_with_policy = None


def fwd_fake(chunk: int):
    """Fake forward for a backend whose checkpoint interval is ``chunk`` steps."""

    def fake(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, delta_softplus):
        args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
        check_scan_inputs(args)
        sdt = state_dtype(A, compute_dtype(*args.floats))
        batch, dim, seqlen = u.shape
        dstate = A.shape[1]
        return (
            u.new_empty(u.shape),
            u.new_empty((args.num_states, dim, dstate), dtype=sdt),
            u.new_empty((batch, dim, checkpoint_slots(seqlen, chunk), dstate), dtype=sdt),
        )

    return fake


def bwd_fake(chunk: int):
    """Fake backward for a backend whose forward checkpoints the state every ``chunk`` steps."""

    def fake(
        dout, dlast_state, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens,
        checkpoints, delta_softplus,
    ):  # fmt: skip
        args = ScanArgs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
        check_scan_inputs(args)
        sdt = state_dtype(A, compute_dtype(*args.floats))
        check_scan_grads(dout, dlast_state, checkpoints, args, chunk, sdt)
        return tuple(u.new_empty((0,)) if t is None else t.new_empty(t.shape) for t in args.floats)

    return fake


def forward_policy():
    """The tile policy in force for a forward (None without triton), which its backward takes
    again (run_backward): ``use_policy`` holds on its own thread only, and autograd runs a CUDA
    backward on a thread of its own, where the default policy would apply."""
    return None if current_policy is None else current_policy()


def _setup_context(ctx, inputs, output) -> None:
    *tensors, delta_softplus = inputs
    ctx.save_for_backward(*tensors, output[2])
    ctx.delta_softplus = delta_softplus
    ctx.policy = forward_policy()
    ctx.set_materialize_grads(False)


def run_backward(bwd_op, args: tuple, delta_softplus: bool, policy) -> tuple:
    """bwd_op(*args, delta_softplus) under the forward's tile policy (forward_policy), args its
    tensor arguments; its implementation (BACKWARD_IMPLEMENTATIONS) is called instead where that
    is the same (``kernels.launch.direct_call_ok``: an eager backward, nothing traced, no double
    backward), which skips the dispatcher's host time (design §1.5)."""
    run = BACKWARD_IMPLEMENTATIONS[bwd_op] if direct_call_ok(args) else bwd_op
    if policy is None:
        return run(*args, delta_softplus)
    return run_with_policy(policy, run, *args, delta_softplus)


def _make_backward(bwd_op):
    """The autograd backward of a forward op: ``bwd_op`` through ``run_backward``."""

    def backward(ctx, dout, dlast_state, _dcheckpoints):
        *inputs, checkpoints = ctx.saved_tensors
        u = inputs[0]
        if dout is None:
            dout = torch.zeros_like(u)
        grads = run_backward(bwd_op, (dout, dlast_state, *inputs, checkpoints),
                             ctx.delta_softplus, ctx.policy)  # fmt: skip
        # Optional inputs that were None get None; cu_seqlens and delta_softplus get no gradient.
        grads = [None if t is None else g for g, t in zip(grads, inputs, strict=False)]
        return (*grads, None, None)

    return backward


def _eager_function(fwd_impl, bwd_op) -> type[torch.autograd.Function]:
    """An autograd.Function running a forward op's implementation and the op's own backward
    (``_make_backward``), for plain eager calls that record autograd
    (``kernels.launch.is_plain_eager``). It is the op's registered autograd without the
    dispatcher's and torch.library's per-call host work around it (design §1.5): a round trip
    through the dispatcher, the autograd wrapper's schema walks and a redispatch. Its forward
    takes ctx itself: with a separate setup_context, Function.apply binds the arguments to
    forward's signature through inspect on every call."""

    def forward(ctx, *inputs):
        output = fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    return type(
        "EagerSelectiveScan",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(_make_backward(bwd_op))},
    )


scan_fwd = torch.library.custom_op("selective_scan::scan_fwd", cpu.scan_fwd, mutates_args=())
scan_bwd = torch.library.custom_op("selective_scan::scan_bwd", cpu.scan_bwd, mutates_args=())
scan_fwd.register_fake(fwd_fake(cpu.CHUNK))
scan_bwd.register_fake(bwd_fake(cpu.CHUNK))
scan_fwd.register_autograd(_make_backward(scan_bwd), setup_context=_setup_context)
# What eager calls that may skip the dispatcher run instead of each op (interface's
# selective_scan_fn, the autograd backward): the op's own function, except the Triton backward's
# scan_bwd_autograd, which leaves out the checks that autograd has made.
FORWARD_IMPLEMENTATIONS = {scan_fwd: cpu.scan_fwd}
BACKWARD_IMPLEMENTATIONS = {scan_bwd: cpu.scan_bwd}
# The autograd.Function each forward op's plain eager calls with gradients run instead.
EAGER_FUNCTIONS = {scan_fwd: _eager_function(cpu.scan_fwd, scan_bwd)}


def _register_triton():
    """Register the Triton family; returns (fwd, bwd) or None where triton is missing."""
    try:
        from .kernels import scan as triton_scan
    except ImportError:
        return None
    fwd = torch.library.triton_op(
        "selective_scan::scan_fwd_triton", triton_scan.scan_fwd, mutates_args=()
    )
    # The backward is opaque to the compiler (design §1.1): compiled training runs its eager
    # launches, which take a register cap and replay that Inductor's launches do not.
    bwd = torch.library.custom_op(
        "selective_scan::scan_bwd_triton", triton_scan.scan_bwd, mutates_args=()
    )
    bwd.register_fake(bwd_fake(triton_scan.CKPT))
    fwd.register_autograd(_make_backward(bwd), setup_context=_setup_context)
    FORWARD_IMPLEMENTATIONS[fwd] = triton_scan.scan_fwd
    BACKWARD_IMPLEMENTATIONS[bwd] = triton_scan.scan_bwd_autograd
    EAGER_FUNCTIONS[fwd] = _eager_function(triton_scan.scan_fwd, bwd)
    return fwd, bwd


_triton_ops = _register_triton()
HAS_TRITON = _triton_ops is not None


def triton_ops() -> tuple:
    """(scan_fwd_triton, scan_bwd_triton); raises where triton is not installed."""
    if _triton_ops is None:
        raise RuntimeError(
            "selective_scan: the triton backend needs the 'triton' package (it ships with CUDA "
            "builds of torch); install it or set SELECTIVE_SCAN_BACKEND=torch"
        )
    return _triton_ops
