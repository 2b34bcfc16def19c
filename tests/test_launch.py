"""kernels/launch.py on CPU: what each kernel is passed, and that kernels declare only what they
use (the direct launches themselves are tested on a GPU, tests/test_gpu.py)."""

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE, TRITON_RUNS
from helpers import float_inputs, make_inputs

from selective_scan import selective_scan_fn
from selective_scan.kernels import launch, scan_fwd_lanes

KERNELS = Path(launch.__file__).parent


def jit_kernels():
    """(file name, function) of every @triton.jit function in kernels/."""
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                yield pytest.param(node, id=f"{path.stem}.{node.name}")


@pytest.mark.parametrize("kernel", list(jit_kernels()))
def test_kernels_use_every_parameter(kernel):
    used = {n.id for statement in kernel.body for n in ast.walk(statement)
            if isinstance(n, ast.Name)}  # fmt: skip
    unused = [a.arg for a in kernel.args.args if a.arg not in used]
    assert not unused, f"{kernel.name} declares parameters it never reads: {unused}"


def test_kernel_arguments_keeps_parameters_and_launch_options():
    kernel = scan_fwd_lanes._scan_fwd_lanes_kernel
    arguments = {"u_ptr": 1, "cu_ptr": 2, "RL": 3, "LANES": 16, "PRE": 0, "num_warps": 4,
                 "maxnreg": 168}  # fmt: skip
    assert launch.kernel_arguments(kernel, arguments) == {
        "u_ptr": 1, "LANES": 16, "num_warps": 4, "maxnreg": 168,
    }  # fmt: skip


def test_plain_eager_rejects_wrappers_of_type_tensor():
    """A functional wrapper has type Tensor and may hide a fake tensor: not plain eager, with or
    without a fake inside (is_plain_eager reads the wrapper flags, not is_fake's walk)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    real = torch.randn(3)
    wrapped_fake = torch._to_functional_tensor(FakeTensorMode().from_tensor(real))
    assert type(wrapped_fake) is torch.Tensor and is_fake(wrapped_fake)
    assert launch.is_plain_eager((real, None, torch.nn.Parameter(real)))
    assert not launch.is_plain_eager((real, wrapped_fake))
    assert not launch.is_plain_eager((torch._to_functional_tensor(real),))


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton backend runs nowhere here")
@pytest.mark.usefixtures("poison_uninitialized")
@pytest.mark.parametrize("skipped", [True, False], ids=["skipping", "recording"])
def test_skipped_launches_run_nothing_and_keep_no_tensor(monkeypatch, skipped):
    """Inside skipping_launches the launchers launch nothing (the output keeps its poison) and
    keep no tensor: an eager training step's gradients become .grad as the backward returns
    them. Launches recorded instead keep them referenced, and autograd copies each one."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    x = make_inputs(device=DEVICE, batch=1, dim=8, dstate=4, seqlen=16)
    leaves = {k: x[k].requires_grad_() for k in float_inputs(x)}
    blocked = launch.skipping_launches() if skipped else launch.recording()
    with blocked, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = selective_scan_fn(**x, delta_softplus=True)
        out.backward(torch.randn_like(out))
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
    assert out.isnan().all()
    assert copies == (0 if skipped else len(leaves))
