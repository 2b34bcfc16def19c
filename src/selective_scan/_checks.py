"""Input validation shared by every public function and every operator implementation.

Checks that only look at ranks, dtypes and devices raise plain Python errors. Checks on sizes go
through ``torch._check_with`` so that, under ``torch.compile``/``torch.export`` with symbolic
sizes, they become runtime assertions instead of specializing the graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd import forward_ad

if TYPE_CHECKING:
    from .scan_args import ScanArgs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _format_shape(expected: tuple) -> str:
    """(8, None, 4) -> '(8, *, 4)'; (8,) -> '(8,)'."""
    sizes = ["*" if w is None else str(w) for w in expected]
    return f"({', '.join(sizes)}{',' if len(sizes) == 1 else ''})"


def check_size(cond, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless cond; symbolic conditions become runtime asserts.

    Plain bools (eager calls) skip torch._check_with, whose overhead adds up over the ~20
    checks of a call."""
    if cond is True:
        return
    if cond is False:
        raise ValueError(message())
    torch._check_with(ValueError, cond, message)


def check_tensor(
    name: str,
    t: object,
    ranks: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...] = _FLOAT_DTYPES,
    device: torch.device | None = None,
    ref: str = "u",
    fn: str = "selective_scan",
) -> None:
    """Check that ``t`` is a Tensor of one of ``ranks`` and ``dtypes`` on ``device``, the
    device of the argument named ``ref``; ``fn`` names the public function in the messages."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"{fn}: {name} must have {want} dimensions, got {t.dim()} (shape {_shape(t)})"
        )
    if t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{fn}: {name} must have dtype in ({want}), got {str(t.dtype).replace('torch.', '')}"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{fn}: {name} is on {t.device} but {ref} is on {device}; "
            "all tensors must be on the same device"
        )


def check_no_forward_ad(fn: str, tensors) -> None:
    """Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not supported: raise where
    an input carries a tangent, which the kernels would drop (torch.func.jvp would return a zero
    derivative). One read of a global unless a dual level is open."""
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level (or, unknown: check)
        return
    for t in tensors:
        if isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{fn}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not "
                "supported; use reverse mode (.backward(), torch.autograd.grad)"
            )


def check_flag(fn: str, name: str, value: object) -> None:
    """A flag must be a bool: a string, None or a tensor would be taken by its truth value."""
    if type(value) is not bool:
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}")


def check_dims(
    name: str, t: Tensor, expected: tuple, labels: str, fn: str = "selective_scan"
) -> None:
    """Check t.shape == expected one dimension at a time (None matches any size); ``fn`` names
    the public function in the message.

    One check per dimension keeps symbolic sizes symbolic (no Python ``and`` forces a guard),
    and the message is only formatted when a check fails.
    """
    for actual, want in zip(t.shape, expected, strict=True):
        if want is not None:
            check_size(
                actual == want,
                lambda: (
                    f"{fn}: {name} must have shape {labels} = {_format_shape(expected)}, "
                    f"got {_shape(t)}"
                ),
            )


def _check_bc(name: str, t: Tensor, batch, dim, dstate, seqlen, device, complex_a) -> None:
    """B and C: constant (dim, dstate), variable (batch, dstate, seqlen) or grouped
    (batch, groups, dstate, seqlen) with groups dividing dim. With complex A, as in mamba_ssm:
    a constant one is complex, a variable one real with real and imaginary parts interleaved
    along time, (batch, [groups,] dstate, 2 * seqlen)."""
    constant_complex = complex_a and isinstance(t, Tensor) and t.dim() == 2
    dtypes = _COMPLEX_DTYPES if constant_complex else _FLOAT_DTYPES
    check_tensor(name, t, (2, 3, 4), dtypes=dtypes, device=device)
    steps, label = (2 * seqlen, "2 * seqlen") if complex_a else (seqlen, "seqlen")
    forms = {
        2: ((dim, dstate), "(dim, dstate)"),
        3: ((batch, dstate, steps), f"(batch, dstate, {label})"),
        4: ((batch, None, dstate, steps), f"(batch, groups, dstate, {label})"),
    }
    expected, labels = forms[t.dim()]
    check_dims(name, t, expected, labels)
    if t.dim() == 4:
        groups = t.shape[1]
        message = lambda: f"selective_scan: {name} has {groups} groups, which must divide dim={dim}"  # noqa: E731
        check_size(groups >= 1, message)
        check_size(dim % groups == 0, message)


def _dim_mismatch(u: Tensor, A: Tensor) -> str:
    """The message for u and A disagreeing on dim, naming u when it looks transposed."""
    message = (
        f"selective_scan: u (batch, dim, seqlen) and A (dim, dstate) must agree on dim, got u "
        f"of shape {_shape(u)} and A of shape {_shape(A)}"
    )
    if u.shape[2] == A.shape[0]:
        message += "; u looks like (batch, seqlen, dim): pass u.transpose(1, 2) (delta, z likewise)"
    return message


def check_scan_inputs(args: ScanArgs) -> None:
    """Validate the arguments of the selective scan; raise a clear error naming the argument.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate), real or complex; B, C: (dim, dstate),
    (batch, dstate, seqlen) or (batch, groups, dstate, seqlen) (complex A: see _check_bc);
    D, delta_bias: (dim,); initial_state: (batch, dim, dstate), complex with complex A, or
    (num_seqs, dim, dstate) with cu_seqlens: (num_seqs + 1,) int32/int64 (batch must be 1).
    """
    u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens = args.tensors
    check_tensor("u", u, (3,))
    device = u.device
    batch, dim, seqlen = u.shape
    for size in (batch, dim, seqlen):
        check_size(
            size >= 1,
            lambda: f"selective_scan: u must be non-empty (batch, dim, seqlen), got {_shape(u)}",
        )
    check_tensor("A", A, (2,), dtypes=_FLOAT_DTYPES + _COMPLEX_DTYPES, device=device)
    complex_a = A.is_complex()
    dstate = A.shape[1]
    check_size(A.shape[0] == dim, lambda: _dim_mismatch(u, A))
    check_tensor("delta", delta, (3,), device=device)
    check_dims("delta", delta, (batch, dim, seqlen), "(batch, dim, seqlen)")
    check_size(dstate >= 1, lambda: f"selective_scan: A must have dstate >= 1, got {_shape(A)}")
    _check_bc("B", B, batch, dim, dstate, seqlen, device, complex_a)
    _check_bc("C", C, batch, dim, dstate, seqlen, device, complex_a)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            check_tensor(name, t, (1,), device=device)
            check_dims(name, t, (dim,), "(dim,)")
    if z is not None:
        check_tensor("z", z, (3,), device=device)
        check_dims("z", z, (batch, dim, seqlen), "(batch, dim, seqlen)")
    num_states = batch
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, (1,), dtypes=_INDEX_DTYPES, device=device)
        check_size(
            batch == 1,
            lambda: (
                "selective_scan: with cu_seqlens the sequences are packed along seqlen and "
                f"batch must be 1, got u of shape {_shape(u)}"
            ),
        )
        check_size(
            cu_seqlens.shape[0] >= 2,
            lambda: (
                "selective_scan: cu_seqlens must have shape (num_seqs + 1,) with "
                f"num_seqs >= 1, got {_shape(cu_seqlens)}"
            ),
        )
        num_states = cu_seqlens.shape[0] - 1
        if complex_a:
            raise ValueError(
                "selective_scan: complex A with cu_seqlens (packed sequences) is not supported"
            )
    if initial_state is not None:
        state_dtypes = _COMPLEX_DTYPES if complex_a else _FLOAT_DTYPES
        check_tensor("initial_state", initial_state, (3,), dtypes=state_dtypes, device=device)
        labels = "(num_seqs, dim, dstate)" if cu_seqlens is not None else "(batch, dim, dstate)"
        check_dims("initial_state", initial_state, (num_states, dim, dstate), labels)


def check_scan_grads(
    dout: Tensor,
    dlast_state: Tensor | None,
    checkpoints: Tensor,
    args: ScanArgs,
    interval: int,
    cdt: torch.dtype,
) -> None:
    """The backward's own inputs, after check_scan_inputs of the forward's (args): dout like
    out, dlast_state like last_state, and checkpoints as the same backend's forward returned
    them (a state every ``interval`` steps, in the compute dtype ``cdt``)."""
    u = args.u
    device = u.device
    batch, dim, seqlen = u.shape
    dstate = args.A.shape[1]
    check_tensor("dout", dout, (3,), device=device)
    check_dims("dout", dout, (batch, dim, seqlen), "(batch, dim, seqlen)")
    if dlast_state is not None:
        state_dtypes = _COMPLEX_DTYPES if args.A.is_complex() else _FLOAT_DTYPES
        check_tensor("dlast_state", dlast_state, (3,), dtypes=state_dtypes, device=device)
        packed = args.cu_seqlens is not None
        labels = "(num_seqs, dim, dstate)" if packed else "(batch, dim, dstate)"
        check_dims("dlast_state", dlast_state, (args.num_states, dim, dstate), labels)
    check_tensor("checkpoints", checkpoints, (4,), dtypes=(cdt,), device=device)
    slots = checkpoint_slots(seqlen, interval)
    labels = "(batch, dim, slots, dstate), as the forward returned them"
    check_dims("checkpoints", checkpoints, (batch, dim, slots, dstate), labels)


def check_cu_seqlens_values(cu_seqlens: Tensor, seqlen: int) -> list[int]:
    """Read cu_seqlens to the host and check it is 0 = c0 <= c1 <= ... <= c_last = seqlen."""
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != seqlen:
        raise ValueError(
            f"selective_scan: cu_seqlens must start at 0 and end at seqlen={seqlen}, got "
            f"{values[0]} ... {values[-1]}"
        )
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError("selective_scan: cu_seqlens must be non-decreasing")
    return values


def checkpoint_slots(seqlen, interval: int):
    """Checkpoint slots for a sequence: one per ``interval`` steps, plus one spare slot so that
    the size is never 1 (a size-1 dimension makes torch.export and torch.compile specialize on
    seqlen). Works on SymInts."""
    return (seqlen + interval - 1) // interval + 1


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64 or complex128 (so gradcheck runs through the op), else
    float32. Complex states are in the complex dtype of this (state_dtype)."""
    wide = (torch.float64, torch.complex128)
    if any(t is not None and t.dtype in wide for t in tensors):
        return torch.float64
    return torch.float32


def state_dtype(A: Tensor, cdt: torch.dtype) -> torch.dtype:
    """The dtype of states (last_state, checkpoints): cdt, or its complex dtype for complex A."""
    if not A.is_complex():
        return cdt
    return torch.complex128 if cdt == torch.float64 else torch.complex64


def check_non_empty(fn: str, name: str, t: Tensor, labels: str) -> None:
    """Every dimension of t at least 1, with plain comparisons (see check_shape)."""
    if min(t.shape) < 1:
        raise ValueError(f"{fn}: {name} must be non-empty {labels}, got {_shape(t)}")


def check_shape(fn: str, name: str, t: Tensor, expected: tuple, labels: str) -> None:
    """Check t.shape == expected (None matches any size) with plain comparisons, for code that
    torch.compile traces (the model-level functions): there a symbolic comparison becomes a
    guard that the sizes are equal, whereas torch._check's message closure, which refers to
    t, cannot be traced. ``fn`` names the public function in the message."""
    for actual, want in zip(t.shape, expected, strict=True):
        if want is not None and actual != want:
            raise ValueError(
                f"{fn}: {name} must have shape {labels} = {_format_shape(expected)}, "
                f"got {_shape(t)}"
            )
