"""interpreter_speedups.py's scan against the interpreter's own, element by element."""

import pytest
import torch
from conftest import INTERPRETER_ON

pytestmark = pytest.mark.skipif(not INTERPRETER_ON, reason="needs the Triton interpreter")
triton = pytest.importorskip("triton")
import interpreter_speedups  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from selective_scan.kernels.common import combine  # noqa: E402


@triton.jit
def _scan_kernel(a_ptr, x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, AXIS: tl.constexpr,
                 REVERSE: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    a, x = tl.load(a_ptr + offs), tl.load(x_ptr + offs)
    _, h = tl.associative_scan((a, x), axis=AXIS, combine_fn=combine, reverse=REVERSE)
    tl.store(out_ptr + offs, h)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scan_by_slices_matches_the_interpreters_scan(axis, reverse, dtype):
    assert interpreter_speedups.APPLIES, "the speed-ups no longer apply to this Triton"
    gen = torch.Generator().manual_seed(axis + 2 * reverse)
    a, x = (torch.randn(4, 8, generator=gen, dtype=dtype) for _ in range(2))
    outs = []
    for scan in (interpreter_speedups.ORIGINAL_SCAN, interpreter_speedups._scan_by_slices):
        out = torch.full_like(a, float("nan"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(interpreter.ScanOps, "generic_scan", scan)
            _scan_kernel[(1,)](a, x, out, 4, 8, axis, reverse)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    # And the recurrence h = a h + x that both compose, in the scan's direction along the axis.
    steps = range(a.shape[axis])
    h = torch.zeros_like(a.select(axis, 0))
    for k in reversed(steps) if reverse else steps:
        h = a.select(axis, k) * h + x.select(axis, k)
        torch.testing.assert_close(outs[0].select(axis, k), h)
