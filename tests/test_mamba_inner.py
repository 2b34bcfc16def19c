"""mamba_inner_fn: against a float64 composition of reference pieces (outputs and every
gradient), the memory-saving recomputation of checkpoint_lvl=1, bad arguments, torch.compile
and torch.export."""

import contextlib

import pytest
import torch
from helpers import assert_close
from model_helpers import compile_fullgraph, hermetic_compile, mamba_inner_naive
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from selective_scan.mamba_inner import mamba_inner_fn

# d_model, d_inner, dstate, dt_rank, d_conv: all distinct, so that a mixed-up dimension fails.
D_MODEL, D_INNER, DSTATE, RANK, WIDTH = 6, 12, 4, 3, 4


def make_inputs(batch=2, seqlen=21, seed=0, bc="variable", extras=False, conv_bias=True):
    """Random inputs of mamba_inner_fn as a Mamba layer passes them (weights at scales that keep
    every stage of order one). bc="variable": B and C from x_proj; "constant": given (dim,
    dstate). extras: out_proj bias, B/C projection biases and the three RMSNorm weights."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return scale * torch.randn(shape, generator=gen)

    x_proj_rows = RANK + (2 * DSTATE if bc == "variable" else 0)
    inputs = {
        "xz": rand(batch, 2 * D_INNER, seqlen),
        "conv1d_weight": rand(D_INNER, 1, WIDTH, scale=0.5),
        "conv1d_bias": rand(D_INNER) if conv_bias else None,
        "x_proj_weight": rand(x_proj_rows, D_INNER, scale=D_INNER**-0.5),
        "delta_proj_weight": rand(D_INNER, RANK, scale=RANK**-0.5),
        "out_proj_weight": rand(D_MODEL, D_INNER, scale=D_INNER**-0.5),
        "out_proj_bias": rand(D_MODEL) if extras else None,
        "A": -(0.5 * torch.rand(D_INNER, DSTATE, generator=gen) + 0.1),
        "D": rand(D_INNER),
        "delta_bias": 0.5 * torch.rand(D_INNER, generator=gen) - 1.0,
    }
    if bc == "constant":
        inputs |= {"B": rand(D_INNER, DSTATE), "C": rand(D_INNER, DSTATE)}
    if extras:
        inputs |= {
            "B_proj_bias": rand(DSTATE),
            "C_proj_bias": rand(DSTATE),
            "b_rms_weight": 1 + rand(DSTATE, scale=0.1),
            "c_rms_weight": 1 + rand(DSTATE, scale=0.1),
            "dt_rms_weight": 0.5 + rand(D_INNER, scale=0.1),
        }
    return inputs


def leaves(inputs: dict, dtype=None) -> dict:
    return {
        k: None if v is None else v.detach().to(dtype or v.dtype).clone().requires_grad_(True)
        for k, v in inputs.items()
    }


def grads_of(fn, inputs: dict, w_out: torch.Tensor, **kwargs):
    """out = fn(**inputs) and the gradients of sum(out * w_out) w.r.t. every tensor input."""
    out = fn(**inputs, **kwargs)
    names = [k for k, v in inputs.items() if v is not None]
    grads = torch.autograd.grad((out * w_out.to(out.dtype)).sum(), [inputs[k] for k in names])
    return out, dict(zip(names, grads, strict=True))


def weights_for(inputs: dict) -> torch.Tensor:
    batch, _, seqlen = inputs["xz"].shape
    return torch.randn(batch, seqlen, D_MODEL, generator=torch.Generator().manual_seed(7))


CASES = [
    pytest.param(dict(), id="mamba_layer"),
    pytest.param(dict(extras=True), id="proj_biases-rms_norms-out_bias"),
    pytest.param(dict(bc="constant", conv_bias=False), id="constant_BC-no_conv_bias"),
]


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
@pytest.mark.parametrize("options", CASES)
def test_matches_float64_composition_with_every_gradient(options, checkpoint_lvl):
    inputs = make_inputs(**options)
    w_out = weights_for(inputs)
    out, grads = grads_of(mamba_inner_fn, leaves(inputs), w_out, checkpoint_lvl=checkpoint_lvl)
    expected, expected_grads = grads_of(mamba_inner_naive, leaves(inputs, torch.float64), w_out)
    assert_close("out", out, expected, 1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, expected_grads[name], 1e-5)


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
@pytest.mark.parametrize("options", CASES)
def test_float64_calls_compute_in_float64(options, checkpoint_lvl):
    """Float64 inputs keep float64 precision through every stage, the RMSNorms included (a
    float32 norm put relative errors of 1e-8 to 1e-7 into the output and the gradients)."""
    inputs = make_inputs(**options, seed=5)
    w_out = weights_for(inputs)
    out, grads = grads_of(mamba_inner_fn, leaves(inputs, torch.float64), w_out,
                          checkpoint_lvl=checkpoint_lvl)  # fmt: skip
    expected, expected_grads = grads_of(mamba_inner_naive, leaves(inputs, torch.float64), w_out)
    assert out.dtype == torch.float64
    assert_close("out", out, expected, 1e-12)
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, expected_grads[name], 1e-12)


@pytest.mark.parametrize("options", CASES)
def test_checkpoint_levels_give_the_same_gradients(options):
    inputs = make_inputs(**options, seed=3)
    w_out = weights_for(inputs)
    out0, grads0 = grads_of(mamba_inner_fn, leaves(inputs), w_out, checkpoint_lvl=0)
    out1, grads1 = grads_of(mamba_inner_fn, leaves(inputs), w_out, checkpoint_lvl=1)
    assert torch.equal(out0, out1)
    for name, grad in grads1.items():
        assert_close(f"grad of {name}", grad, grads0[name], 1e-6)


class Intercepting(TorchFunctionMode):
    """A function mode that changes nothing: calls under it are no longer plain eager, so
    checkpoint_lvl=1 takes the selective checkpoint, as traced calls do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def node_names(t: torch.Tensor) -> set[str]:
    """The type names of the autograd nodes t's graph holds."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [next_node for next_node, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast_bf16"])
@pytest.mark.parametrize("options", CASES)
def test_eager_level_1_equals_the_selective_checkpoint(options, autocast):
    """Plain eager calls of level 1 run their own autograd.Function (mamba_inner._EagerRegion),
    not the selective checkpoint: the same output and gradients (the same ops, rerun under the
    forward's autocast state), without a dispatch mode on every op."""
    inputs = make_inputs(**options, seed=5)
    w_out = weights_for(inputs)

    def run(mode):
        with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return grads_of(mamba_inner_fn, leaves(inputs), w_out, checkpoint_lvl=1)

    out, grads = run(contextlib.nullcontext())
    out_checkpointed, grads_checkpointed = run(Intercepting())
    assert "_EagerRegionBackward" in node_names(out)
    assert "_EagerRegionBackward" not in node_names(out_checkpointed)
    assert_close("out", out, out_checkpointed, 1e-6)
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, grads_checkpointed[name], 1e-5 if autocast else 1e-6)


class OpCounter(TorchDispatchMode):
    """Counts the aten / custom ops that run while it is active."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("checkpoint_lvl", "recomputed"), [(0, False), (1, True)])
def test_level_1_recomputes_the_conv_but_not_the_scan(checkpoint_lvl, recomputed):
    """The backward of level 1 reruns the conv (its output and delta were not kept) and never
    the scan's forward; level 0 reruns nothing."""
    inputs = leaves(make_inputs())
    out = mamba_inner_fn(**inputs, checkpoint_lvl=checkpoint_lvl)
    with OpCounter() as backward_ops:
        out.sum().backward()
    counts = backward_ops.counts
    assert ("aten.convolution" in counts) == recomputed, counts

    def scan_calls(name):  # either backend's op: scan_fwd, scan_fwd_triton...
        return sum(n for op, n in counts.items() if op.startswith(f"selective_scan.{name}"))

    assert scan_calls("scan_fwd") == 0 and scan_calls("scan_bwd") == 1, counts


def _rows(n):
    return torch.randn(n, D_INNER)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(checkpoint_lvl=2), ValueError, r"checkpoint_lvl must be 0 or 1, got 2"),
        (dict(checkpoint_lvl=True), ValueError, r"checkpoint_lvl must be 0 or 1, got True"),
        (dict(delta_softplus="no"), TypeError, r"delta_softplus must be a bool, got str"),
        # Complex A: B and C from x_proj take 2 * dstate columns each (parts side by side).
        (dict(A=torch.randn(D_INNER, DSTATE, dtype=torch.complex64)), ValueError,
         rf"x_proj_weight must have shape .* = \({RANK + 4 * DSTATE}, {D_INNER}\)"),
        (dict(A=None), TypeError, r"A must be a torch\.Tensor"),
        (dict(B=torch.randn(D_INNER, DSTATE), b_rms_weight=torch.ones(DSTATE)), ValueError,
         r"needs B=None"),
        (dict(xz=torch.randn(2, 2 * D_INNER + 1, 21)), ValueError, r"xz must have shape"),
        (dict(xz=torch.randn(2, 2 * D_INNER, 0)), ValueError, r"xz must be non-empty"),
        (dict(conv1d_weight=torch.randn(D_INNER, WIDTH)), ValueError,
         r"conv1d_weight must have 3 dim"),
        (dict(conv1d_weight=torch.randn(D_INNER, 2, WIDTH)), ValueError,
         r"conv1d_weight must have shape"),
        (dict(conv1d_weight=torch.randn(D_INNER, 1, WIDTH, device="meta")), ValueError,
         r"conv1d_weight is on meta but xz is on cpu"),
        (dict(conv1d_bias=torch.randn(D_INNER + 1)), ValueError,
         r"conv1d_bias must have shape \(d_inner,\)"),
        # B and C would read each other's columns, or columns past them, without an error.
        (dict(x_proj_weight=_rows(RANK + DSTATE)), ValueError,
         rf"x_proj_weight must have shape .* = \({RANK + 2 * DSTATE}, {D_INNER}\)"),
        (dict(x_proj_weight=_rows(RANK + 2 * DSTATE + 1)), ValueError, r"x_proj_weight must have"),
        (dict(delta_proj_weight=torch.randn(D_INNER, RANK + 1)), ValueError,
         r"x_proj_weight must have shape"),
        (dict(delta_proj_weight=torch.randn(D_INNER + 1, RANK)), ValueError,
         r"delta_proj_weight must have shape \(d_inner, rank\)"),
        # Broadcasting would hide these.
        (dict(out_proj_weight=torch.randn(D_INNER)), ValueError,
         r"out_proj_weight must have 2 dim"),
        (dict(x_proj_weight=None), TypeError, r"x_proj_weight must be a torch\.Tensor"),
        (dict(out_proj_bias=torch.randn(1)), ValueError, r"out_proj_bias must have shape"),
        (dict(B_proj_bias=torch.randn(1)), ValueError, r"B_proj_bias must have shape \(dstate,\)"),
        (dict(b_rms_weight=torch.randn(1)), ValueError, r"b_rms_weight must have shape"),
        (dict(dt_rms_weight=torch.randn(1)), ValueError, r"dt_rms_weight must have shape"),
        (dict(out_proj_weight=torch.randn(D_MODEL, D_INNER, dtype=torch.float64)), TypeError,
         r"out_proj_weight must have xz's dtype"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_bad_arguments_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        mamba_inner_fn(**make_inputs() | changes)


class InnerLayer(torch.nn.Module):
    """The weights as parameters, xz the input: what a Mamba layer hands mamba_inner_fn."""

    def __init__(self, **options):
        super().__init__()
        inputs = make_inputs(**options, seed=11)
        del inputs["xz"]
        self.absent = {k: None for k, v in inputs.items() if v is None}
        self.weights = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v) for k, v in inputs.items() if v is not None}
        )

    def forward(self, xz):
        return mamba_inner_fn(xz, **self.absent, **dict(self.weights.items()))


@pytest.fixture
def no_compile_caches():
    with hermetic_compile():
        yield


@pytest.mark.usefixtures("no_compile_caches")
def test_compiled_matches_eager_with_zero_graph_breaks_and_no_recompilation():
    layer = InnerLayer(extras=True)
    compiled, check_one_graph = compile_fullgraph(layer, dynamic=True)
    params = dict(layer.named_parameters())
    # The first call's batch and seqlen differ from every weight size (duck sizing).
    for batch, seqlen in [(5, 33), (2, 70)]:
        xz = torch.randn(batch, 2 * D_INNER, seqlen)
        expected = layer(xz)
        expected_grads = torch.autograd.grad(expected.square().sum(), list(params.values()))
        actual = compiled(xz)
        grads = torch.autograd.grad(actual.square().sum(), list(params.values()))
        assert_close("out", actual, expected, 1e-6)
        for name, grad, exp in zip(params, grads, expected_grads, strict=True):
            assert_close(f"grad of {name}", grad, exp, 1e-5)
    check_one_graph()


def test_exported_runs_at_other_sizes():
    layer = InnerLayer()
    batch, seqlen = torch.export.Dim("batch", min=2), torch.export.Dim("seqlen", min=2)
    exported = torch.export.export(
        layer, (torch.randn(3, 2 * D_INNER, 33),), dynamic_shapes=({0: batch, 2: seqlen},)
    )
    scans = [n for n in exported.graph.nodes if "selective_scan" in str(n.target)]
    assert len(scans) == 1
    for shape in [(2, 2 * D_INNER, 5), (5, 2 * D_INNER, 130)]:
        xz = torch.randn(shape)
        with torch.no_grad():
            assert_close("out", exported.module()(xz), layer(xz), 1e-6)


def test_forward_mode_ad_is_refused():
    """A tangent on anything the scan reads raises (the scan has no forward-mode derivative);
    one on out_proj alone is torch's own linear and runs."""
    inputs = make_inputs()
    with pytest.raises(NotImplementedError, match="mamba_inner_fn: forward-mode AD"):
        torch.func.jvp(lambda xz: mamba_inner_fn(**(inputs | {"xz": xz})), (inputs["xz"],),
                       (torch.randn_like(inputs["xz"]),))  # fmt: skip
    weight = inputs["out_proj_weight"]
    tangent = torch.randn_like(weight)
    _, out_tangent = torch.func.jvp(
        lambda w: mamba_inner_fn(**(inputs | {"out_proj_weight": w})), (weight,), (tangent,)
    )
    expected = mamba_inner_fn(**(inputs | {"out_proj_weight": tangent}))
    torch.testing.assert_close(out_tangent, expected)
