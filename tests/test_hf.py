"""selective_scan.hf: transformers' Mamba model on our operators matches transformers' own
PyTorch path (prefill, cached decoding, generation, a training step), on CPU tensors.

Needs the optional ``transformers`` package (the ``hf`` extra); the module is skipped without it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from collections import Counter

import pytest
import torch
from helpers import assert_close

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
)
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402

from selective_scan import hf  # noqa: E402

# Tiny and odd-sized: dstate 5, intermediate size 22, time-step rank 3.
CONFIG = dict(
    vocab_size=50, hidden_size=11, state_size=5, num_hidden_layers=2, expand=2, conv_kernel=4,
    time_step_rank=3,
)  # fmt: skip
LAYERS = CONFIG["num_hidden_layers"]


@pytest.fixture(autouse=True)
def restore_transformers():
    """Every test leaves transformers as it found it."""
    yield
    hf.unpatch_transformers()


@pytest.fixture
def model() -> MambaForCausalLM:
    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(**CONFIG)).eval()


@contextlib.contextmanager
def our_kernels():
    """Patch transformers; yields a Counter of the calls the model makes to each patched
    global (so a test can check that the fast path actually ran)."""
    calls = Counter()

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in hf.patch_transformers().items():
        setattr(modeling_mamba, name, counting(name, fn))
    try:
        yield calls
    finally:
        hf.unpatch_transformers()


def input_ids(batch: int = 2, seqlen: int = 7, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (batch, seqlen), generator=gen)


def test_patch_is_idempotent_and_reversible():
    names = ("mamba_selective_scan", "mamba_selective_state_update", "mamba_inner_fn",
             "causal_conv1d_fn", "causal_conv1d_update")  # fmt: skip
    originals = {name: getattr(modeling_mamba, name) for name in names}
    first = hf.patch_transformers()
    assert sorted(first) == sorted(names)
    assert hf.patch_transformers() == first
    assert all(getattr(modeling_mamba, name) is fn for name, fn in first.items())
    assert sorted(hf.unpatch_transformers()) == sorted(names)
    assert all(getattr(modeling_mamba, name) is fn for name, fn in originals.items())


def test_unknown_transformers_layout_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "fake_modeling", types.ModuleType("fake_modeling"))
    with pytest.raises(RuntimeError, match="has none of"):
        hf.patch_transformers("fake_modeling")


def test_prefill_matches_torch_path(model):
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
        with our_kernels() as calls:
            logits = model(ids).logits
    assert calls["mamba_selective_scan"] == LAYERS and calls["causal_conv1d_fn"] == LAYERS
    assert_close("logits", logits, expected, 1e-5)


def decode(model, ids: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], object]:
    """Prefill on ids, then ``steps`` cached steps on fixed tokens; returns every logits and
    the cache."""
    tokens = input_ids(ids.shape[0], steps, seed=1)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = [out.logits]
        for t in range(steps):
            out = model(tokens[:, t : t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
    return logits, out.cache


def test_cached_decoding_matches_torch_path(model, backend):
    steps = 3
    expected, expected_cache = decode(model, input_ids(), steps)
    with our_kernels() as calls:
        logits, cache = decode(model, input_ids(), steps)
    assert calls["mamba_selective_state_update"] == LAYERS * steps
    assert calls["causal_conv1d_update"] == LAYERS * steps
    for i, (actual, want) in enumerate(zip(logits, expected, strict=True)):
        assert_close(f"logits of call {i}", actual, want, 1e-5)
    for layer in range(LAYERS):
        for get in ("get_recurrent_state", "get_conv_state"):
            actual = getattr(cache, get)(layer)
            assert_close(f"{get}({layer})", actual, getattr(expected_cache, get)(layer), 1e-5)


def test_generate_matches_torch_path(model):
    ids = input_ids(seqlen=5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    with our_kernels() as calls:
        generated = model.generate(ids, **kwargs)
    assert calls["mamba_selective_state_update"] > 0
    assert torch.equal(generated, expected)


def training_step(model) -> tuple[torch.Tensor, dict]:
    model.train()
    ids = input_ids(seqlen=9)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def test_training_step_matches_torch_path(model):
    expected_loss, expected_grads = training_step(copy.deepcopy(model))
    with our_kernels() as calls:
        loss, grads = training_step(copy.deepcopy(model))
    assert calls["mamba_inner_fn"] == LAYERS  # the fused layer, not the unfused fallback
    assert_close("loss", loss, expected_loss, 1e-6)
    assert sorted(grads) == sorted(expected_grads)
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, expected_grads[name], 1e-5)
