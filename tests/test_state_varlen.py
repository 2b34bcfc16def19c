"""initial_state and cu_seqlens: a scan split in pieces, and packed sequences, against
separate calls and the float64 oracle, forward and every gradient."""

import itertools

import pytest
import torch
from helpers import (
    TOLERANCE,
    assert_close,
    float_inputs,
    gradcheck_scan,
    leaves,
    make_inputs,
    make_weights,
    oracle,
    run_scan,
    to_float64,
)

from selective_scan import selective_scan_fn, selective_scan_ref

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

# Forms of (B, C), each with a different pair, and whether an initial state is given.
CONFIGS = [
    pytest.param("grouped", "variable", True, id="Bgrouped-Cvariable-init"),
    pytest.param("constant", "grouped", False, id="Bconstant-Cgrouped"),
    pytest.param("variable", "constant", True, id="Bvariable-Cconstant-init"),
]
# The same float32 arithmetic, split differently: wrong state handling is an O(1) error.
TOL = TOLERANCE[torch.float32]


def time_slice(inputs: dict, start: int, end: int) -> dict:
    """The inputs restricted to steps [start, end) (views: gradients flow to the whole)."""
    timed = {"u", "delta", "z"} | {k for k in ("B", "C") if inputs[k].dim() > 2}
    return {k: v[..., start:end] if k in timed else v for k, v in inputs.items()}


def scan_in_pieces(fn, inputs: dict, bounds: list[int]) -> tuple[list, list]:
    """Scan steps [bounds[k], bounds[k+1]) one call at a time, each call starting from the
    previous call's last_state. Returns the pieces' outputs and last states."""
    outs, states = [], []
    state = inputs["initial_state"]
    for start, end in itertools.pairwise(bounds):
        piece = time_slice(inputs, start, end) | {"initial_state": state}
        out, state = fn(**piece, delta_softplus=True, return_last_state=True)
        outs.append(out)
        states.append(state)
    return outs, states


def pieces_loss(outs, states, bounds, weights) -> torch.Tensor:
    """sum(out * w_out) over the pieces, plus each piece's state times its own weights."""
    w_out, w_states = weights
    loss = sum(
        (out * w_out[..., s:e]).sum()
        for out, (s, e) in zip(outs, itertools.pairwise(bounds), strict=True)
    )
    return loss + sum((state * w).sum() for state, w in zip(states, w_states, strict=True))


# Piece boundaries on, just after and far from the chunk boundaries (64 and 128 steps).
@pytest.mark.parametrize(
    "bounds",
    [[0, 64, 129], [0, 65, 129], [0, 1, 30, 100, 129], [0, 128, 129]],
    ids=lambda b: "pieces" + "_".join(map(str, b)),
)
@pytest.mark.parametrize(("b_form", "c_form", "initial_state"), CONFIGS)
def test_pieces_equal_one_call(backend, bounds, b_form, c_form, initial_state):
    inputs = make_inputs(
        seqlen=bounds[-1], b_form=b_form, c_form=c_form, initial_state=initial_state
    )
    weights = make_weights(inputs)
    out, last, grads = run_scan(selective_scan_fn, leaves(inputs), True, weights)

    args = leaves(inputs)
    outs, states = scan_in_pieces(selective_scan_fn, args, bounds)
    assert_close("out", torch.cat(outs, dim=-1), out, TOL)
    assert_close("last_state", states[-1], last, TOL)
    # The loss of the one call, through the pieces: the state flows back through every piece.
    loss = (torch.cat(outs, dim=-1) * weights[0]).sum() + (states[-1] * weights[1]).sum()
    names = float_inputs(args)
    piece_grads = torch.autograd.grad(loss, [args[k] for k in names])
    for name, grad in zip(names, piece_grads, strict=True):
        assert_close(f"grad of {name}", grad, grads[name], TOL)


def run_pieces(fn, inputs: dict, bounds: list[int], weights) -> tuple:
    """(out of all pieces, every piece's state, gradients of pieces_loss) for fn on leaves."""
    args = leaves(inputs)
    outs, states = scan_in_pieces(fn, args, bounds)
    names = float_inputs(args)
    loss = pieces_loss(outs, states, bounds, weights)
    grads = torch.autograd.grad(loss, [args[k] for k in names])
    return torch.cat(outs, dim=-1), states, dict(zip(names, grads, strict=True))


@pytest.mark.parametrize(("b_form", "c_form", "initial_state"), CONFIGS)
def test_pieces_loss_on_every_state(backend, b_form, c_form, initial_state):
    """A loss on every piece's output and state, against the same chain of oracle calls."""
    bounds = [0, 7, 70, 71, 150]
    inputs = make_inputs(
        seqlen=bounds[-1], b_form=b_form, c_form=c_form, initial_state=initial_state
    )
    w_out, w_last = make_weights(inputs)
    gen = torch.Generator().manual_seed(7)
    w_states = [torch.randn(w_last.shape, generator=gen).to(w_last) for _ in bounds[1:]]
    out, states, grads = run_pieces(selective_scan_fn, inputs, bounds, (w_out, w_states))
    expected_out, expected_states, expected_grads = run_pieces(
        selective_scan_ref,
        to_float64(inputs),
        bounds,
        (w_out.double(), [w.double() for w in w_states]),
    )
    assert_close("out", out, expected_out, TOL)
    for i, (state, expected) in enumerate(zip(states, expected_states, strict=True)):
        assert_close(f"last_state of piece {i}", state, expected, TOL)
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, expected_grads[name], TOL)


def scan_separately(inputs: dict, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed sequence in its own call (batch 1); an empty sequence keeps its initial
    state (zeros without one) as its last state and adds nothing to out."""
    outs, states = [], []
    init, dim, dstate = inputs["initial_state"], inputs["u"].shape[1], inputs["A"].shape[1]
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        state = None if init is None else init[i : i + 1]
        if end > start:
            piece = time_slice(inputs, start, end) | {"initial_state": state, "cu_seqlens": None}
            out, state = selective_scan_fn(**piece, delta_softplus=True, return_last_state=True)
            outs.append(out)
        elif state is None:
            state = inputs["u"].new_zeros((1, dim, dstate), dtype=torch.float32)
        states.append(state)
    return torch.cat(outs, dim=-1), torch.cat(states, dim=0)


CU_SEQLENS = [
    [0, 7, 7, 20],  # an empty sequence in the middle
    [0, 0, 63, 64, 130, 200],  # empty first; ends just before a chunk; one step; crossings
    [0, 64, 128, 192, 200],  # boundaries on the chunk boundaries
    [0, 100, 200, 200],  # empty last
    [0, 1, 2, 3],  # only one-step sequences
]


@pytest.mark.parametrize("cu_seqlens", CU_SEQLENS, ids=lambda cu: "cu" + "_".join(map(str, cu)))
@pytest.mark.parametrize(("b_form", "c_form", "initial_state"), CONFIGS)
def test_cu_seqlens_equals_separate_calls(backend, cu_seqlens, b_form, c_form, initial_state):
    inputs = make_inputs(
        batch=1,
        seqlen=cu_seqlens[-1],
        b_form=b_form,
        c_form=c_form,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
    )
    weights = make_weights(inputs)
    out, last, grads = run_scan(selective_scan_fn, leaves(inputs), True, weights)

    args = leaves(inputs)
    sep_out, sep_last = scan_separately(args, cu_seqlens)
    assert_close("out", out, sep_out, TOL)
    assert_close("last_state", last, sep_last, TOL)
    loss = (sep_out * weights[0]).sum() + (sep_last * weights[1]).sum()
    names = float_inputs(args)
    for name, grad in zip(names, torch.autograd.grad(loss, [args[k] for k in names]), strict=True):
        assert_close(f"grad of {name}", grads[name], grad, TOL)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("cu_seqlens", CU_SEQLENS[:2], ids=lambda cu: "cu" + "_".join(map(str, cu)))
def test_cu_seqlens_against_oracle(backend, cu_seqlens, index_dtype):
    inputs = make_inputs(
        batch=1, seqlen=cu_seqlens[-1], b_form="grouped", initial_state=True, cu_seqlens=cu_seqlens
    )
    inputs["cu_seqlens"] = inputs["cu_seqlens"].to(index_dtype)
    weights = make_weights(inputs)
    expected_out, expected_last, expected_grads = oracle(inputs, True, weights)
    out, last, grads = run_scan(selective_scan_fn, leaves(inputs), True, weights)
    tol = TOLERANCE[torch.float32]
    assert_close("out", out, expected_out, tol)
    assert_close("last_state", last, expected_last, tol)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, expected_grads[name], tol)


def test_cu_seqlens_gradcheck(backend):
    inputs = make_inputs(
        batch=1, dim=2, dstate=2, seqlen=6, groups=2, b_form="grouped", dtype=torch.float64,
        initial_state=True, cu_seqlens=[0, 2, 2, 6],
    )  # fmt: skip
    assert gradcheck_scan(inputs)
