"""Input validation and shape normalization of the decode step (``selective_state_update``).

Two forms, chosen by the rank of ``state``, as in mamba_ssm:

* plain (Mamba-1): state (batch, dim, dstate); x, dt, z (batch, dim); A (dim, dstate);
  B, C (batch, dstate); D, dt_bias (dim,);
* heads (Mamba-2): state (batch, nheads, dim, dstate); x, dt, z (batch, nheads, dim);
  A (nheads, dim, dstate); B, C (batch, ngroups, dstate) with ngroups dividing nheads, or
  (batch, dstate) for one group; D, dt_bias (nheads, dim).

As in mamba_ssm, an argument may also come in the other form than the state where the axis the
plain form lacks has size 1: with nheads = 1, or B and C with one group. out takes the state's
form.

With ``state_batch_indices`` (batch,) (int32 or int64), as in mamba_ssm, the state holds slots
(its first axis, any number) and batch row b reads and writes slot state_batch_indices[b]; batch
is then x's first axis.

Both implementations work on the heads form: a plain argument lacks one axis of it (``_LIFT``),
which ``as_heads`` inserts as a view and ``heads_strides`` as a zero stride.

The step runs once per token, so the checks have a fast path: real tensors (sizes are ints)
compare whole shapes at once, and only a mismatch, or symbolic sizes under torch.compile and
torch.export, takes the per-dimension checks that name the argument and become runtime
assertions instead of guards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import _FLOAT_DTYPES, _INDEX_DTYPES, _shape, check_dims, check_size, check_tensor

# Argument order of the step: (state, x, dt, A, B, C, D, z, dt_bias).
_FN = "selective_state_update"  # in the messages
NAMES = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")
# (heads-form rank, axis a plain argument lacks) for each argument, in NAMES order.
_LIFT = ((4, 1), (3, 1), (3, 1), (3, 0), (3, 1), (3, 1), (2, 0), (3, 1), (2, 0))
# Shape labels for error messages, by argument and rank.
_LABELS = {
    "x": {2: "(batch, dim)", 3: "(batch, nheads, dim)"},
    "A": {2: "(dim, dstate)", 3: "(nheads, dim, dstate)"},
    "B": {2: "(batch, dstate)", 3: "(batch, ngroups, dstate)"},
    "D": {1: "(dim,)", 2: "(nheads, dim)"},
}
_SAME_AS = {"dt": "x", "z": "x", "C": "B", "dt_bias": "D"}
_FLOATS = frozenset(_FLOAT_DTYPES)


def _check(name: str, t: object, expected: tuple, heads: bool, device) -> None:
    """Careful check of one argument: a float Tensor on ``device`` with shape ``expected``."""
    labels = _LABELS[_SAME_AS.get(name, name)][len(expected)]
    if isinstance(t, Tensor) and t.dim() != len(expected):
        raise ValueError(
            f"selective_state_update: {name} must have shape {labels} for a state of "
            f"{4 if heads else 3} dimensions, got {_shape(t)}"
        )
    check_tensor(name, t, (len(expected),), device=device, ref="state", fn=_FN)
    check_dims(name, t, expected, labels, fn=_FN)


def _expected(t: object, shape: tuple, rank: int, axis: int, heads: bool) -> tuple:
    """The shape argument t must have, given its heads-form ``shape`` (rank ``rank``) and the
    axis its plain form lacks: the state's form, or, as in mamba_ssm, the other form where that
    axis has size 1 (nheads = 1, or B and C with one group)."""
    plain = shape[:axis] + shape[axis + 1 :]
    if isinstance(t, Tensor):
        if t.dim() == rank and not heads:  # a plain state has nheads = 1
            return shape
        if t.dim() == rank - 1 and heads and shape[axis] == 1:
            return plain
    return shape if heads else plain


def groups(t: Tensor):
    """Groups of B or C in the heads form: (batch, ngroups, dstate) has ngroups, (batch,
    dstate) one."""
    return t.shape[1] if t.dim() == 3 else 1


def check_state_update_inputs(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    state_batch_indices: Tensor | None = None,
) -> tuple:
    """Validate the decode step's arguments (either form, see the module docstring); raise a
    clear error naming the argument and the expected shape.

    Returns (batch, nheads, dim, dstate, ngroups, compute dtype), nheads = ngroups = 1 in the
    plain form; the compute dtype is float64 when an input is float64, else float32."""
    check_tensor("state", state, (3, 4), fn=_FN)
    heads = state.dim() == 4
    batch, nheads, dim, dstate = state.shape if heads else (state.shape[0], 1, *state.shape[1:])
    for size in (batch, nheads, dim, dstate):
        check_size(
            size >= 1,
            lambda: f"selective_state_update: state must be non-empty, got {_shape(state)}",
        )
    if state_batch_indices is not None:  # batch rows pick slots of the state
        check_tensor("state_batch_indices", state_batch_indices, (1,), _INDEX_DTYPES, state.device,
                     "state", fn=_FN)  # fmt: skip
        batch = state_batch_indices.shape[0]
        check_size(
            batch >= 1,
            lambda: (
                "selective_state_update: state_batch_indices must be non-empty, got "
                f"{_shape(state_batch_indices)}"
            ),
        )
        if isinstance(x, Tensor) and x.dim() >= 1:  # name the indices, not x, when they differ
            check_size(
                batch == x.shape[0],
                lambda: (
                    "selective_state_update: state_batch_indices must have one entry per batch "
                    f"row of x, shape ({x.shape[0]},), got {_shape(state_batch_indices)}"
                ),
            )

    def bc(t: object) -> tuple:
        return (batch, groups(t) if isinstance(t, Tensor) else 1, dstate)

    rows = (batch, nheads, dim)
    heads_shapes = (rows, rows, (nheads, dim, dstate), bc(B), bc(C), (nheads, dim), rows,
                    (nheads, dim))  # fmt: skip
    device = state.device
    real = type(state) is Tensor  # sizes are ints: whole shapes compare at once
    float64 = state.dtype == torch.float64
    args = (x, dt, A, B, C, D, z, dt_bias)
    for name, t, shape, lift in zip(NAMES[1:], args, heads_shapes, _LIFT[1:], strict=True):
        if t is None and name in ("D", "z", "dt_bias"):
            continue
        want = _expected(t, shape, *lift, heads)
        fast = real and isinstance(t, Tensor) and t.shape == want
        if not (fast and t.dtype in _FLOATS and t.device == device):
            _check(name, t, want, heads, device)
        float64 = float64 or t.dtype == torch.float64
    if real and any(n > 1 and s == 0 for n, s in zip(state.shape, state.stride(), strict=True)):
        raise ValueError(
            f"selective_state_update: state is written in place, so its elements must not share "
            f"memory; got a broadcast view (shape {_shape(state)}, strides {state.stride()})"
        )
    ngroups = groups(B)
    check_size(
        ngroups >= 1,
        lambda: f"selective_state_update: B must have at least one group, got {_shape(B)}",
    )
    check_size(
        nheads % ngroups == 0,
        lambda: (
            f"selective_state_update: B has {ngroups} groups, which must divide nheads={nheads}"
        ),
    )
    check_size(
        groups(C) == ngroups,
        lambda: (
            f"selective_state_update: B and C must have the same number of groups, got B of "
            f"shape {_shape(B)} and C of shape {_shape(C)}"
        ),
    )
    return batch, nheads, dim, dstate, ngroups, torch.float64 if float64 else torch.float32


def out_shape(state: Tensor, x: Tensor) -> tuple:
    """The step's output shape, in the state's form: (batch, dim) or (batch, nheads, dim), batch
    being x's (the state's too, but for slots picked by state_batch_indices)."""
    return (x.shape[0], *state.shape[1:-1])


def as_heads(*args: Tensor | None) -> tuple:
    """The (validated) arguments, in NAMES order, as heads-form views: state (batch, nheads,
    dim, dstate); x, dt, z (batch, nheads, dim); A (nheads, dim, dstate); B, C (batch, ngroups,
    dstate); D, dt_bias (nheads, dim). Writing into the returned state writes into the caller's.
    """
    return tuple(
        t if t is None or t.dim() == rank else t.unsqueeze(axis)
        for t, (rank, axis) in zip(args, _LIFT, strict=True)
    )


def heads_strides(*args: Tensor | None) -> tuple:
    """The strides of the (validated) arguments, in NAMES order, in their heads form, flattened
    into one tuple: the axis a plain argument lacks gets stride 0, an absent one all zeros."""
    strides = ()
    for t, (rank, axis) in zip(args, _LIFT):  # noqa: B905 (a per-token path: strict costs)
        if t is None:
            strides += (0,) * rank
        else:
            s = t.stride()
            strides += s if len(s) == rank else (*s[:axis], 0, *s[axis:])
    return strides
