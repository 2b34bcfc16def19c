"""Tensor parallelism of the Mamba layer (parallelize_mamba) on 2 and 4 gloo ranks: the layer's
forward, final states and every gradient, and MambaLMHeadModel's training steps and generate,
equal the single-process model on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed_helpers import assert_close, run_workers

FILE = __file__


@pytest.mark.parametrize("nprocs", [2, 4])
def test_tensor_parallel_mamba(nprocs):
    run_workers(FILE, "tp_worker", nprocs)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare_grads(model, ref, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{what}: no gradient for {name}"
        assert_close(_full(param.grad), ref_params[name].grad, f"{what}: grad of {name}")


def _check_layer(mesh) -> None:
    import torch.distributed as dist

    from selective_scan import Mamba
    from selective_scan.distributed import parallelize_mamba

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Mamba(d_model=16, d_state=4, d_conv=4, expand=2, layer_idx=0)
    with torch.no_grad():  # non-trivial values everywhere
        ref.D.normal_()
        ref.conv1d.bias.normal_()
    layer = parallelize_mamba(copy.deepcopy(ref), mesh)
    for name, param in layer.named_parameters():
        assert_close(_full(param), dict(ref.named_parameters())[name], f"whole {name}")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 10, 16, generator=gen)
    w = torch.randn(2, 10, 16, generator=gen)

    # the plain forward
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x_ref), layer(x_tp)
    assert_close(out, out_ref, "out")
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    assert_close(x_tp.grad, x_ref.grad, "grad of hidden_states")
    _compare_grads(layer, ref, "layer")

    # from given states, returning the final ones, packed sequences
    ref.zero_grad()
    layer.zero_grad()
    cu = torch.tensor([0, 3, 3, 8, 10])
    x1 = torch.randn(1, 10, 16, generator=gen)
    conv0 = torch.randn(4, 32, 4, generator=gen)
    ssm0 = torch.randn(4, 32, 4, generator=gen)
    chunk = slice(rank * 32 // world, (rank + 1) * 32 // world)
    out_ref, (conv_ref, ssm_ref) = ref(
        x1, cu_seqlens=cu, initial_states=(conv0, ssm0), return_final_states=True
    )
    out, (conv_tp, ssm_tp) = layer(
        x1, cu_seqlens=cu, initial_states=(conv0[:, chunk], ssm0[:, chunk]),
        return_final_states=True,
    )  # fmt: skip
    assert_close(out, out_ref, "out with states")
    assert_close(conv_tp, conv_ref[:, chunk], "final conv_state (this rank's channels)")
    assert_close(ssm_tp, ssm_ref[:, chunk], "final ssm_state (this rank's channels)")
    gw = torch.randn(ssm_ref.shape, generator=gen)
    ((out_ref * w[:1]).sum() + (ssm_ref * gw).sum()).backward()
    ((out * w[:1]).sum() + (ssm_tp * gw[:, chunk]).sum()).backward()
    _compare_grads(layer, ref, "layer with states")


def _check_lm(mesh) -> None:
    from selective_scan import MambaLMHeadModel
    from selective_scan.distributed import parallelize_mamba

    torch.manual_seed(0)
    ref = MambaLMHeadModel(d_model=16, n_layer=2, vocab_size=12, ssm_cfg={"d_state": 4})
    model = parallelize_mamba(copy.deepcopy(ref), mesh)
    gen = torch.Generator().manual_seed(2)
    # foreach=False: the model mixes DTensor (layers) and plain (embedding, norms) parameters
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        ids = torch.randint(0, 12, (2, 9), generator=gen)
        losses = []
        for m in (ref, model):
            logits = m(ids[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
            losses[-1].backward()
        assert_close(losses[1], losses[0], f"LM loss at step {step}")
        _compare_grads(model, ref, f"LM step {step}")
        for opt_m in (opt_ref, opt):
            opt_m.step()
            opt_m.zero_grad()
    prompt = torch.randint(0, 12, (2, 5), generator=gen)
    tokens_ref = ref.generate(prompt, max_new_tokens=6)
    tokens = model.generate(prompt, max_new_tokens=6)
    assert torch.equal(tokens, tokens_ref), (tokens, tokens_ref)
    logits_ref, _ = ref.prefill(prompt)
    logits, _ = model.prefill(prompt)
    assert_close(logits, logits_ref, "prefill logits")


def tp_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _check_layer(mesh)
    _check_lm(mesh)
