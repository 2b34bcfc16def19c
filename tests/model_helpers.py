"""Shared by the model-level tests: readable oracles for the conv and the Mamba inner path (a
loop over the conv taps, and plain PyTorch ops around selective_scan_ref, meant to run in
float64), outputs and gradients compared at once, packed sequences cut into chunks, compile
checks and a training loop."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch._dynamo.testing
from helpers import assert_close
from torch._dynamo.utils import counters

from selective_scan import selective_scan_ref


def causal_conv1d_naive(x, weight, bias=None, initial_states=None, activation=None):
    """out[:, :, t] = act(bias + sum_k weight[:, k] * x[:, :, t - width + 1 + k]), inputs
    before the sequence taken from initial_states (zeros when None). Returns (out, the last
    width - 1 inputs), in x's dtype."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    history = x.new_zeros(batch, dim, width - 1) if initial_states is None else initial_states
    x_hist = torch.cat([history, x], dim=-1)
    out = x.new_zeros(batch, dim, seqlen) if bias is None else bias[:, None].expand(-1, seqlen)
    for k in range(width):
        out = out + weight[:, k, None] * x_hist[:, :, k : k + seqlen]
    if activation is not None:
        out = out * torch.sigmoid(out)
    return out, x_hist[:, :, x_hist.shape[-1] - (width - 1) :]


def rms_norm_naive(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def mamba_inner_naive(
    xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None,
    C_proj_bias=None, delta_softplus=True, b_rms_weight=None, c_rms_weight=None,
    dt_rms_weight=None, b_c_dt_rms_eps=1e-6, scan_ref=selective_scan_ref,
):  # fmt: skip
    """mamba_ssm's mamba_inner_fn written out step by step in mamba_ssm's own layouts: tokens
    flattened to (batch * seqlen, features) rows for the projections; the scan by scan_ref
    (selective_scan_ref's signature)."""
    batch, _, seqlen = xz.shape
    dstate, rank = A.shape[1], delta_proj_weight.shape[1]
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_naive(x, conv1d_weight[:, 0], conv1d_bias, activation="silu")[0]
    rows = x.permute(0, 2, 1).reshape(batch * seqlen, -1)  # (batch * seqlen, d_inner)
    x_dbl = rows @ x_proj_weight.t()
    delta = x_dbl[:, :rank] @ delta_proj_weight.t()  # (batch * seqlen, d_inner)
    if dt_rms_weight is not None:
        delta = rms_norm_naive(delta, dt_rms_weight, b_c_dt_rms_eps)

    def to_scan_layout(t):  # (batch * seqlen, n) -> (batch, n, seqlen)
        return t.reshape(batch, seqlen, -1).permute(0, 2, 1)

    columns = {"B": slice(rank, rank + dstate), "C": slice(x_dbl.shape[1] - dstate, None)}
    given = {"B": B, "C": C}
    biases = {"B": B_proj_bias, "C": C_proj_bias}
    norms = {"B": b_rms_weight, "C": c_rms_weight}
    for name in ("B", "C"):
        if given[name] is None:
            t = x_dbl[:, columns[name]]
            if biases[name] is not None:
                t = t + biases[name]
            if norms[name] is not None:
                t = rms_norm_naive(t, norms[name], b_c_dt_rms_eps)
            given[name] = to_scan_layout(t)
    y = scan_ref(
        x, to_scan_layout(delta), A, given["B"], given["C"], D, z, delta_bias,
        delta_softplus=delta_softplus,
    )  # fmt: skip
    out = y.permute(0, 2, 1) @ out_proj_weight.t()
    return out if out_proj_bias is None else out + out_proj_bias


def weighted_sum_grads(outputs: list, leaves: dict) -> tuple:
    """Gradients w.r.t. leaves of sum_i sum(outputs[i] * w_i), w_i fixed random weights."""
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, list(leaves.values()))


def assert_same_with_grads(actual: list, expected: list, leaves: dict, tol: float) -> None:
    """Each output close to its expected value, and so is each gradient of one weighted loss of
    the outputs w.r.t. the leaves (a dict name -> tensor requiring grad)."""
    for i, (out, exp) in enumerate(zip(actual, expected, strict=True)):
        assert_close(f"output {i}", out, exp, tol)
    grads = weighted_sum_grads(actual, leaves)
    for name, grad, exp in zip(leaves, grads, weighted_sum_grads(expected, leaves), strict=True):
        assert_close(f"grad of {name}", grad, exp, tol)


def assert_cache_close(cache: list, expected_cache: list, tol: float) -> None:
    """Each layer's (conv_state, ssm_state) close to the expected cache's."""
    for i, (states, expected_states) in enumerate(zip(cache, expected_cache, strict=True)):
        for name, state, expected in zip(("conv", "ssm"), states, expected_states, strict=True):
            assert_close(f"layer {i} {name}_state", state, expected, tol)


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    """(len(lengths) + 1,) int32: 0, then the running sums of the sequence lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def split_into_chunks(x: torch.Tensor, parts: list[list[int]], dim: int) -> list[torch.Tensor]:
    """Cut sequences packed along dim into chunks, packed alike: chunk c holds the next
    parts[c][i] tokens of every sequence i (whose length is sum_c parts[c][i])."""
    per_seq = list(zip(*parts, strict=True))  # per_seq[i]: the part sizes of sequence i
    seqs = x.split([sum(sizes) for sizes in per_seq], dim)
    pieces = [seq.split(list(sizes), dim) for seq, sizes in zip(seqs, per_seq, strict=True)]
    return [torch.cat([p[c] for p in pieces], dim) for c in range(len(parts))]


def join_chunks(chunks: list[torch.Tensor], parts: list[list[int]], dim: int) -> torch.Tensor:
    """The inverse of split_into_chunks."""
    pieces = [chunk.split(sizes, dim) for chunk, sizes in zip(chunks, parts, strict=True)]
    return torch.cat([torch.cat(seq, dim) for seq in zip(*pieces, strict=True)], dim)


@contextlib.contextmanager
def hermetic_compile():
    """The PyTorch scan ops (compiled and exported graphs run on the CPU), and no on-disk compile
    caches: after a change to an op's fake they were seen to serve code with stale sizes."""
    with (
        pytest.MonkeyPatch.context() as mp,
        torch._inductor.config.patch(force_disable_caches=True),
    ):
        mp.setenv("SELECTIVE_SCAN_BACKEND", "torch")
        yield


def compile_fullgraph(fn, **kwargs):
    """torch.compile(fn, fullgraph=True) with Inductor, from a fresh Dynamo; returns the compiled
    function and a check that, so far, it compiled one graph and no graph break was counted."""
    torch._dynamo.reset()
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=backend, fullgraph=True, **kwargs)

    def check_one_graph():
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert backend.frame_count == 1, f"compiled {backend.frame_count} times"

    return compiled, check_one_graph


def train(model, loss_fn, inputs, steps: int = 2) -> list[torch.Tensor]:
    """A few SGD-with-momentum steps on loss_fn(model(inputs)); returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_packed_prefill_then_steps_match(
    model, docs: list[torch.Tensor], prompt_lengths: list[int], cu_seqlens: torch.Tensor, tol: float
) -> None:
    """The prompts (the first prompt_lengths[i] tokens of docs[i], each (1, length)) packed into
    one prefill, then one batched step per remaining token: every document's logits equal its
    own forward's. All docs are prompt + the same number of new tokens; cu_seqlens packs the
    prompts."""
    new_tokens = docs[0].shape[1] - prompt_lengths[0]
    expected = [model(doc) for doc in docs]
    prompts = torch.cat([doc[:, :n] for doc, n in zip(docs, prompt_lengths, strict=True)], 1)
    logits, cache = model.prefill(prompts, cu_seqlens=cu_seqlens)
    prompt_logits = [exp[:, :n] for exp, n in zip(expected, prompt_lengths, strict=True)]
    assert_close("prefill logits", logits, torch.cat(prompt_logits, dim=1), tol)
    for step in range(new_tokens):
        at = [n + step for n in prompt_lengths]  # each document's next position
        next_ids = torch.cat([doc[:, t : t + 1] for doc, t in zip(docs, at, strict=True)])
        logits, cache = model.step(next_ids, cache)
        step_logits = [exp[:, t : t + 1] for exp, t in zip(expected, at, strict=True)]
        assert_close(f"logits of step {step}", logits, torch.cat(step_logits), tol)
