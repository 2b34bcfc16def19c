"""causal_conv1d_fn and causal_conv1d_update: against a loop over the taps in float64, update
against the full conv, bad arguments, torch.compile and torch.export."""

import pytest
import torch
from helpers import assert_close
from model_helpers import causal_conv1d_naive, compile_fullgraph, hermetic_compile

from selective_scan.conv import causal_conv1d_fn, causal_conv1d_update

DIM = 6


def conv_inputs(batch=2, seqlen=9, width=4, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    return {
        "x": rand(batch, DIM, seqlen),
        "weight": rand(DIM, width),
        "bias": rand(DIM),
        "initial_states": rand(batch, DIM, width - 1),
    }


def requiring_grad(inputs: dict, dtype=None) -> dict:
    return {
        k: v.detach().to(dtype or v.dtype).clone().requires_grad_(True) for k, v in inputs.items()
    }


CASES = [
    pytest.param(dict(width=4, seqlen=9), dict(activation="silu"), id="silu"),
    pytest.param(dict(width=2, seqlen=9), dict(activation=None, bias=None), id="no_bias-width2"),
    pytest.param(dict(width=4, seqlen=2), dict(activation="swish"), id="shorter_than_width"),
    pytest.param(dict(width=3, seqlen=7), dict(activation="silu", initial_states=True), id="init"),
    pytest.param(dict(width=4, seqlen=5, dtype=torch.bfloat16), dict(activation="silu"), id="bf16"),
]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(("shape", "options"), CASES)
def test_fn_matches_loop_with_gradients(shape, options):
    inputs = conv_inputs(**shape)
    if not options.pop("initial_states", False):
        del inputs["initial_states"]
    for name in [k for k, v in options.items() if v is None and k in inputs]:
        del inputs[name]
    activation = options["activation"]
    ours, ref = requiring_grad(inputs), requiring_grad(inputs, torch.float64)
    out, final = causal_conv1d_fn(**ours, activation=activation, return_final_states=True)
    expected, expected_final = causal_conv1d_naive(**ref, activation=activation)
    tol = TOLERANCE[inputs["x"].dtype]
    assert out.dtype == inputs["x"].dtype
    assert_close("out", out, expected, tol)
    assert_close("final_states", final, expected_final, 0.0)
    w_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w_out.to(out.dtype)).sum(), list(ours.values()))
    expected_grads = torch.autograd.grad((expected * w_out.double()).sum(), list(ref.values()))
    for name, grad, exp in zip(ours, grads, expected_grads, strict=True):
        assert_close(f"grad of {name}", grad, exp, tol)


def test_channel_last_layout_and_final_states_out():
    inputs = conv_inputs()
    expected, expected_final = causal_conv1d_fn(**inputs, return_final_states=True)
    x = inputs["x"].transpose(1, 2).contiguous().transpose(1, 2)  # (batch, dim, seqlen) view
    final_states_out = torch.full_like(expected_final, float("nan"))
    out, final = causal_conv1d_fn(
        **inputs | {"x": x}, return_final_states=True, final_states_out=final_states_out
    )
    assert final is final_states_out
    assert torch.equal(out, expected)
    assert torch.equal(final, expected_final)


def stepped(update_x, prefix_states, inputs, chunks, state_len, activation):
    """Run update_x through causal_conv1d_update in the given chunk lengths (0 means one 2-D
    (batch, dim) step), from a conv_state of state_len entries ending with prefix_states (the
    prefix's last width - 1 inputs). Older entries are NaN: the conv must never read them."""
    filler = torch.full((*prefix_states.shape[:2], state_len), float("nan"))
    conv_state = torch.cat([filler, prefix_states], -1)[..., -state_len:].contiguous()
    outs, start = [], 0
    for n in chunks:
        x = update_x[:, :, start] if n == 0 else update_x[:, :, start : start + n]
        out = causal_conv1d_update(x, conv_state, inputs["weight"], inputs["bias"], activation)
        outs.append(out.unsqueeze(-1) if n == 0 else out)
        start += max(n, 1)
    return torch.cat(outs, dim=-1), conv_state


@pytest.mark.parametrize("state_len_extra", [0, 1, 3], ids=lambda n: f"state_len=width-1+{n}")
@pytest.mark.parametrize("chunks", [[0] * 6, [1, 2, 3], [0, 5]], ids=str)
def test_update_continues_the_full_conv(state_len_extra, chunks):
    inputs = conv_inputs(seqlen=10)
    width = inputs["weight"].shape[1]
    state_len = width - 1 + state_len_extra
    full = causal_conv1d_fn(inputs["x"], inputs["weight"], inputs["bias"], activation="silu")
    prefix = 4
    _, prefix_states = causal_conv1d_fn(
        inputs["x"][..., :prefix], inputs["weight"], return_final_states=True
    )
    out, conv_state = stepped(
        inputs["x"][..., prefix:], prefix_states, inputs, chunks, state_len, "silu"
    )
    assert_close("stepped out", out, full[..., prefix:], 1e-6)
    assert torch.equal(conv_state, inputs["x"][..., -state_len:])


def test_update_with_conv_state_indices():
    inputs = conv_inputs(batch=3)
    pool = torch.randn(5, DIM, 4)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    expected_rows = pool[rows.long()].clone()
    x = inputs["x"][..., :2]
    expected = causal_conv1d_update(x, expected_rows, inputs["weight"], inputs["bias"])
    untouched = pool[[1, 3]].clone()
    out = causal_conv1d_update(x, pool, inputs["weight"], inputs["bias"], conv_state_indices=rows)
    assert torch.equal(out, expected)
    assert torch.equal(pool[rows.long()], expected_rows)
    assert torch.equal(pool[[1, 3]], untouched)


def call_fn(**changes):
    return lambda: causal_conv1d_fn(**conv_inputs() | changes)


def call_update(**changes):
    inputs = conv_inputs()
    args = {"x": inputs["x"][..., 0], "conv_state": torch.zeros(2, DIM, 3)}
    args |= {"weight": inputs["weight"], "bias": inputs["bias"]}
    return lambda: causal_conv1d_update(**args | changes)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (call_fn(seq_idx=torch.zeros(2, 9, dtype=torch.int32)), r"seq_idx .* not supported"),
        (call_fn(activation="relu"), r"activation must be one of"),
        (call_fn(weight=torch.randn(DIM + 1, 4)), r"weight must have shape \(dim, width\)"),
        (call_fn(bias=torch.randn(DIM + 1)), r"bias must have shape \(dim,\)"),
        (call_fn(initial_states=torch.randn(2, DIM, 4)), r"initial_states must have shape"),
        (call_update(cache_seqlens=torch.zeros(2, dtype=torch.int32)), r"cache_seqlens .* not"),
        (call_update(conv_state=torch.zeros(2, DIM, 2)), r"state_len >= width - 1 = 3"),
        (call_update(conv_state=torch.zeros(3, DIM, 4)), r"conv_state must have shape"),
        (
            call_update(conv_state_indices=torch.zeros(2, 1, dtype=torch.int32)),
            r"conv_state_indices must have 1 dimensions",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.fixture
def no_compile_caches():
    with hermetic_compile():
        yield


@pytest.mark.usefixtures("no_compile_caches")
def test_compiled_fn_matches_eager_without_recompiling():
    def loss(x, weight, bias, initial_states):
        out, final = causal_conv1d_fn(
            x, weight, bias, initial_states=initial_states, return_final_states=True,
            activation="silu",
        )  # fmt: skip
        return (out * out).sum() + final.sum()

    compiled, check_one_graph = compile_fullgraph(loss, dynamic=True)
    # First-call sizes distinct from dim 6, width 4 and width - 1 = 3 (duck sizing).
    for seed, (batch, seqlen) in enumerate([(5, 17), (2, 40)]):
        inputs = conv_inputs(batch=batch, seqlen=seqlen, seed=seed)
        eager_args, compiled_args = requiring_grad(inputs), requiring_grad(inputs)
        expected, actual = loss(**eager_args), compiled(**compiled_args)
        assert_close("loss", actual, expected, 1e-6)
        grads = torch.autograd.grad(actual, list(compiled_args.values()))
        expected_grads = torch.autograd.grad(expected, list(eager_args.values()))
        for name, grad, exp in zip(inputs, grads, expected_grads, strict=True):
            assert_close(f"grad of {name}", grad, exp, 1e-6)
    check_one_graph()


@pytest.mark.usefixtures("no_compile_caches")
def test_compiled_update_updates_the_state_like_eager():
    inputs = conv_inputs()
    compiled, check_one_graph = compile_fullgraph(causal_conv1d_update)
    state = torch.randn(2, DIM, 4)
    eager_state, compiled_state = state.clone(), state.clone()
    for t in range(3):
        args = (inputs["x"][..., t], inputs["weight"], inputs["bias"], "silu")
        expected = causal_conv1d_update(args[0], eager_state, *args[1:])
        actual = compiled(args[0], compiled_state, *args[1:])
        assert_close("out", actual, expected, 1e-6)
        assert torch.equal(compiled_state, eager_state)
    check_one_graph()


class ConvLayer(torch.nn.Module):
    """A conv as a model holds it: weight and bias are parameters."""

    def __init__(self):
        super().__init__()
        inputs = conv_inputs(seed=5)
        self.weight = torch.nn.Parameter(inputs["weight"])
        self.bias = torch.nn.Parameter(inputs["bias"])

    def forward(self, x, initial_states):
        return causal_conv1d_fn(
            x, self.weight, self.bias, initial_states=initial_states, return_final_states=True,
            activation="silu",
        )  # fmt: skip

    def update(self, x, conv_state):
        return causal_conv1d_update(x, conv_state, self.weight, self.bias, "silu")


def test_exported_fn_runs_at_other_sizes():
    layer = ConvLayer()
    batch, seqlen = torch.export.Dim("batch", min=2), torch.export.Dim("seqlen", min=2)
    inputs = conv_inputs(batch=3, seqlen=17)
    args = (inputs["x"], inputs["initial_states"])
    exported = torch.export.export(layer, args, dynamic_shapes=({0: batch, 2: seqlen}, {0: batch}))
    for batch_, seqlen_ in [(2, 5), (4, 64)]:
        other = conv_inputs(batch=batch_, seqlen=seqlen_, seed=batch_)
        args = (other["x"], other["initial_states"])
        with torch.no_grad():
            for name, actual, expected in zip(
                ("out", "final_states"), exported.module()(*args), layer(*args), strict=True
            ):
                assert_close(name, actual, expected, 1e-6)


def test_exported_update_mutates_the_given_state():
    layer = ConvLayer()

    class Update(torch.nn.Module):
        def forward(self, x, conv_state):
            return layer.update(x, conv_state)

    batch = torch.export.Dim("batch", min=2)
    x, state = torch.randn(3, DIM), torch.randn(3, DIM, 4)
    exported = torch.export.export(Update(), (x, state.clone()), dynamic_shapes=({0: batch},) * 2)
    x, state = torch.randn(5, DIM), torch.randn(5, DIM, 4)
    eager_state, exported_state = state.clone(), state.clone()
    with torch.no_grad():
        expected = layer.update(x, eager_state)
        actual = exported.module()(x, exported_state)
    assert_close("out", actual, expected, 1e-6)
    assert torch.equal(exported_state, eager_state)
