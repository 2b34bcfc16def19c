"""DTensor sharding rules of the operators: selective_scan_fn and selective_state_update on
DTensors equal the single-process call, forward and every gradient (2 and 4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from distributed_helpers import assert_close, run_workers

FILE = __file__


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ops_on_dtensors(nprocs):
    run_workers(FILE, "worker", nprocs)


def worker():
    """One launch per rank count (each costs seconds of CPU): the scan, then the step."""
    scan_worker()
    state_update_worker()


def _loss_weights(out, last, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen), torch.randn(last.shape, generator=gen)


def _check_scan(mesh, inputs, placements, softplus=True, expect=None):
    """Run selective_scan_fn on the inputs distributed as ``placements`` (name -> placement)
    and compare out, last_state and every gradient with the single-process call."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from selective_scan import selective_scan_fn

    def run(args):
        out, last = selective_scan_fn(**args, delta_softplus=softplus, return_last_state=True)
        return out, last

    ref_in = {k: (v.clone().requires_grad_(v.is_floating_point()) if v is not None else None)
              for k, v in inputs.items()}  # fmt: skip
    out_ref, last_ref = run(ref_in)
    w_out, w_last = _loss_weights(out_ref, last_ref)
    ((out_ref * w_out).sum() + (last_ref * w_last).sum()).backward()

    dt_in = {}
    for k, v in inputs.items():
        if v is None:
            dt_in[k] = None
            continue
        d = distribute_tensor(v, mesh, [placements[k]])
        dt_in[k] = d.detach().requires_grad_(v.is_floating_point())
    out, last = run(dt_in)
    assert isinstance(out, DTensor), type(out)
    if expect is not None:
        assert tuple(out.placements) == (expect,), out.placements
        assert tuple(last.placements) == (expect,), last.placements
    w_out_d = distribute_tensor(w_out, mesh, out.placements)
    w_last_d = distribute_tensor(w_last, mesh, last.placements)
    ((out * w_out_d).sum() + (last * w_last_d).sum()).backward()
    assert_close(out.full_tensor(), out_ref, "out")
    assert_close(last.full_tensor(), last_ref, "last_state")
    for k, v in dt_in.items():
        if v is not None and v.is_floating_point():
            assert_close(v.grad.full_tensor(), ref_in[k].grad, f"grad of {k}")


def scan_worker():
    import torch.distributed as dist
    from helpers import make_inputs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import selective_scan.distributed  # noqa: F401 (registers the rules)

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
    channel = {"u": S1, "delta": S1, "A": S0, "D": S0, "z": S1, "delta_bias": S0,
               "initial_state": S1, "cu_seqlens": R}  # fmt: skip
    batch = {"u": S0, "delta": S0, "A": R, "D": R, "z": S0, "delta_bias": R,
             "initial_state": S0}  # fmt: skip

    # channels: variable B replicated, grouped C sharded on its groups (n groups)
    inputs = make_inputs(batch=2, dim=8, dstate=4, seqlen=20, b_form="variable",
                         c_form="grouped", groups=n, initial_state=True, device="cpu")  # fmt: skip
    _check_scan(mesh, inputs, {**channel, "B": R, "C": S1}, expect=S1)
    # channels: constant B sharded, one-group C replicated, no z
    inputs = make_inputs(batch=2, dim=8, dstate=4, seqlen=20, b_form="constant",
                         c_form="grouped", groups=1, z=False, device="cpu")  # fmt: skip
    _check_scan(mesh, inputs, {**channel, "B": S0, "C": R}, softplus=False, expect=S1)
    # batch: variable B and C sharded with the batch, constant ones replicated
    inputs = make_inputs(batch=n, dim=8, dstate=4, seqlen=20, b_form="variable",
                         c_form="constant", initial_state=True, device="cpu")  # fmt: skip
    _check_scan(mesh, inputs, {**batch, "B": S0, "C": R}, expect=S0)
    # packed sequences, channel-sharded, boundaries anywhere
    inputs = make_inputs(batch=1, dim=8, dstate=4, seqlen=30, b_form="variable",
                         c_form="variable", initial_state=True, cu_seqlens=[0, 7, 7, 19, 30],
                         device="cpu")  # fmt: skip
    _check_scan(mesh, inputs, {**channel, "B": R, "C": R}, expect=S1)
    # other placements are redistributed: delta replicated, D sharded on the wrong side...
    inputs = make_inputs(batch=2, dim=8, dstate=4, seqlen=20, device="cpu")
    _check_scan(mesh, inputs, {**channel, "delta": R, "B": S0, "C": R, "z": S0})
    # a sequence-sharded u is rejected with a message naming context parallelism
    with pytest.raises(Exception, match="context_parallel_scan"):
        _check_scan(mesh, inputs, {**channel, "u": S2, "delta": S2, "B": R, "C": R})


def state_update_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import selective_scan.distributed  # noqa: F401 (registers the rules)
    from selective_scan import selective_state_update

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    gen = torch.Generator().manual_seed(3)
    batch, dim, dstate = n, 8, 4
    args = {
        "x": torch.randn(batch, dim, generator=gen),
        "dt": torch.rand(batch, dim, generator=gen),
        "A": -torch.rand(dim, dstate, generator=gen),
        "B": torch.randn(batch, dstate, generator=gen),
        "C": torch.randn(batch, dstate, generator=gen),
        "D": torch.randn(dim, generator=gen),
        "z": torch.randn(batch, dim, generator=gen),
        "dt_bias": torch.rand(dim, generator=gen),
    }
    state0 = torch.randn(batch, dim, dstate, generator=gen)
    for placement, per_arg in (
        (Shard(1), {"x": Shard(1), "dt": Shard(1), "A": Shard(0), "D": Shard(0),
                    "z": Shard(1), "dt_bias": Shard(0)}),
        (Shard(0), {"x": Shard(0), "dt": Shard(0), "B": Shard(0), "C": Shard(0),
                    "z": Shard(0)}),
        (Replicate(), {}),
    ):  # fmt: skip
        ref_state = state0.clone()
        ref_out = selective_state_update(ref_state, **args, dt_softplus=True)
        state = distribute_tensor(state0, mesh, [placement])
        dargs = {
            k: distribute_tensor(v, mesh, [per_arg.get(k, Replicate())]) for k, v in args.items()
        }
        # x replicated while state is sharded: x is redistributed, the state is not
        dargs["x"] = distribute_tensor(args["x"], mesh, [Replicate()])
        out = selective_state_update(state, **dargs, dt_softplus=True)
        assert_close(out.full_tensor(), ref_out, f"out ({placement})")
        assert_close(state.full_tensor(), ref_state, f"state updated in place ({placement})")
    # a state the step would have to redistribute is rejected
    state = distribute_tensor(state0, mesh, [Shard(2)])
    dargs = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in args.items()}
    with pytest.raises(Exception, match="writes into state"):
        selective_state_update(state, **dargs, dt_softplus=True)
