"""Context parallelism: a sequence split along its length across 2, 3 and 4 gloo ranks gives
the unsplit scan's output, final state and every gradient; packed sequences whose boundaries
fall inside or across pieces included."""

from __future__ import annotations

import pytest
import torch
from distributed_helpers import assert_close, run_workers

FILE = __file__


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_context_parallel_scan(nprocs):
    run_workers(FILE, "scan_worker", nprocs)


def _split_points(total: int, lengths: list[int]) -> list[int]:
    assert sum(lengths) == total
    points = [0]
    for n in lengths:
        points.append(points[-1] + n)
    return points


def _gather_cat(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's piece, concatenated along dim in rank order (pieces may differ in length
    along dim)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    pieces = [None] * world
    dist.all_gather_object(pieces, t.detach())
    return torch.cat(pieces, dim=dim)


def _summed(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def _check(inputs: dict, lengths: list[int], softplus: bool) -> None:
    import torch.distributed as dist

    from selective_scan import selective_scan_fn
    from selective_scan.distributed import context_parallel_scan

    rank = dist.get_rank()
    floats = [k for k, v in inputs.items() if v is not None and v.is_floating_point()]
    ref = {k: (v.clone().requires_grad_(True) if k in floats else v) for k, v in inputs.items()}
    out_ref, last_ref = selective_scan_fn(**ref, delta_softplus=softplus, return_last_state=True)
    gen = torch.Generator().manual_seed(11)
    w_out = torch.randn(out_ref.shape, generator=gen)
    w_last = torch.randn(last_ref.shape, generator=gen)
    ((out_ref * w_out).sum() + (last_ref * w_last).sum()).backward()

    bounds = _split_points(inputs["u"].shape[-1], lengths)
    t0, t1 = bounds[rank], bounds[rank + 1]
    # constant B/C are whole on every rank
    pieces = ("u", "delta", "z", *(k for k in ("B", "C") if inputs[k].dim() > 2))
    mine = {}
    for k, v in inputs.items():
        if v is None or k not in floats:
            mine[k] = v
        elif k in pieces:
            mine[k] = v[..., t0:t1].clone().requires_grad_(True)
        else:
            mine[k] = v.clone().requires_grad_(True)
    out, last = context_parallel_scan(**mine, delta_softplus=softplus, return_last_state=True)
    # The final state is replicated: one rank's loss uses it.
    loss = (out * w_out[..., t0:t1]).sum() + (last * w_last).sum() * (rank == 0)
    loss.backward()
    assert_close(_gather_cat(out), out_ref, "out")
    assert_close(last, last_ref, "last_state")
    for k in floats:
        grad = _gather_cat(mine[k].grad) if k in pieces else _summed(mine[k].grad)
        assert_close(grad, ref[k].grad, f"grad of {k}", rtol=2e-5, atol=2e-5)


def scan_worker():
    import torch.distributed as dist
    from helpers import make_inputs

    n = dist.get_world_size()
    even = [12] * n
    uneven = [5 + 3 * r for r in range(n)]  # 5, 8, 11, 14
    total_uneven = sum(uneven)
    # batch of 2, everything optional given, variable B, grouped C
    inputs = make_inputs(batch=2, dim=6, dstate=4, seqlen=12 * n, b_form="variable",
                         c_form="grouped", groups=3, initial_state=True, device="cpu")  # fmt: skip
    _check(inputs, even, softplus=True)
    # uneven pieces, constant B, no z, no initial state, no softplus
    inputs = make_inputs(batch=2, dim=6, dstate=4, seqlen=total_uneven, b_form="constant",
                         c_form="variable", z=False, device="cpu")  # fmt: skip
    _check(inputs, uneven, softplus=False)
    # packed sequences: boundaries inside pieces, one sequence across every middle piece, an
    # empty one, one ending exactly at a piece's end
    bounds = _split_points(total_uneven, uneven)
    cu = [0, 2, 2, bounds[1], total_uneven - 3, total_uneven]
    inputs = make_inputs(batch=1, dim=6, dstate=4, seqlen=total_uneven, b_form="variable",
                         c_form="variable", initial_state=True, cu_seqlens=cu,
                         device="cpu")  # fmt: skip
    _check(inputs, uneven, softplus=True)
