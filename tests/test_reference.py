"""selective_scan_ref, the oracle of every other test, against a deliberately naive loop."""

import math

import pytest
import torch
from helpers import assert_close, make_inputs

from selective_scan import selective_scan_ref

FORMS = ("constant", "variable", "grouped")
TINY = dict(batch=2, dim=4, dstate=3, seqlen=6, groups=2)


def softplus(x: float) -> float:
    return x if x > 20 else math.log1p(math.exp(x))  # threshold 20, as in mamba's CUDA kernel


def naive_scan(inputs: dict, delta_softplus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One Python float recurrence per (sequence, channel, state), step by step.

    Nothing is shared with the implementation: B and C are indexed per form, packed sequences
    are (start, end) spans of batch 0, and out/last_state are built element by element."""
    x = {
        k: None if v is None else (v.double() if v.is_floating_point() else v).tolist()
        for k, v in inputs.items()
    }
    batch, dim, seqlen = inputs["u"].shape
    dstate = inputs["A"].shape[1]

    def coefficient(name, b, d, n, t):
        rank = inputs[name].dim()
        if rank == 2:
            return x[name][d][n]
        if rank == 3:
            return x[name][b][n][t]
        channels_per_group = dim // inputs[name].shape[1]
        return x[name][b][d // channels_per_group][n][t]

    if x["cu_seqlens"] is None:
        spans = [(b, 0, seqlen, b) for b in range(batch)]  # (batch row, start, end, state index)
    else:
        cu = x["cu_seqlens"]
        spans = [(0, cu[i], cu[i + 1], i) for i in range(len(cu) - 1)]

    y = [[[0.0] * seqlen for _ in range(dim)] for _ in range(batch)]
    last = [[[0.0] * dstate for _ in range(dim)] for _ in range(len(spans))]
    for b, start, end, i in spans:
        for d in range(dim):
            for n in range(dstate):
                h = 0.0 if x["initial_state"] is None else x["initial_state"][i][d][n]
                for t in range(start, end):
                    dt = x["delta"][b][d][t]
                    if x["delta_bias"] is not None:
                        dt += x["delta_bias"][d]
                    if delta_softplus:
                        dt = softplus(dt)
                    u = x["u"][b][d][t]
                    h = math.exp(dt * x["A"][d][n]) * h + dt * coefficient("B", b, d, n, t) * u
                    y[b][d][t] += coefficient("C", b, d, n, t) * h
                last[i][d][n] = h
    for b in range(batch):
        for d in range(dim):
            for t in range(seqlen):
                if x["D"] is not None:
                    y[b][d][t] += x["D"][d] * x["u"][b][d][t]
                if x["z"] is not None:
                    z = x["z"][b][d][t]
                    y[b][d][t] *= z / (1 + math.exp(-z))
    return torch.tensor(y, dtype=torch.float64), torch.tensor(last, dtype=torch.float64)


def check_ref(inputs: dict, delta_softplus: bool, tol: float = 1e-12) -> None:
    out, last = selective_scan_ref(**inputs, delta_softplus=delta_softplus, return_last_state=True)
    expected_out, expected_last = naive_scan(inputs, delta_softplus)
    assert_close("out", out, expected_out, tol)
    assert_close("last_state", last, expected_last, tol)


@pytest.mark.parametrize("c_form", FORMS)
@pytest.mark.parametrize("b_form", FORMS)
def test_bc_forms(b_form, c_form):
    inputs = make_inputs(
        **TINY, b_form=b_form, c_form=c_form, dtype=torch.float64, initial_state=True
    )
    check_ref(inputs, delta_softplus=True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"D": True},
        {"z": True},
        {"delta_bias": True},
        {"delta_softplus": True},
        {"initial_state": True},
    ],
    ids=lambda options: "-".join(options) or "none",
)
def test_each_option_alone(options):
    options = dict(options)
    delta_softplus = options.pop("delta_softplus", False)
    flags = {"D": False, "z": False, "delta_bias": False} | options
    inputs = make_inputs(**TINY, dtype=torch.float64, **flags)
    check_ref(inputs, delta_softplus)


def test_softplus_threshold():
    """delta + delta_bias above 20 takes softplus(x) = x; around 20 both branches are met."""
    inputs = make_inputs(**TINY, dtype=torch.float64)
    inputs["delta"][0, :, :3] = torch.tensor([19.5, 20.5, 25.0], dtype=torch.float64)
    out, _ = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
    assert torch.isfinite(out).all()
    check_ref(inputs, delta_softplus=True)


@pytest.mark.parametrize(
    "cu_seqlens",
    [[0, 6], [0, 2, 2, 6], [0, 0, 1, 6], [0, 3, 6, 6], [0, 1, 2, 3, 4, 5, 6]],
    ids=lambda cu: "cu" + "_".join(map(str, cu)),
)
@pytest.mark.parametrize("initial_state", [False, True], ids=["zero_state", "initial_state"])
def test_cu_seqlens(cu_seqlens, initial_state):
    inputs = make_inputs(
        **TINY | {"batch": 1},
        b_form="grouped",
        c_form="variable",
        dtype=torch.float64,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
    )
    check_ref(inputs, delta_softplus=True)


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "tol"),
    [
        (torch.float32, torch.float32, 1e-6),
        (torch.float16, torch.float32, 2e-3),
        (torch.bfloat16, torch.float32, 1e-2),
        (torch.float64, torch.float64, 1e-12),
    ],
)
def test_dtypes(dtype, state_dtype, tol):
    """out in u's dtype, last_state float32 (float64 for float64 inputs); low-precision inputs
    are compared with the naive loop on the same rounded values."""
    inputs = make_inputs(**TINY, dtype=dtype, initial_state=True)
    out, last = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
    assert out.dtype == dtype
    assert last.dtype == state_dtype
    check_ref(inputs, delta_softplus=True, tol=tol)
