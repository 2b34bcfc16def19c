"""Forward scan kernel time against warps per scheduler (GPU): S6's unit of work (8 channels x
256 steps, one warp, 4 lanes a channel) at dims that give 0.5 to 5 warps per scheduler of the
H200 (528), with and without the PRE pass. Tells what a unit costs alone and interleaved, i.e.
what balancing S6's 640 units could gain (docs/design.md, §4).

    python bench/occupancy_sweep.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes
from profile_kernels import per_kernel_us
from tune_gpu import policy_of

from selective_scan import ops  # noqa: F401  (registers torch.ops.selective_scan)
from selective_scan.kernels.tiles import use_policy

OPS = torch.ops.selective_scan
SCHEDULERS = 528  # 132 SMs x 4
CLOCK_GHZ = 1.98


def main() -> None:
    for cfg in ({"PRE": 128}, {"PRE": 0}):
        with use_policy(policy_of(cfg)):
            sweep(cfg)


def sweep(cfg: dict) -> None:
    """The forward's scan kernel time at each warp count, under the active policy."""
    for warps in (264, 528, 640, 792, 1056, 1584, 2112, 2640):
        name = f"D{warps * 8}"
        shapes.SHAPES[name] = (1, warps * 8, 16, 256, 1, torch.bfloat16)
        x = shapes.make_bench_inputs(name)
        args = [x[k] for k in shapes.FWD_ARGS]
        rows = per_kernel_us(lambda args=args: OPS.scan_fwd_triton(*args), 10)
        us = sum(t for kernel, t in rows if "scan_fwd" in kernel)
        per = warps / SCHEDULERS
        print(f"{cfg} warps {warps:5d} ({per:4.2f} a scheduler) scan {us:7.2f} us = "
              f"{us * CLOCK_GHZ * 1e3:8.0f} cycles; a unit of work {us / per:6.2f} us",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
