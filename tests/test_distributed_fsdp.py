"""FSDP2 (fully_shard on the LM's blocks) on 2 and 4 gloo ranks: losses and gradients of a few
AdamW steps equal single-process training on the whole batch. On 2 ranks also under
torch.compile, and a torch.distributed.checkpoint checkpoint reloads into the single-process
model and into a fresh sharded one; on 4 ranks also tensor parallelism x FSDP2 on a (2, 2)
mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed_helpers import assert_close, run_workers

FILE = __file__
VOCAB = 12


@pytest.mark.parametrize("nprocs", [2, 4])
def test_fsdp(nprocs, tmp_path):
    run_workers(FILE, "fsdp_worker", nprocs, checkpoint_dir=str(tmp_path))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _model():
    from selective_scan import MambaLMHeadModel

    torch.manual_seed(0)
    return MambaLMHeadModel(d_model=16, n_layer=2, vocab_size=VOCAB, ssm_cfg={"d_state": 4})


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _train_and_compare(ref, model, dp_rank: int, dp_size: int, what: str, steps: int = 3):
    """AdamW steps of ref on the whole batch and of model on this rank's rows of it; losses
    (averaged over the data-parallel ranks) and gradients must agree at every step."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    rows = 2
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (rows * dp_size, 9), generator=gen)
        loss_ref = _loss(ref, ids)
        loss_ref.backward()
        loss = _loss(model, ids[dp_rank * rows : (dp_rank + 1) * rows])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's loss; tensor-parallel ranks repeat theirs
        mean /= dist.get_world_size()
        assert_close(mean, loss_ref.detach(), f"{what}: loss at step {step}")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            assert_close(_full(param.grad), ref_params[name].grad, f"{what}: grad of {name}")
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()


def _shard(model, mesh, compile_blocks: bool = False):
    from torch.distributed.fsdp import fully_shard

    from selective_scan.distributed import fsdp_shard_placement

    for block in model.backbone.layers:
        if compile_blocks:
            block.compile(backend="aot_eager")
        fully_shard(block, mesh=mesh, shard_placement_fn=fsdp_shard_placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=fsdp_shard_placement)
    return model


def _check_tp_checkpoint(model, mesh, path: str) -> None:
    """A TP x FSDP2 checkpoint reloads into the single-process model and into a fresh
    TP x FSDP2 one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from selective_scan.distributed import (
        checkpoint_state_dict,
        load_checkpoint,
        parallelize_mamba,
    )

    dcp.save(checkpoint_state_dict(model), checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        dcp_to_torch_save(path, f"{path}.pt")
    dist.barrier()
    single = _model()
    single.load_state_dict(torch.load(f"{path}.pt"), strict=True)
    whole = dict(single.named_parameters())
    for name, param in model.named_parameters():
        assert_close(whole[name], _full(param), f"TP checkpoint reloaded: {name}")
    fresh = _shard(parallelize_mamba(_model(), mesh["tp"]), mesh["dp"])
    load_checkpoint(fresh, path)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert_close(_full(a), _full(b), f"TP checkpoint reloaded sharded: {name}")


def fsdp_worker(checkpoint_dir: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    ref, model = _model(), _shard(_model(), mesh)
    _train_and_compare(ref, model, rank, world, "FSDP2")
    if world == 4:  # tensor parallel x FSDP2 on a (dp, tp) = (2, 2) mesh
        from selective_scan.distributed import parallelize_mamba

        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model2 = parallelize_mamba(_model(), mesh2["tp"])
        _shard(model2, mesh2["dp"])
        _train_and_compare(_model(), model2, mesh2.get_local_rank("dp"), 2, "TP x FSDP2")
        _check_tp_checkpoint(model2, mesh2, f"{checkpoint_dir}/tp")
        return  # compile and the plain FSDP2 checkpoint: on 2 ranks (CPU time)

    # torch.compile of each block (aot_eager: dynamo and AOTAutograd trace the blocks, the
    # scan's operator included; no C++ compiler needed on the test machine)
    _train_and_compare(_model(), _shard(_model(), mesh, True), rank, world, "FSDP2, compiled")

    # a checkpoint of the sharded model reloads into the single-process one
    path = f"{checkpoint_dir}/fsdp"
    dcp.save(model.state_dict(), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(path, f"{checkpoint_dir}/whole.pt")
    dist.barrier()
    single = _model()
    single.load_state_dict(torch.load(f"{checkpoint_dir}/whole.pt"), strict=True)
    for name, param in model.named_parameters():
        assert_close(dict(single.named_parameters())[name], _full(param), f"reloaded {name}")
    # and into a fresh sharded model
    fresh = _shard(_model(), mesh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert_close(_full(a), _full(b), f"reloaded sharded {name}")
