"""causal_conv1d_fn and causal_conv1d_update: against a loop over the taps in float64, update
against the full conv, bad arguments, torch.compile and torch.export."""

import pytest
import torch
from helpers import RecordOps, assert_close
from model_helpers import (
    assert_same_with_grads,
    causal_conv1d_naive,
    compile_fullgraph,
    cu_seqlens_of,
    hermetic_compile,
    join_chunks,
    split_into_chunks,
)

from selective_scan.conv import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_fn

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


def each_sequence_alone(x, weight, bias, lengths, histories):
    """The float64 oracle on each packed sequence of x (1, dim, total_len) as its own batch row,
    from its history (num_seqs, dim, state_len): (out, the last state_len inputs of each)."""
    width, state_len = weight.shape[1], histories.shape[-1]
    outs, finals = [], []
    for seq, history in zip(x.split(lengths, dim=-1), histories.split(1), strict=True):
        conv_history = history[..., state_len - (width - 1) :]
        outs.append(causal_conv1d_naive(seq, weight, bias, conv_history, "silu")[0])
        finals.append(torch.cat([history, seq], dim=-1)[..., -state_len:])
    return torch.cat(outs, dim=-1), torch.cat(finals)


@pytest.mark.parametrize("rows", [[[3, 1, 5], [9]], [[2, 2, 2, 3], [1, 8]]], ids=str)
def test_seq_idx_matches_each_sequence_alone(rows):
    """rows[b]: the lengths of the sequences packed in batch row b (shorter than the conv too)."""
    inputs = conv_inputs(batch=len(rows), seqlen=9, dtype=torch.float64)
    del inputs["initial_states"]
    leaves = requiring_grad(inputs)
    seq_idx = [torch.arange(len(r)).repeat_interleave(torch.tensor(r)) for r in rows]
    out = causal_conv1d_fn(**leaves, seq_idx=torch.stack(seq_idx).int(), activation="silu")
    x, weight, bias = leaves.values()
    expected = [
        each_sequence_alone(x[b : b + 1], weight, bias, r, x.new_zeros(len(r), DIM, 3))[0]
        for b, r in enumerate(rows)
    ]
    assert_same_with_grads([out], [torch.cat(expected)], leaves, 1e-12)


# (sequence lengths, state_len, or None for no initial states): an empty sequence, sequences
# shorter than width - 1 = 3, and states longer than the conv reads.
VARLEN_CASES = [
    pytest.param([4, 1, 0, 6], None, id="no_initial_states"),
    pytest.param([4, 1, 0, 6], 3, id="initial_states"),
    pytest.param([2, 9], 5, id="state_len=5"),
]


@pytest.mark.parametrize(("lengths", "state_len"), VARLEN_CASES)
def test_varlen_matches_each_sequence_alone(lengths, state_len):
    inputs = conv_inputs(batch=1, seqlen=sum(lengths), dtype=torch.float64)
    states_shape = (len(lengths), DIM, state_len or 3)
    gen = torch.Generator().manual_seed(2)
    inputs["initial_states"] = torch.randn(states_shape, generator=gen, dtype=torch.float64)
    if state_len is None:
        del inputs["initial_states"]
    leaves = requiring_grad(inputs)
    out, final = causal_conv1d_varlen_fn(
        **leaves, cu_seqlens=cu_seqlens_of(lengths), return_final_states=True, activation="silu"
    )
    histories = leaves.get("initial_states", torch.zeros(states_shape, dtype=torch.float64))
    x, weight, bias = leaves["x"], leaves["weight"], leaves["bias"]
    expected = each_sequence_alone(x, weight, bias, lengths, histories)
    assert_same_with_grads([out, final], list(expected), leaves, 1e-12)


# Chunks of one sequence per batch row (some shorter than width - 1 = 3), or of three packed
# sequences: chunk c holds parts[c][i] tokens of sequence i (none of the second in chunk 2).
CHUNK_CASES = [
    pytest.param(None, [[2], [1], [8]], id="batch"),
    pytest.param(4, [[3, 2, 1], [2, 0, 6]], id="packed"),
]


@pytest.mark.parametrize(("state_len", "parts"), CHUNK_CASES)
def test_chunks_carrying_final_states_match_the_whole(state_len, parts):
    """state_len None: causal_conv1d_fn on batch rows; else causal_conv1d_varlen_fn."""
    lengths = [sum(sizes) for sizes in zip(*parts, strict=True)]
    packed = state_len is not None
    inputs = conv_inputs(batch=1 if packed else 2, seqlen=sum(lengths), dtype=torch.float64)
    if packed:
        gen = torch.Generator().manual_seed(3)
        shape = (len(lengths), DIM, state_len)
        inputs["initial_states"] = torch.randn(shape, generator=gen, dtype=torch.float64)
    leaves = requiring_grad(inputs)
    x, weight, bias, initial_states = leaves.values()

    def conv(x, lengths, states):
        fn, options = causal_conv1d_fn, {}
        if packed:
            fn, options = causal_conv1d_varlen_fn, {"cu_seqlens": cu_seqlens_of(lengths)}
        return fn(
            x, weight, bias, initial_states=states, return_final_states=True, activation="silu",
            **options,
        )  # fmt: skip

    whole = conv(x, lengths, initial_states)
    outs, states = [], initial_states
    for chunk, sizes in zip(split_into_chunks(x, parts, -1), parts, strict=True):
        out, states = conv(chunk, sizes, states)
        outs.append(out)
    assert_same_with_grads([join_chunks(outs, parts, -1), states], list(whole), leaves, 1e-12)


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


@pytest.mark.parametrize("indices", [[-1, 0, 7, 2, -1], [3, -1, 2, 9, 1]], ids=["row0", "no_row0"])
def test_update_skips_padding_rows(indices):
    """Rows of x whose index is negative (padding) or past the pool leave every row of the pool
    alone and get out 0; the others step their rows, also row 0, which the padding rows are
    sent to (their writes carry row 0's new value: the result does not depend on their
    order). No value is read on the host."""
    inputs = conv_inputs(batch=5)
    pool = torch.randn(4, DIM, 3)
    before = pool.clone()
    rows = torch.tensor(indices)
    kept = [b for b, i in enumerate(indices) if 0 <= i < 4]
    x = inputs["x"][..., :2]
    expected_rows = pool[rows[kept]].clone()
    expected = causal_conv1d_update(x[kept], expected_rows, inputs["weight"], inputs["bias"])
    with RecordOps() as mode:  # nothing read on the host: a decode step does not synchronize
        out = causal_conv1d_update(x, pool, inputs["weight"], inputs["bias"],
                                   conv_state_indices=rows)  # fmt: skip
    assert torch.ops.aten._local_scalar_dense.default not in mode.ops
    assert torch.equal(out[kept], expected)
    padding = [b for b in range(5) if b not in kept]
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    assert torch.equal(pool[rows[kept]], expected_rows)
    untouched = [r for r in range(4) if r not in indices]
    assert torch.equal(pool[untouched], before[untouched])


def call_fn(**changes):
    return lambda: causal_conv1d_fn(**conv_inputs() | changes)


SEQ_IDX = torch.zeros(2, 9, dtype=torch.int32)
CU = torch.tensor([0, 4, 4, 9], dtype=torch.int32)


def call_varlen(**changes):
    inputs = conv_inputs(batch=1) | {"initial_states": None}
    return lambda: causal_conv1d_varlen_fn(**inputs | {"cu_seqlens": CU} | changes)


def call_update(**changes):
    inputs = conv_inputs()
    args = {"x": inputs["x"][..., 0], "conv_state": torch.zeros(2, DIM, 3)}
    args |= {"weight": inputs["weight"], "bias": inputs["bias"]}
    return lambda: causal_conv1d_update(**args | changes)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (call_fn(seq_idx=SEQ_IDX), r"seq_idx cannot be combined with initial_states"),
        (call_fn(seq_idx=SEQ_IDX[:, 1:], initial_states=None), r"seq_idx must have shape"),
        (call_fn(seq_idx=SEQ_IDX.float(), initial_states=None), r"seq_idx must have dtype in"),
        (call_fn(activation="relu"), r"activation must be one of"),
        (call_fn(weight=torch.randn(DIM + 1, 4)), r"weight must have shape \(dim, width\)"),
        (call_fn(weight=torch.randn(DIM, 0)), r"causal_conv1d_fn: weight must have width >= 1"),
        (call_fn(x=torch.randn(2, DIM)), r"causal_conv1d_fn: x must have 3 dimensions"),
        (call_fn(bias=torch.randn(DIM + 1)), r"bias must have shape \(dim,\)"),
        (call_fn(initial_states=torch.randn(2, DIM, 4)), r"initial_states must have shape"),
        (call_fn(x=torch.randn(2, DIM, 0), initial_states=None), r"x must be non-empty"),
        (call_fn(weight=torch.randn(DIM, 4, device="meta")), r"weight is on meta but x is on cpu"),
        (call_fn(initial_states=torch.randn(2, DIM, 3, device="meta")), r"initial_states is on m"),
        (
            call_fn(return_final_states=True, final_states_out=torch.zeros(2, DIM, 3).long()),
            r"final_states_out must have dtype in \(float32\), got int64",
        ),
        (
            call_fn(return_final_states=True, final_states_out=torch.zeros(4, 2, DIM, 3)),
            r"final_states_out must have 3 dimensions",
        ),
        (
            call_fn(return_final_states=True, final_states_out=torch.zeros(2, DIM, 2)),
            r"final_states_out must have shape \(batch, dim, width - 1\) = \(2, 6, 3\)",
        ),
        (call_fn(return_final_states="no"), r"return_final_states must be a bool, got str"),
        (call_varlen(return_final_states=1), r"return_final_states must be a bool, got int"),
        (call_varlen(x=torch.randn(2, DIM, 9)), r"x must have shape \(1, dim, total_len\)"),
        (call_varlen(cu_seqlens=CU[:1]), r"cu_seqlens must have shape \(num_seqs \+ 1,\)"),
        (call_varlen(cu_seqlens=CU - 1), r"cu_seqlens must start at 0 and end at seqlen=9"),
        (call_varlen(cu_seqlens=torch.tensor([0, 6, 4, 9])), r"cu_seqlens must be non-decreasing"),
        (call_varlen(cu_seqlens=CU.float()), r"cu_seqlens must have dtype in \(int32, int64\)"),
        (
            call_varlen(initial_states=torch.randn(2, DIM, 3)),
            r"initial_states must have shape \(num_seqs, dim, state_len\) = \(3, 6, \*\)",
        ),
        (call_varlen(initial_states=torch.randn(3, DIM, 2)), r"state_len >= width - 1 = 3"),
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
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.fixture
def no_compile_caches():
    with hermetic_compile():
        yield


@pytest.mark.usefixtures("no_compile_caches")
def test_compiled_fn_matches_eager_without_recompiling():
    def loss(x, weight, bias, initial_states, seq_idx):
        out, final = causal_conv1d_fn(
            x, weight, bias, initial_states=initial_states, return_final_states=True,
            activation="silu",
        )  # fmt: skip
        packed = causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
        return (out * out).sum() + final.sum() + (packed * packed).sum()

    compiled, check_one_graph = compile_fullgraph(loss, dynamic=True)
    # First-call sizes distinct from dim 6, width 4 and width - 1 = 3 (duck sizing).
    for seed, (batch, seqlen) in enumerate([(5, 17), (2, 40)]):
        inputs = conv_inputs(batch=batch, seqlen=seqlen, seed=seed)
        eager_args, compiled_args = requiring_grad(inputs), requiring_grad(inputs)
        # Sequences of 7 tokens, each row starting at another offset.
        seq_idx = ((torch.arange(batch)[:, None] + torch.arange(seqlen)) // 7).int()
        expected = loss(**eager_args, seq_idx=seq_idx)
        actual = compiled(**compiled_args, seq_idx=seq_idx)
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
