"""The Mamba layer on packed sequences (cu_seqlens) and from given states: packed against each
sequence run alone, chunks carrying the states against one forward (outputs and gradients,
into the initial states too), bad arguments, torch.compile without recompilation when the
packing changes, and torch.export."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close
from model_helpers import (
    assert_same_with_grads,
    compile_fullgraph,
    cu_seqlens_of,
    hermetic_compile,
    join_chunks,
    split_into_chunks,
    weighted_sum_grads,
)

from selective_scan.modules import Mamba

D_MODEL, D_INNER, D_STATE, D_CONV = 20, 40, 4, 4


def make_layer(seed: int = 0) -> Mamba:
    torch.manual_seed(seed)
    return Mamba(D_MODEL, d_state=D_STATE, d_conv=D_CONV)


def hidden(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, generator=gen).requires_grad_(True)


def states(rows: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (conv_state (rows, d_inner, d_conv), ssm_state (rows, d_inner, d_state))."""
    gen = torch.Generator().manual_seed(seed)
    conv_state = torch.randn(rows, D_INNER, D_CONV, generator=gen).requires_grad_(True)
    ssm_state = torch.randn(rows, D_INNER, D_STATE, generator=gen).requires_grad_(True)
    return conv_state, ssm_state


def leaves_of(layer: Mamba, x: torch.Tensor, initial_states) -> dict:
    """Everything the gradients are compared for: the input, the parameters, the states."""
    named = {"hidden_states": x, **dict(layer.named_parameters())}
    if initial_states is not None:
        named |= {"conv_state": initial_states[0], "ssm_state": initial_states[1]}
    return named


@pytest.mark.parametrize("given_states", [False, True], ids=["zero_states", "initial_states"])
def test_packed_forward_matches_each_sequence_alone(given_states):
    """Sequences shorter than d_conv too."""
    layer = make_layer()
    lengths = [5, 1, 9, 3]
    x = hidden(1, sum(lengths))
    initial_states = states(len(lengths)) if given_states else None
    out, final_states = layer(
        x, cu_seqlens=cu_seqlens_of(lengths), initial_states=initial_states,
        return_final_states=True,
    )  # fmt: skip
    alone = []
    for i, seq in enumerate(x.split(lengths, dim=1)):
        rows = None if initial_states is None else tuple(s[i : i + 1] for s in initial_states)
        out_i, states_i = layer(seq, initial_states=rows, return_final_states=True)
        alone.append((out_i, *states_i))
    outs, conv_states, ssm_states = zip(*alone, strict=True)
    expected = [torch.cat(outs, dim=1), torch.cat(conv_states), torch.cat(ssm_states)]
    leaves = leaves_of(layer, x, initial_states)
    assert_same_with_grads([out, *final_states], expected, leaves, 1e-5)


# Chunk c holds parts[c][i] tokens of sequence i: one sequence per batch row (a chunk shorter
# than d_conv too), or three packed sequences (the second has none in the second chunk).
CHUNK_CASES = [
    pytest.param(False, [[2], [3], [8]], id="batch"),
    pytest.param(True, [[3, 2, 1], [3, 0, 4]], id="packed"),
]


@pytest.mark.parametrize(("packed", "parts"), CHUNK_CASES)
def test_chunks_carrying_states_match_one_forward(packed, parts):
    layer = make_layer()
    lengths = [sum(sizes) for sizes in zip(*parts, strict=True)]
    x = hidden(1 if packed else 2, sum(lengths))
    initial_states = states(len(lengths) if packed else 2)

    def run(x, sizes, initial_states):
        cu_seqlens = cu_seqlens_of(sizes) if packed else None
        return layer(
            x, cu_seqlens=cu_seqlens, initial_states=initial_states, return_final_states=True
        )

    out, final_states = run(x, lengths, initial_states)
    outs, carried = [], initial_states
    for chunk, sizes in zip(split_into_chunks(x, parts, dim=1), parts, strict=True):
        chunk_out, carried = run(chunk, sizes, carried)
        outs.append(chunk_out)
    chunked = [join_chunks(outs, parts, dim=1), *carried]
    leaves = leaves_of(layer, x, initial_states)
    assert_same_with_grads(chunked, [out, *final_states], leaves, 1e-5)


@torch.no_grad()
def test_zero_initial_states_and_prefill_match_the_plain_forward():
    """The plain forward (mamba_inner_fn) against the separate conv + scan path."""
    layer = make_layer()
    x = hidden(2, 7)
    zero_states = layer.allocate_inference_cache(2, 7)
    expected = layer(x)
    assert_close("zero initial_states", layer(x, initial_states=zero_states), expected, 1e-6)
    out, conv_state, ssm_state = layer.prefill(x)
    assert_close("prefill", out, expected, 1e-6)
    _, (final_conv, final_ssm) = layer(x, return_final_states=True)
    assert torch.equal(conv_state, final_conv) and torch.equal(ssm_state, final_ssm)


def call(batch=1, lengths=(3, 4), initial_states=None, **kwargs):
    layer = make_layer()
    x = hidden(batch, 7)
    cu_seqlens = kwargs.pop("cu_seqlens", cu_seqlens_of(list(lengths)))
    return lambda: layer(x, cu_seqlens=cu_seqlens, initial_states=initial_states, **kwargs)


@pytest.mark.parametrize(
    ("run", "error", "match"),
    [
        (call(batch=2), ValueError, r"hidden_states must have shape \(1, total_len, d_model\)"),
        (call(cu_seqlens=torch.tensor([0.0, 7.0])), TypeError, r"cu_seqlens must have dtype"),
        (call(lengths=(3, 3)), ValueError, r"cu_seqlens must start at 0 and end at seqlen=7"),
        (call(initial_states=states(2)[0]), TypeError, r"must be a pair \(conv_state, ssm"),
        (
            call(initial_states=states(1)),
            ValueError,
            r"conv_state must have shape \(num_seqs, d_inner, d_conv\) = \(2, 40, 4\)",
        ),
        (
            call(initial_states=(states(2)[0], torch.zeros(2, D_INNER, 5))),
            ValueError,
            r"ssm_state must have shape \(num_seqs, d_inner, d_state\) = \(2, 40, 4\)",
        ),
        (
            call(batch=3, cu_seqlens=None, initial_states=states(2)),
            ValueError,
            r"conv_state must have shape \(batch, d_inner, d_conv\) = \(3, 40, 4\)",
        ),
        (
            call(inference_params=SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)),
            ValueError,
            r"inference_params .* cannot be combined with cu_seqlens",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_arguments_name_the_argument(run, error, match):
    with pytest.raises(error, match=match):
        run()


@pytest.fixture(scope="module", autouse=True)
def no_compile_caches():
    """The PyTorch scan ops and no on-disk compile caches (see model_helpers)."""
    with hermetic_compile():
        yield


def packed_call(layer, lengths: list[int], seed: int):
    """The packed layer from given states: ([out, conv_state, ssm_state], the leaves)."""
    x = hidden(1, sum(lengths), seed=seed)
    initial_states = states(len(lengths), seed=seed)
    cu_seqlens = cu_seqlens_of(lengths)
    out, final_states = layer(
        x, cu_seqlens=cu_seqlens, initial_states=initial_states, return_final_states=True
    )
    return [out, *final_states], leaves_of(layer, x, initial_states)


def test_compiled_packed_forward_and_backward_do_not_recompile():
    eager = make_layer(seed=3)
    module = copy.deepcopy(eager)
    compiled, check_one_graph = compile_fullgraph(module, dynamic=True)
    # First-call sizes distinct from the layer's (4, 20, 40) and from each other (duck sizing):
    # then another number of sequences, other lengths, an empty sequence.
    for seed, lengths in enumerate([[9, 30, 1, 17, 6], [40, 0, 52]]):
        expected, eager_leaves = packed_call(eager, lengths, seed)
        actual, leaves = packed_call(compiled, lengths, seed)
        names = ("out", "conv_state", "ssm_state")
        for name, out, exp in zip(names, actual, expected, strict=True):
            assert_close(name, out, exp, 1e-5)
        grads = weighted_sum_grads(actual, leaves)
        expected_grads = weighted_sum_grads(expected, eager_leaves)
        for name, grad, exp in zip(leaves, grads, expected_grads, strict=True):
            assert_close(f"grad of {name}", grad, exp, 1e-5)
    check_one_graph()


class PackedLayer(torch.nn.Module):
    """The layer on packed sequences from given states, returning the final states: what
    torch.export traces."""

    def __init__(self, layer: Mamba):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, cu_seqlens, conv_state, ssm_state):
        out, final_states = self.layer(
            hidden_states, cu_seqlens=cu_seqlens, initial_states=(conv_state, ssm_state),
            return_final_states=True,
        )  # fmt: skip
        return out, *final_states


def export_inputs(lengths: list[int], seed: int) -> tuple:
    initial_states = states(len(lengths), seed=seed)
    x = hidden(1, sum(lengths), seed=seed)
    return tuple(t.detach() for t in (x, cu_seqlens_of(lengths), *initial_states))


def test_exported_packed_layer_runs_other_packings():
    layer = PackedLayer(make_layer(seed=5).eval())
    # Sizes 0 and 1 would specialize: at least 2 tokens and 2 sequences.
    seqlen, num_seqs = torch.export.Dim("seqlen", min=2), torch.export.Dim("num_seqs", min=2)
    dims = ({1: seqlen}, {0: num_seqs + 1}, {0: num_seqs}, {0: num_seqs})
    exported = torch.export.export(layer, export_inputs([9, 30, 1, 17, 6], 0), dynamic_shapes=dims)
    for seed, lengths in enumerate([[40, 0, 52], [3, 4]], start=1):
        args = export_inputs(lengths, seed)
        with torch.no_grad():
            actual, expected = exported.module()(*args), layer(*args)
        for name, out, exp in zip(
            ("out", "conv_state", "ssm_state"), actual, expected, strict=True
        ):
            assert_close(name, out, exp, 1e-6)
