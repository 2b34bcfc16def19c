"""The Mamba language model on a GPU, where the scan and the decode step run on the Triton
kernels: a compiled training step against eager, full-sequence logits against prefill and
token-by-token decoding, the whole-model decode step replayed from a CUDA graph, packed
documents against each alone, chunked prefill, and the prefill exported (save/load) and
packaged with AOTInductor. Needs CUDA; test_models.py checks the same on the CPU."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, capture
from model_helpers import (
    assert_cache_close,
    assert_packed_prefill_then_steps_match,
    compile_fullgraph,
    cu_seqlens_of,
    train,
)

from selective_scan.models import MambaLMHeadModel
from selective_scan.models.mixer_seq_simple import Cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DEVICE = "cuda"
VOCAB, N_LAYER, D_MODEL = 37, 2, 32  # d_inner 64, dt_rank 2, d_state 16; vocabulary padded to 40
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# Two float32 computations of the same logits (Triton's MUFU approximations, other cuBLAS shapes,
# Inductor's fusions). bfloat16: the layers' outputs and the cached ssm_state are rounded to
# bf16 (a relative 2^-9) at different points of the two computations.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# The same computation (a CUDA graph's replay of the step; the exported prefill, whose conv is
# a sum of shifted products instead of cuDNN's): last-bit differences at most.
SAME_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_kernels_in_float32():
    """The Triton kernels, and cuDNN's eager conv in true float32: TF32 is on by default for
    cuDNN convolutions, and the compiled graph computes the conv without cuDNN."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELECTIVE_SCAN_BACKEND", "triton")
        yield
    torch.backends.cudnn.allow_tf32 = tf32


def make_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, n_layer: int = N_LAYER
) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    return MambaLMHeadModel(
        D_MODEL, n_layer, VOCAB, pad_vocab_size_multiple=8, device=DEVICE, dtype=dtype
    ).eval()


def tokens(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=gen).to(DEVICE)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return cu_seqlens_of(lengths).to(DEVICE)


@pytest.fixture(scope="module")
def model() -> MambaLMHeadModel:
    return make_model()


def test_compiled_training_step_has_no_graph_break_and_matches_eager():
    """300 tokens: the scan runs in several ranges and the backward over several checkpoints."""
    eager = make_model(seed=2).train()
    model = copy.deepcopy(eager)
    compiled, check_one_graph = compile_fullgraph(model)
    ids = tokens(batch=2, seqlen=300, seed=4)

    def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def grads(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(next_token_loss(module(ids)), list(module.parameters()))

    names = [name for name, _ in model.named_parameters()]
    for name, grad, expected in zip(names, grads(compiled), grads(eager), strict=True):
        assert_close(f"grad of {name}", grad, expected, TOL[torch.float32])
    losses = train(compiled, next_token_loss, ids)
    check_one_graph()
    expected_losses = train(eager, next_token_loss, ids)
    for step, (loss, expected) in enumerate(zip(losses, expected_losses, strict=True)):
        assert_close(f"loss of step {step}", loss, expected, TOL[torch.float32])
    for (name, param), expected in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert_close(f"{name} after training", param, expected, TOL[torch.float32])


DECODE_CASES = [
    pytest.param(torch.float32, 0, id="fp32-steps_from_zero_cache"),
    pytest.param(torch.float32, 5, id="fp32-prompt=5"),
    pytest.param(torch.bfloat16, 5, id="bf16-prompt=5"),
]


@torch.no_grad()
@pytest.mark.parametrize(("dtype", "prompt"), DECODE_CASES)
def test_prefill_then_steps_match_forward(dtype, prompt):
    """prompt=0 decodes every token from allocate_inference_cache's zero cache. The cache the
    steps end in is compared too: at this random init the skip D * x dominates the layers'
    outputs, so that a lost ssm_state would move the logits by less than 0.3%."""
    model = make_model(dtype=dtype)
    ids = tokens(batch=3, seqlen=16, seed=prompt)
    expected = model(ids)
    if prompt:
        logits, cache = model.prefill(ids[:, :prompt])
        assert_close("prefill logits", logits, expected[:, :prompt], TOL[dtype])
    else:
        cache = model.allocate_inference_cache(batch_size=3)
    for t in range(prompt, 16):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", logits, expected[:, t : t + 1], TOL[dtype])
    assert_cache_close(cache, model.prefill(ids)[1], TOL[dtype])


@torch.no_grad()
@DTYPES
def test_decode_step_replays_from_a_cuda_graph(dtype):
    """The whole model's step captured once with static input ids and cache; each replay after
    copying the next token and the graph's new cache in matches eager stepping."""
    model = make_model(dtype=dtype)
    ids = tokens(batch=2, seqlen=12, seed=5)
    _, cache = model.prefill(ids[:, :4])
    static_ids = ids[:, 4:5].clone()
    static_cache = [(conv.clone(), ssm.clone()) for conv, ssm in cache]
    # The step leaves its cache unchanged: the warm-up calls do not advance static_cache.
    graph, (graph_logits, graph_cache) = capture(lambda: model.step(static_ids, static_cache))
    for t in range(4, 12):
        static_ids.copy_(ids[:, t : t + 1])
        graph.replay()
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", graph_logits, logits, SAME_TOL[dtype])
        assert_cache_close(graph_cache, cache, SAME_TOL[dtype])
        for (conv, ssm), (new_conv, new_ssm) in zip(static_cache, graph_cache, strict=True):
            conv.copy_(new_conv)
            ssm.copy_(new_ssm)


@torch.no_grad()
def test_packed_forward_matches_each_document(model):
    """Documents shorter than the conv, and one over a checkpoint interval (128 steps)."""
    lengths = [5, 1, 130, 2]
    ids = tokens(batch=1, seqlen=sum(lengths), seed=8)
    logits = model(ids, cu_seqlens=cu_seqlens(lengths))
    expected = torch.cat([model(doc) for doc in ids.split(lengths, dim=1)], dim=1)
    assert_close("logits", logits, expected, TOL[torch.float32])


@torch.no_grad()
def test_packed_prefill_then_batch_steps_match_each_document(model):
    """Prompts packed into one prefill; the cache then holds one row per prompt."""
    prompt_lengths, new_tokens = [3, 1, 9], 3
    docs = [tokens(1, n + new_tokens, seed=10 + n) for n in prompt_lengths]
    assert_packed_prefill_then_steps_match(
        model, docs, prompt_lengths, cu_seqlens(prompt_lengths), TOL[torch.float32]
    )


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1, 2, 5], [6, 140]], ids=str)
def test_chunked_prefill_then_steps_match_forward(model, chunks):
    """Each chunk continues from the cache of the one before (chunks shorter than d_conv, and
    one over a checkpoint interval)."""
    seqlen = sum(chunks) + 4
    ids = tokens(batch=2, seqlen=seqlen, seed=7)
    expected = model(ids)
    cache, start = None, 0
    for n in chunks:
        logits, cache = model.prefill(ids[:, start : start + n], cache)
        chunk_expected = expected[:, start : start + n]
        assert_close(f"logits of chunk at {start}", logits, chunk_expected, TOL[torch.float32])
        start += n
    for t in range(start, seqlen):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", logits, expected[:, t : t + 1], TOL[torch.float32])
    assert_cache_close(cache, model.prefill(ids)[1], TOL[torch.float32])


# Export and AOTInductor last in the file: the slowest tests (export traces the Triton
# launchers, AOTInductor compiles the kernels and a C++ wrapper).


class Prefill(torch.nn.Module):
    """The model's prefill from a zero cache as a module's forward, for torch.export."""

    def __init__(self, model: MambaLMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        return self.model.prefill(input_ids)


@pytest.fixture(scope="module")
def exported_prefill(model) -> torch.export.ExportedProgram:
    # Sizes 0 and 1 would specialize: both dims are dynamic from 2 up.
    dims = {0: torch.export.Dim("batch", min=2), 1: torch.export.Dim("seqlen", min=2)}
    return torch.export.export(Prefill(model), (tokens(3, 9),), dynamic_shapes=(dims,))


def assert_prefill_matches_eager(run: Callable, model, batch: int, seqlen: int) -> None:
    ids = tokens(batch, seqlen, seed=seqlen)
    with torch.no_grad():
        expected_logits, expected_cache = model.prefill(ids)
        logits, cache = run(ids)
    assert_close("logits", logits, expected_logits, SAME_TOL[torch.float32])
    assert_cache_close(cache, expected_cache, SAME_TOL[torch.float32])


@pytest.mark.parametrize(("batch", "seqlen"), [(2, 2), (4, 300)])
def test_exported_prefill_matches_eager(exported_prefill, model, batch, seqlen):
    assert_prefill_matches_eager(exported_prefill.module(), model, batch, seqlen)


def test_exported_prefill_save_load_round_trip(exported_prefill, model, tmp_path):
    path = tmp_path / "prefill.pt2"
    torch.export.save(exported_prefill, path)
    assert_prefill_matches_eager(torch.export.load(path).module(), model, batch=5, seqlen=70)


def test_aoti_package_of_the_prefill_builds(exported_prefill, tmp_path):
    """Built, not loaded: loading AOTInductor packages crashed on the torch 2.11 CUDA image the
    GPU tests run on; test_models.py runs a CPU package of the decode step."""
    package = tmp_path / "prefill_aoti.pt2"
    torch._inductor.aoti_compile_and_package(exported_prefill, package_path=str(package))
    assert package.stat().st_size > 0
