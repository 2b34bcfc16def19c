"""Random inputs in the anchor distributions, the float64 oracle, error measures and bounds,
and a pairwise generator of test cases."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar

import torch
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

from selective_scan import selective_scan_fn, selective_scan_ref
from selective_scan._checks import compute_dtype

OPTIONAL = ("D", "z", "delta_bias", "initial_state", "cu_seqlens")
# The scan ops' tensor inputs in schema order (make_inputs' keys).
SCAN_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state", "cu_seqlens")


def make_inputs(
    batch: int = 2,
    dim: int = 8,
    dstate: int = 4,
    seqlen: int = 33,
    b_form: str = "variable",
    c_form: str = "variable",
    groups: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    D: bool = True,
    z: bool = True,
    delta_bias: bool = True,
    initial_state: bool = False,
    cu_seqlens: list[int] | None = None,
    seed: int = 0,
) -> dict:
    """Fresh random inputs: u, z, B, C ~ N(0,1); delta ~ 0.5 U(0,1); A = -(0.5 U(0,1) + 0.1);
    D ~ N(0,1); delta_bias ~ 0.5 U(0,1); initial_state ~ N(0,1).

    b_form/c_form: "constant" (dim, dstate), "variable" (batch, dstate, seqlen) or "grouped"
    (batch, groups, dstate, seqlen). A, D, delta_bias and initial_state are float32 (float64 when
    dtype is float64), as in mamba.
    """
    gen = torch.Generator().manual_seed(seed)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32

    def rand(*shape, dt=dtype, kind="normal"):
        t = (
            torch.randn(shape, generator=gen)
            if kind == "normal"
            else torch.rand(shape, generator=gen)
        )
        return t.to(dt).to(device)

    def bc(form):
        shape = {
            "constant": (dim, dstate),
            "variable": (batch, dstate, seqlen),
            "grouped": (batch, groups, dstate, seqlen),
        }[form]
        return rand(*shape, dt=wdt if form == "constant" else dtype)

    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    return {
        "u": rand(batch, dim, seqlen),
        "delta": 0.5 * rand(batch, dim, seqlen, kind="uniform"),
        "A": -(0.5 * rand(dim, dstate, dt=wdt, kind="uniform") + 0.1),
        "B": bc(b_form),
        "C": bc(c_form),
        "D": rand(dim, dt=wdt) if D else None,
        "z": rand(batch, dim, seqlen) if z else None,
        "delta_bias": 0.5 * rand(dim, dt=wdt, kind="uniform") if delta_bias else None,
        "initial_state": rand(num_states, dim, dstate, dt=wdt) if initial_state else None,
        "cu_seqlens": None
        if cu_seqlens is None
        else torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
    }


def float_inputs(inputs: dict) -> list[str]:
    """Names of the floating-point tensors (the differentiable inputs)."""
    return [k for k, v in inputs.items() if v is not None and v.is_floating_point()]


def to_float64(inputs: dict) -> dict:
    return {
        k: v.detach().double() if v is not None and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere gives inf."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def oracle(inputs: dict, delta_softplus: bool, weights=None):
    """float64 reference outputs (out, last_state) and, with weights (w_out, w_last), the
    gradients of sum(out * w_out) + sum(last_state * w_last) w.r.t. every float input."""
    ref = {
        k: v.requires_grad_(True) if k in float_inputs(inputs) else v
        for k, v in to_float64(inputs).items()
    }
    out, last = selective_scan_ref(**ref, delta_softplus=delta_softplus, return_last_state=True)
    if weights is None:
        return out, last, None
    loss = (out * weights[0].double()).sum() + (last * weights[1].double()).sum()
    names = float_inputs(inputs)
    grads = torch.autograd.grad(loss, [ref[k] for k in names])
    return out.detach(), last.detach(), dict(zip(names, grads, strict=True))


# Relative-error bounds against the float64 oracle, by the dtype of the outputs. Low-precision
# outputs are compared with the oracle run on the same rounded inputs, so what remains is the
# rounding of the outputs (half an ulp: 2^-9 bf16, 2^-12 fp16) over float32 arithmetic.
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def tolerance(inputs: dict) -> float:
    """The bound for the loosest dtype among the float inputs (mixed dtypes take the worst)."""
    return max(TOLERANCE[inputs[k].dtype] for k in float_inputs(inputs))


def make_weights(inputs: dict, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights (w_out, w_last) for the loss sum(out * w_out) + sum(last_state * w_last).

    w_out has out's dtype (so the oracle sees exactly the dout the op sees); w_last has
    last_state's dtype and shape (num_states, dim, dstate)."""
    gen = torch.Generator().manual_seed(seed)
    u = inputs["u"]
    cu = inputs.get("cu_seqlens")
    num_states = u.shape[0] if cu is None else cu.shape[0] - 1
    last_dtype = compute_dtype(*(inputs[k] for k in float_inputs(inputs)))
    w_out = torch.randn(u.shape, generator=gen).to(u.dtype)
    w_last = torch.randn((num_states, u.shape[1], inputs["A"].shape[1]), generator=gen)
    return w_out.to(u.device), w_last.to(last_dtype).to(u.device)


def leaves(inputs: dict) -> dict:
    """Copies of the inputs, the float ones as leaves requiring grad. clone() keeps the strides
    of dense inputs, and the caller's tensors stay untouched whatever the op does."""
    return {
        k: v.detach().clone().requires_grad_(True) if k in float_inputs(inputs) else v
        for k, v in inputs.items()
    }


def run_scan(fn, inputs: dict, delta_softplus: bool, weights=None, return_last_state=True):
    """Call fn (selective_scan_fn or selective_scan_ref) on ``inputs`` as given (leaves requiring
    grad, or not); with weights, also return the gradients of the weighted loss w.r.t. every
    float input that requires grad. Returns (out, last_state or None, grads or None)."""
    result = fn(**inputs, delta_softplus=delta_softplus, return_last_state=return_last_state)
    out, last = result if return_last_state else (result, None)
    if weights is None:
        return out, last, None
    loss = (out * weights[0]).sum()
    if last is not None:
        loss = loss + (last * weights[1]).sum()
    names = [k for k in float_inputs(inputs) if inputs[k].requires_grad]
    grads = torch.autograd.grad(loss, [inputs[k] for k in names])
    return out, last, dict(zip(names, grads, strict=True))


def replay_cases(u: torch.Tensor, dstate: int) -> list[tuple]:
    """(dout, dlast_state, softplus) for each change of a scan plan's replay key
    (kernels.launch.launch_sequence): dout contiguous, broadcast in time (staged into contiguous
    rows: the contiguous dout's key) or strided in time; with dlast_state; without softplus."""
    batch, dim, seqlen = u.shape
    strided = torch.randn(batch, seqlen, dim, dtype=u.dtype, device=u.device).transpose(1, 2)
    douts = [torch.randn_like(u), torch.randn_like(u[..., :1]).expand_as(u), strided]
    dlast = torch.randn(batch, dim, dstate, device=u.device)
    return [(dout, None, True) for dout in douts] + [(douts[0], dlast, True),
                                                     (douts[0], None, False)]  # fmt: skip


def check_replays(policy, fwd_bwd, cases: list, expected: list, rounds: int) -> None:
    """Under ``policy`` (plans of its own), ``rounds`` rounds of fwd_bwd(*case) over
    ``replay_cases`` equal ``expected`` bit for bit, and the policy's plans kept a launch
    sequence for each key: two forward (softplus on and off), four backward."""
    from selective_scan.kernels import plan
    from selective_scan.kernels.tiles import use_policy

    with use_policy(policy):
        for _ in range(rounds):
            for case, want in zip(cases, expected, strict=True):
                for a, b in zip(fwd_bwd(*case), want, strict=True):
                    assert torch.equal(a, b)
    (fwd_plan,) = [p for key, p in plan._PLANS.items() if key[0] is policy and not key[1]]
    (bwd_plan,) = [p for key, p in plan._PLANS.items() if key[0] is policy and key[1]]
    assert len(fwd_plan.sequences) == 2
    assert len(bwd_plan.sequences) == 4


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Same shape, every element finite, relative error (over all elements) within tol."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    bad = (~torch.isfinite(actual)).sum().item()
    assert bad == 0, f"{name}: {bad} of {actual.numel()} elements are not finite"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"


def pairwise(axes: dict[str, list]) -> list[dict]:
    """A covering set of cases in which every pair of values of every two axes occurs.

    Greedy and deterministic: each new case starts from the first uncovered pair and fills the
    other axes with the value that covers the most still-uncovered pairs."""
    names = list(axes)
    values = [list(axes[n]) for n in names]

    def pair(i, a, j, b):
        return (i, a, j, b) if i < j else (j, b, i, a)

    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(names)), 2)
        for a in range(len(values[i]))
        for b in range(len(values[j]))
    }
    cases = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row = {i: a, j: b}
        for k in range(len(names)):
            if k not in row:
                row[k] = max(
                    range(len(values[k])),
                    key=lambda v, k=k: sum(pair(m, row[m], k, v) in uncovered for m in row),
                )
        uncovered -= {pair(m, row[m], n, row[n]) for m, n in itertools.combinations(row, 2)}
        cases.append({names[k]: values[k][row[k]] for k in range(len(names))})
    return cases


def gradcheck_scan(inputs: dict, fast_mode: bool = False) -> bool:
    """torch.autograd.gradcheck of selective_scan_fn (softplus on) w.r.t. every float input,
    on the tuple (out, last_state); inputs should be float64."""
    names = float_inputs(inputs)

    def scan(*tensors):
        return selective_scan_fn(
            **inputs | dict(zip(names, tensors, strict=True)),
            delta_softplus=True,
            return_last_state=True,
        )

    args = [inputs[k].detach().clone().requires_grad_(True) for k in names]
    return torch.autograd.gradcheck(scan, args, fast_mode=fast_mode)


class RecordOps(TorchDispatchMode):
    """A dispatch mode that records every op called under it (``.ops``) and runs it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def complex_inputs(form_b="variable", form_c="constant", batch=2, dim=4, dstate=3, seqlen=9,
                   dtype=torch.float64, seed=0, device=DEVICE) -> dict:  # fmt: skip
    """Fresh inputs with complex A (negative real parts): constant B/C complex (dim, dstate),
    variable ones real (batch, [2 groups,] dstate, 2 * seqlen), parts interleaved in time. Drawn
    on the CPU, so every machine gets the same values, and returned on ``device``: the GPU where
    there is one, so that the Triton backend runs its kernels, not the interpreter."""
    gen = torch.Generator().manual_seed(seed)
    cdt = torch.complex128 if dtype == torch.float64 else torch.complex64

    def real(*shape, kind=torch.randn):
        return kind(*shape, generator=gen, dtype=torch.float64).to(dtype)

    def bc(form):
        if form == "constant":
            return torch.randn(dim, dstate, generator=gen, dtype=torch.complex128).to(cdt)
        shape = (
            (batch, dstate, 2 * seqlen) if form == "variable" else (batch, 2, dstate, 2 * seqlen)
        )
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    f64, c128 = torch.float64, torch.complex128
    A = torch.complex(-0.5 * torch.rand(dim, dstate, generator=gen, dtype=f64) - 0.1,
                      torch.randn(dim, dstate, generator=gen, dtype=f64)).to(cdt)  # fmt: skip
    inputs = dict(
        u=real(batch, dim, seqlen),
        delta=0.5 * real(batch, dim, seqlen, kind=torch.rand),
        A=A,
        B=bc(form_b),
        C=bc(form_c),
        D=real(dim),
        z=real(batch, dim, seqlen),
        delta_bias=0.5 * real(dim, kind=torch.rand),
        initial_state=torch.randn(batch, dim, dstate, generator=gen, dtype=c128).to(cdt),
    )
    return {k: v.to(device) for k, v in inputs.items()}


T = TypeVar("T")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """(a CUDA graph of one call of fn, what that call returned: tensors in the graph's memory,
    rewritten by every replay). Two calls on a side stream first, as capture needs: Triton
    compiles its kernels, cuBLAS sets up its workspace. A training step that sets its gradients
    to None gets them allocated from the graph's pool (torch's whole-network capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
