"""Sweep the decode step's tiles on the GPU: channels per program (BD) x num_warps, timed as
CUDA-graph replays of 64 steps at each batch of decode_bench (d=5120, dstate 16).

    python bench/tune_decode.py [--out sweep.json]

Prints us per step and the fraction of copy bandwidth for every (batch, BD, warps), and the
best per batch. The committed tiles (kernels/state_update.py ``block``) come from this sweep
(docs/design.md, section 8). Launches the kernel directly with each tile, outside the public
function (a graph replay times the kernels alone either way).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db

from selective_scan.kernels.common import cdiv


def step_with_tiles(inputs: dict, BD: int, warps: int):
    """A decode step on inputs launched with BD channels a program and `warps` warps (the
    kernel's own plan otherwise): a function launching it."""
    jit, grid, tensors, scalars, options = db.ready_launch(inputs)
    batch, dim = inputs["x"].shape
    grid = (cdiv(dim, BD) * batch, *grid[1:])
    options = options | {"BD": BD, "num_warps": warps}
    return lambda: jit[grid](**tensors, **scalars, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bw = db.copy_bandwidth("cuda", quick=False)
    results = {}
    for batch in (1, 16, 64, 256):
        inputs = db.step_inputs(batch, 5120, 16, "cuda")
        nbytes = db.step_bytes(batch, 5120, 16)
        best = None
        for BD, warps in itertools.product((16, 32, 64, 128, 256), (2, 4, 8)):
            step = step_with_tiles(inputs, BD, warps)
            graph, _ = db.capture(lambda step=step: [step() for _ in range(64)])
            us = 1e3 * db.device_ms(graph.replay, "cuda") / 64
            results[f"{batch},{BD},{warps}"] = us
            best = min(best or (us, BD, warps), (us, BD, warps))
            print(f"batch {batch:4} BD {BD:3} warps {warps}: {us:7.2f} us, "
                  f"{nbytes / (us * 1e-6) / copy_bw:.0%} of copy", flush=True)  # fmt: skip
        print(f"best at batch {batch}: {best[0]:.2f} us with BD {best[1]}, {best[2]} warps")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
