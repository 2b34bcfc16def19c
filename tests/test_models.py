"""The Mamba language model: mamba_ssm's parameter names, full-sequence logits against
token-by-token decoding and chunked or packed prefill, packed documents against each alone,
greedy generation, a compiled training step, the prefill exported, and the decode step exported
and packaged with the cache as explicit inputs and outputs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from model_helpers import (
    assert_cache_close,
    assert_packed_prefill_then_steps_match,
    compile_fullgraph,
    cu_seqlens_of,
    hermetic_compile,
    train,
)

from selective_scan.models import MambaLMHeadModel

VOCAB, N_LAYER, D_MODEL = 37, 2, 16  # the vocabulary pads to 40 (a multiple of 8)


def make_model(seed: int = 0, n_layer: int = N_LAYER) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    model = MambaLMHeadModel(
        D_MODEL, n_layer, VOCAB, ssm_cfg={"d_state": 4}, pad_vocab_size_multiple=8
    )
    return model.eval()


def tokens(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def no_compile_caches():
    """Module scope, so that the module-scoped exports and package are made under it too."""
    with hermetic_compile():
        yield


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_state_dict_has_mamba_ssm_names(model):
    """mamba_ssm's MambaLMHeadModel (RMSNorm, no MLP, tied embeddings), written out by hand."""
    mixer = ["A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
             "dt_proj.weight", "dt_proj.bias", "out_proj.weight"]  # fmt: skip
    expected = ["backbone.embedding.weight"]
    for i in range(N_LAYER):
        expected += [f"backbone.layers.{i}.mixer.{name}" for name in mixer]
        expected.append(f"backbone.layers.{i}.norm.weight")
    expected += ["backbone.norm_f.weight", "lm_head.weight"]
    assert list(model.state_dict()) == expected
    assert model.backbone.embedding.weight.shape == (40, D_MODEL)
    assert model.lm_head.weight is model.backbone.embedding.weight


@torch.no_grad()
def test_forward_matches_token_by_token_decoding(model):
    ids = tokens(batch=3, seqlen=12)
    expected = model(ids)
    assert expected.shape == (3, 12, 40)
    cache = model.allocate_inference_cache(batch_size=3, max_seqlen=12)
    for t in range(12):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", logits, expected[:, t : t + 1], 1e-5)


@torch.no_grad()
@pytest.mark.parametrize("prompt", [1, 3, 8], ids=lambda n: f"prompt={n}")
def test_prefill_then_steps_match_forward(model, prompt):
    ids = tokens(batch=2, seqlen=11, seed=prompt)
    expected = model(ids)
    logits, cache = model.prefill(ids[:, :prompt])
    assert_close("prefill logits", logits, expected[:, :prompt], 1e-6)
    for t in range(prompt, 11):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", logits, expected[:, t : t + 1], 1e-5)


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1, 2, 5], [6, 2]], ids=str)
def test_chunked_prefill_then_steps_match_forward(model, chunks):
    """Each chunk continues from the cache of the one before (chunks shorter than d_conv too)."""
    ids = tokens(batch=2, seqlen=11, seed=7)
    expected = model(ids)
    cache, start = None, 0
    for n in chunks:
        logits, cache = model.prefill(ids[:, start : start + n], cache)
        assert_close(f"logits of chunk at {start}", logits, expected[:, start : start + n], 1e-5)
        start += n
    for t in range(start, 11):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        assert_close(f"logits at {t}", logits, expected[:, t : t + 1], 1e-5)


@torch.no_grad()
def test_packed_forward_matches_each_document(model):
    lengths = [4, 1, 7, 2]
    ids = tokens(batch=1, seqlen=sum(lengths), seed=8)
    logits = model(ids, cu_seqlens=cu_seqlens_of(lengths))
    expected = torch.cat([model(doc) for doc in ids.split(lengths, dim=1)], dim=1)
    assert_close("logits", logits, expected, 1e-5)


@torch.no_grad()
def test_packed_prefill_then_batch_steps_match_each_document(model):
    """Prompts packed into one prefill; the cache then holds one row per prompt."""
    prompt_lengths, new_tokens = [3, 1, 5], 2
    docs = [tokens(1, n + new_tokens, seed=10 + n) for n in prompt_lengths]
    assert_packed_prefill_then_steps_match(
        model, docs, prompt_lengths, cu_seqlens_of(prompt_lengths), 1e-5
    )


def test_prefill_rejects_a_cache_of_another_depth(model):
    cache = model.allocate_inference_cache(batch_size=2)
    with pytest.raises(ValueError, match=r"one \(conv_state, ssm_state\) pair per layer, 2, got 1"):
        model.prefill(tokens(batch=2, seqlen=3), cache[:1])


@torch.no_grad()
def test_step_leaves_the_given_cache_unchanged(model):
    _, cache = model.prefill(tokens(batch=2, seqlen=5))
    before = [tuple(t.clone() for t in layer) for layer in cache]
    _, new_cache = model.step(tokens(batch=2, seqlen=1, seed=9), cache)
    for (conv, ssm), (conv0, ssm0), (new_conv, new_ssm) in zip(
        cache, before, new_cache, strict=True
    ):
        assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)
        assert not torch.equal(new_conv, conv0) and not torch.equal(new_ssm, ssm0)


@torch.no_grad()
def test_generate_is_deterministic_greedy_decoding(model):
    prompt = tokens(batch=2, seqlen=4, seed=3)
    generated = model.generate(prompt, max_new_tokens=6)
    assert generated.shape == (2, 10)
    assert torch.equal(generated[:, :4], prompt)
    assert torch.equal(model.generate(prompt, max_new_tokens=6), generated)
    # Each new token is the argmax of the full forward's logits at the position before it.
    greedy = model(generated).argmax(-1)
    assert torch.equal(generated[:, 4:], greedy[:, 3:-1])


def test_compiled_training_step_has_no_graph_break_and_matches_eager():
    # One layer keeps Inductor's compile time down; the layers are alike.
    eager = make_model(seed=2, n_layer=1).train()
    model = copy.deepcopy(eager)
    compiled, check_one_graph = compile_fullgraph(model)
    ids = tokens(batch=2, seqlen=16, seed=4)

    def next_token_loss(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    losses = train(compiled, next_token_loss, ids)
    check_one_graph()
    expected_losses = train(eager, next_token_loss, ids)
    for step, (loss, expected) in enumerate(zip(losses, expected_losses, strict=True)):
        assert_close(f"loss of step {step}", loss, expected, 1e-5)
    for (name, param), expected in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert_close(f"{name} after training", param, expected, 1e-5)


class Method(torch.nn.Module):
    """One method of the model (prefill, step) as a module's forward, for torch.export."""

    def __init__(self, model: MambaLMHeadModel, name: str):
        super().__init__()
        self.model = model
        self.name = name

    def forward(self, *inputs):
        return getattr(self.model, self.name)(*inputs)


def export(model, name: str, inputs: tuple, dims: tuple):
    # forward(*inputs) has one parameter: the dims of all inputs go in one tuple.
    return torch.export.export(Method(model, name), inputs, dynamic_shapes=(dims,))


BATCH = torch.export.Dim("batch", min=2)  # sizes 0 and 1 would specialize


@pytest.fixture(scope="module")
def exported_prefill(model):
    dims = {0: BATCH, 1: torch.export.Dim("seqlen", min=2)}
    return export(model, "prefill", (tokens(3, 9),), (dims,))


@pytest.mark.parametrize(("batch", "seqlen"), [(2, 2), (4, 70)])
def test_exported_prefill_matches_eager(exported_prefill, model, batch, seqlen):
    ids = tokens(batch, seqlen, seed=seqlen)
    with torch.no_grad():
        expected_logits, expected_cache = model.prefill(ids)
        logits, cache = exported_prefill.module()(ids)
    assert_close("logits", logits, expected_logits, 1e-6)
    assert_cache_close(cache, expected_cache, 1e-6)


def decode_inputs(model, batch: int, seed: int):
    """A token and the cache after a prompt of 5 tokens."""
    with torch.no_grad():
        _, cache = model.prefill(tokens(batch, 5, seed=seed))
    return tokens(batch, 1, seed=seed + 1), cache


@pytest.fixture(scope="module")
def exported_step(model):
    cache_dims = [({0: BATCH}, {0: BATCH})] * N_LAYER
    return export(model, "step", decode_inputs(model, batch=3, seed=0), ({0: BATCH}, cache_dims))


def assert_step_matches_eager(run, model, batch: int, tol: float) -> None:
    input_ids, cache = decode_inputs(model, batch, seed=batch)
    with torch.no_grad():
        expected_logits, expected_cache = model.step(input_ids, cache)
        logits, next_cache = run(input_ids, cache)
    assert_close("logits", logits, expected_logits, tol)
    assert_cache_close(next_cache, expected_cache, tol)


@pytest.mark.parametrize("batch", [2, 5])
def test_exported_decode_step_matches_eager(exported_step, model, batch):
    assert_step_matches_eager(exported_step.module(), model, batch, 1e-6)


def test_exported_decode_step_save_load_round_trip(exported_step, model, tmp_path):
    path = tmp_path / "decode_step.pt2"
    torch.export.save(exported_step, path)
    assert_step_matches_eager(torch.export.load(path).module(), model, batch=4, tol=1e-6)


@pytest.fixture(scope="module")
def decode_package(exported_step, tmp_path_factory):
    """AOTInductor compiles for tens of seconds on this 2-core machine: once per module."""
    path = tmp_path_factory.mktemp("aoti") / "decode_step.pt2"
    return torch._inductor.aoti_compile_and_package(exported_step, package_path=str(path))


@pytest.mark.parametrize("batch", [2, 6])
def test_aoti_decode_step_matches_eager(decode_package, model, batch):
    # Inductor fuses the pointwise math of the step: last-bit differences.
    loaded = torch._inductor.aoti_load_package(decode_package)
    assert_step_matches_eager(loaded, model, batch, 1e-5)
