"""kernels/launch.py on CPU: what each kernel is passed, and that kernels declare only what they
use (the direct launches themselves are tested on a GPU, tests/test_gpu.py)."""

import ast
from pathlib import Path

import pytest

pytest.importorskip("triton")

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
