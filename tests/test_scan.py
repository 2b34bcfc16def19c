"""selective_scan_fn against the float64 oracle: forward and every gradient, over the options."""

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
    pairwise,
    run_scan,
    tolerance,
)

from selective_scan import selective_scan_fn

# Every output the op allocates starts as NaN: an element it forgets to write is not finite.
pytestmark = pytest.mark.usefixtures("poison_uninitialized")

FORMS = ("constant", "variable", "grouped")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# One step, odd, not a power of two, and several chunks (CPU chunks of 64 steps, Triton
# checkpoints every 128: 129 and 200 cross both).
SEQLENS = (1, 7, 100, 129, 200)
DEFAULT = dict(
    b_form="variable",
    c_form="variable",
    D=True,
    z=True,
    delta_bias=True,
    initial_state=True,
    delta_softplus=True,
    return_last_state=True,
    dtype=torch.float32,
    batch=2,
    seqlen=129,
)


def case_id(case: dict) -> str:
    flags = [k for k, v in case.items() if v is True]
    dtype = str(case["dtype"]).replace("torch.", "")
    sizes = f"batch{case['batch']}-L{case['seqlen']}"
    return "-".join([f"B{case['b_form']}", f"C{case['c_form']}", *flags, dtype, sizes])


def check_case(case: dict, seed: int = 0) -> None:
    """Forward and all gradients through selective_scan_fn against the float64 oracle, with random
    weights on out and (when returned) last_state."""
    case = DEFAULT | case
    delta_softplus = case.pop("delta_softplus")
    return_last_state = case.pop("return_last_state")
    inputs = make_inputs(dim=8, dstate=4, groups=2, seed=seed, **case)
    w_out, w_last = make_weights(inputs, seed=seed + 1)
    if not return_last_state:
        w_last = torch.zeros_like(w_last)  # the oracle's loss then ignores last_state too
    expected_out, expected_last, expected_grads = oracle(inputs, delta_softplus, (w_out, w_last))
    out, last, grads = run_scan(
        selective_scan_fn, leaves(inputs), delta_softplus, (w_out, w_last), return_last_state
    )
    tol = tolerance(inputs)
    assert out.dtype == inputs["u"].dtype
    assert_close("out", out, expected_out, tol)
    if return_last_state:
        assert last.dtype == (torch.float64 if case["dtype"] == torch.float64 else torch.float32)
        assert_close("last_state", last, expected_last, tol)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(f"grad of {name}", grad, expected_grads[name], tol)


AXES = dict(
    b_form=FORMS,
    c_form=FORMS,
    D=(True, False),
    z=(True, False),
    delta_bias=(True, False),
    initial_state=(True, False),
    delta_softplus=(True, False),
    return_last_state=(True, False),
    dtype=DTYPES,
    batch=(1, 2),
    seqlen=SEQLENS,
)


@pytest.mark.parametrize(
    ("seed", "case"),
    [pytest.param(i, case, id=case_id(case)) for i, case in enumerate(pairwise(AXES))],
)
def test_pairwise(backend, seed, case):
    """Every pair of values of any two options occurs in some case (the full product has 23040)."""
    check_case(case, seed)


@pytest.mark.parametrize(("b_form", "c_form"), list(itertools.product(FORMS, FORMS)))
def test_bc_forms(backend, b_form, c_form):
    check_case(dict(b_form=b_form, c_form=c_form, seqlen=70))


@pytest.mark.parametrize(
    ("D", "z", "delta_bias", "delta_softplus"), list(itertools.product((True, False), repeat=4))
)
def test_options(backend, D, z, delta_bias, delta_softplus):
    # Elementwise options: a short scan is enough (the pairwise cases pair them with lengths).
    check_case(dict(D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus, seqlen=20))


@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_lengths(backend, dtype, seqlen):
    check_case(dict(dtype=dtype, seqlen=seqlen, b_form="grouped"))


@pytest.mark.parametrize(
    "dtypes",
    [
        {"u": torch.bfloat16, "delta": torch.bfloat16, "z": torch.bfloat16},  # B, C float32
        {"u": torch.float16, "B": torch.bfloat16, "z": torch.float32},
        {"B": torch.bfloat16, "C": torch.float16},  # u float32
    ],
    ids=lambda dtypes: "-".join(f"{k}_{str(v)[6:]}" for k, v in dtypes.items()),
)
def test_mixed_dtypes(backend, dtypes):
    inputs = make_inputs(seqlen=70, initial_state=True)
    inputs |= {k: inputs[k].to(dtype) for k, dtype in dtypes.items()}
    weights = make_weights(inputs)
    expected_out, expected_last, expected_grads = oracle(inputs, True, weights)
    out, last, grads = run_scan(selective_scan_fn, leaves(inputs), True, weights)
    tol = tolerance(inputs)
    assert out.dtype == inputs["u"].dtype
    assert last.dtype == torch.float32
    assert_close("out", out, expected_out, tol)
    assert_close("last_state", last, expected_last, tol)
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(f"grad of {name}", grad, expected_grads[name], tol)


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to t, as a transposed view (last two dims swapped in memory) or a strided
    slice whose neighbours in memory are NaN (reading them would poison the result)."""
    if layout == "transposed":
        return t.mT.contiguous().mT if t.dim() >= 2 else t
    return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("form", FORMS)
def test_non_contiguous_inputs(backend, form, layout):
    inputs = make_inputs(seqlen=70, b_form=form, c_form=form, initial_state=True)
    weights = make_weights(inputs)
    expected = run_scan(selective_scan_fn, leaves(inputs), True, weights)
    strided = {
        k: relayout(v, layout).detach().requires_grad_(True) if k in float_inputs(inputs) else v
        for k, v in inputs.items()
    }
    for name in ("u", "delta", "z", "A", "B", "C"):
        assert not strided[name].is_contiguous(), name  # the test really passes views
    actual = run_scan(selective_scan_fn, strided, True, weights)
    tol = TOLERANCE[torch.float32]  # reading a wrong element is an O(1) error, or NaN
    assert_close("out", actual[0], expected[0], tol)
    assert_close("last_state", actual[1], expected[1], tol)
    for name, grad in actual[2].items():
        assert_close(f"grad of {name}", grad, expected[2][name], tol)


@pytest.mark.parametrize(
    ("batch", "dim", "seqlen"), [(2, 8, 1), (1, 1, 7), (2, 8, 129)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_inputs_unchanged(backend, dtype, batch, dim, seqlen):
    """Forward and backward leave every input as it was (the ops declare no mutated args)."""
    inputs = make_inputs(
        batch=batch, dim=dim, seqlen=seqlen, groups=1, dtype=dtype, initial_state=True
    )
    before = {k: v.clone() for k, v in inputs.items() if v is not None}
    shared = {  # leaves that share memory with inputs, unlike leaves()'s copies
        k: v.detach().requires_grad_(True) if k in float_inputs(inputs) else v
        for k, v in inputs.items()
    }
    run_scan(selective_scan_fn, shared, True, make_weights(inputs))
    for name, value in before.items():
        assert torch.equal(inputs[name], value), f"{name} was modified"


def test_return_types(backend):
    inputs = make_inputs(seqlen=7)
    out = selective_scan_fn(**inputs)
    assert isinstance(out, torch.Tensor)
    result = selective_scan_fn(**inputs, return_last_state=True)
    assert isinstance(result, tuple)
    assert len(result) == 2


@pytest.mark.parametrize(
    ("sizes", "fast_mode"),
    [
        (dict(batch=2, dim=2, dstate=2, seqlen=4, groups=2), False),
        # Across the chunk boundaries of both backends; fast mode (random directions) is cheap.
        (dict(batch=1, dim=2, dstate=2, seqlen=130, groups=1), True),
    ],
    ids=["tiny", "chunks"],
)
def test_gradcheck(backend, sizes, fast_mode):
    """Finite differences in float64 through every input, incl. initial_state, on the outputs
    out and last_state."""
    inputs = make_inputs(
        **sizes, b_form="grouped", c_form="variable", dtype=torch.float64, initial_state=True
    )
    assert gradcheck_scan(inputs, fast_mode=fast_mode)
