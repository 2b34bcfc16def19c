"""Train the selective-copying LM on several processes: tensor parallelism x FSDP2.

    torchrun --nproc-per-node 2 -m selective_scan.apps.copying_distributed --steps 20
    torchrun --nproc-per-node 4 -m selective_scan.apps.copying_distributed --tp 2
    torchrun --nproc-per-node 8 -m selective_scan.apps.copying_distributed --tp 2 --compile

The processes form a (dp, tp) mesh: world = dp x tp. Every Mamba layer's channels are split
over the tp ranks (``parallelize_mamba``); every block, then the whole model, is sharded over
the dp ranks with FSDP2 (``fully_shard``), each dp rank training on its rows of every batch.
Batches come from one seeded generator on every rank, so the run is a function of the seed and
equals single-process training up to float32 rounding. gloo on CPU, nccl on GPUs (one per
process). ``--save DIR`` writes a torch.distributed.checkpoint checkpoint at the end, which
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns into a state dict of the
single-process MambaLMHeadModel.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..distributed import checkpoint_state_dict, fsdp_shard_placement, parallelize_mamba
from .copying_task import SelectiveCopying
from .copying_train import PRESETS, build_model, warmup_stable_decay


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients' global norm to max_norm; returns the norm before clipping.

    Gradients live on different meshes (tensor-parallel layers on (dp, tp), the rest on dp),
    which one torch.nn.utils.clip_grad_norm_ call cannot combine: each mesh's norm is computed
    on its own, then the squares are added."""
    groups = defaultdict(list)
    for p in model.parameters():
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups[id(mesh)].append(p)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (divides world)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="sizes (default: gpu with CUDA, else cpu)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile every block")
    parser.add_argument("--save", default=None, help="directory of a DCP checkpoint at the end")
    args = parser.parse_args(argv)
    # FSDP2 warns that a block returns a view (the residual stream passed through): the model
    # never writes into it in place, which is what the warning is about.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the number of processes {world}")
    dp = world // args.tp
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    settings = PRESETS[args.preset or ("gpu" if cuda else "cpu")]
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    if settings.batch % dp:
        raise SystemExit(f"the batch {settings.batch} must be divisible by dp = {dp}")
    task = SelectiveCopying(settings.context_len, settings.num_data, settings.num_symbols)
    model = build_model(settings, task.vocab_size, device, args.seed)  # same weights everywhere
    if args.tp > 1:
        parallelize_mamba(model, mesh["tp"])
    for block in model.backbone.layers:
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)

    # foreach=False: parameters on different meshes cannot share one foreach kernel.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_stable_decay(settings.steps))
    generator = torch.Generator().manual_seed(args.seed)
    rows = settings.batch // dp
    mine = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows)
    if rank == 0:
        print(f"{world} processes: dp={dp} x tp={args.tp}, {settings.steps} steps of "
              f"{settings.batch} rows x {task.seqlen} tokens", flush=True)  # fmt: skip
    start = time.perf_counter()
    for step in range(1, settings.steps + 1):
        batch: Tensor = task.sample(settings.batch, generator)[mine].to(device)
        loss, accuracy = task.loss_and_accuracy(model(batch[:, :-1]), batch)
        loss.backward()
        norm = clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step == 1 or step % max(1, settings.steps // 10) == 0 or step == settings.steps:
            stats = torch.stack([loss.detach(), accuracy]).float()
            dist.all_reduce(stats)
            stats /= world  # the mean over dp ranks (tp ranks repeat their dp rank's values)
            if rank == 0:
                seconds = time.perf_counter() - start
                print(f"step {step:5d}  loss {stats[0]:.4f}  answer accuracy {stats[1]:.3f}  "
                      f"grad norm {norm:.3f}  {seconds:.1f} s", flush=True)  # fmt: skip
    if args.save:
        dcp.save(checkpoint_state_dict(model), checkpoint_id=args.save)
        if rank == 0:
            print(f"checkpoint: {args.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch keeps the default process group past destroy_process_group (DTensor's caches hold
    # its DeviceMesh), so its gloo threads would be torn down in the interpreter's finalization,
    # where one still releasing a collective's tensors aborts the process ("terminate called
    # without an active exception"): leave without finalization once everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
