"""torch.compile: one graph, no graph break, eager gradients, no recompilation for new sizes."""

import pytest
import torch
import torch._dynamo.testing
from helpers import TOLERANCE, assert_close, float_inputs, leaves, make_inputs, make_weights
from torch._dynamo.utils import counters

from selective_scan import selective_scan_fn


@pytest.fixture(autouse=True)
def hermetic_compile(monkeypatch):
    """The PyTorch ops on CPU tensors (Triton under the interpreter cannot be compiled), and no
    on-disk compile caches: after a change to the op's fake they were seen to serve code with
    the old sizes and strides."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "torch")
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


def loss_fn(w_out, w_last, **inputs):
    out, last = selective_scan_fn(**inputs, delta_softplus=True, return_last_state=True)
    return (out * w_out).sum() + (last * w_last).sum()


# Each case compiles at its first call's sizes and must reuse that graph for the second call
# (another batch or number of sequences, another seqlen; 20 steps fit in one chunk of every
# backend, 200 take several). The first call's sizes are all distinct (dim 8, dstate 4,
# groups 2), or Dynamo's duck sizing would assume that equal sizes stay equal; and
# batch * dim * seqlen stays below 4096, where Inductor's CPU reductions guard on the size.
# Neither is the op's doing.
CASES = [
    pytest.param(
        dict(b_form="variable", c_form="variable"),
        [dict(batch=3, seqlen=20), dict(batch=2, seqlen=200)],
        id="plain-one_to_several_chunks",
    ),
    pytest.param(
        dict(b_form="grouped", c_form="constant", initial_state=True),
        [dict(batch=3, seqlen=70), dict(batch=2, seqlen=200)],
        id="initial_state",
    ),
    pytest.param(
        dict(batch=1, b_form="variable", c_form="constant", initial_state=True),
        [
            dict(seqlen=70, cu_seqlens=[0, 10, 70]),
            dict(seqlen=150, cu_seqlens=[0, 65, 65, 100, 150]),
        ],
        id="cu_seqlens",
    ),
]


@pytest.mark.parametrize(("common", "calls"), CASES)
def test_compile_matches_eager_without_recompiling(common, calls):
    torch._dynamo.reset()
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True, dynamic=True)
    for seed, call in enumerate(calls):
        inputs = make_inputs(**common | call, seed=seed)
        weights = make_weights(inputs, seed=seed)
        names = float_inputs(inputs)
        eager_args, compiled_args = leaves(inputs), leaves(inputs)
        eager = loss_fn(*weights, **eager_args)
        actual = compiled(*weights, **compiled_args)
        # Inductor sums the loss in its own order: float32 rounding, amplified by cancellation.
        assert_close("loss", actual, eager, TOLERANCE[torch.float32])
        # The backward runs outside the compiled function, as in training.
        expected_grads = torch.autograd.grad(eager, [eager_args[k] for k in names])
        grads = torch.autograd.grad(actual, [compiled_args[k] for k in names])
        for name, grad, expected in zip(names, grads, expected_grads, strict=True):
            assert_close(f"grad of {name}", grad, expected, TOLERANCE[torch.float32])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count == 1, f"compiled {backend.frame_count} times for {len(calls)} calls"
