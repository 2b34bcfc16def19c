"""Host cost of eager scan calls as CPU instructions per call (valgrind's callgrind): a count
that does not move with the machine's load, for comparing host-side changes on a shared CPU,
where wall-clock host times (bench/host_profile.py --device cpu) vary by 2x between runs.

    python bench/host_instructions.py [--shape S6] [--calls 100] [--out FILE] [CALL ...]

CALLs (default all): nograd (selective_scan_fn without gradients), grad (with gradients:
the forward through autograd), bwd_op_body (the backward op's body, scan.scan_bwd), step
(forward and backward through autograd, .grad reset as in gpu_bench.fwd_bwd_step). The
kernels run on CPU tensors under the Triton interpreter with their launches skipped
(kernels.launch.skipping_launches), as host_profile.py --device cpu does: plans, checks,
allocations, autograd and Python, not the CUDA driver. Each CALL runs in a process of its own
under callgrind, which counts only inside ``itertools.filterfalse``'s iteration (the calls
are made from there): imports and warm-up are not counted. About 3 minutes a CALL on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS = ("nograd", "grad", "bwd_op_body", "step")


def _run_calls(name: str, shape: str, count: int) -> None:
    """The measured process: warm up, then ``count`` calls from inside filterfalse."""
    sys.path.insert(0, str(HERE))
    import torch
    from gpu_bench import fwd_bwd_step, leaf_args
    from shapes import SCAN_INPUTS, make_bench_inputs

    from selective_scan import selective_scan_fn
    from selective_scan.kernels import scan
    from selective_scan.kernels.launch import skipping_launches

    x = make_bench_inputs(shape, device="cpu")
    inputs = [x[k] for k in SCAN_INPUTS]
    with skipping_launches():
        out, _, ckpt = scan.scan_fwd(*inputs, True)
        dout = torch.randn_like(out)
        public = {k: x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")}
        leaves = leaf_args(x)
        fn = {
            "nograd": lambda: selective_scan_fn(**public, delta_softplus=True),
            "grad": lambda: selective_scan_fn(**leaves),
            "bwd_op_body": lambda: scan.scan_bwd(dout, None, *inputs, ckpt, True),
            "step": lambda: fwd_bwd_step(selective_scan_fn, leaves, dout),
        }[name]
        for _ in range(5):
            fn()
        list(itertools.filterfalse(lambda _: (fn(), False)[1], range(count)))


def count_instructions(name: str, shape: str, count: int) -> float:
    """Instructions per call of ``name``, counted by callgrind in a process of its own."""
    env = dict(os.environ, TRITON_INTERPRET="1", SELECTIVE_SCAN_BACKEND="triton",
               OMP_NUM_THREADS="1")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "valgrind", "--tool=callgrind", "--toggle-collect=filterfalse_next",
            f"--callgrind-out-file={tmp}/callgrind.out", sys.executable, __file__,
            "--inner", name, "--shape", shape, "--calls", str(count),
        ]  # fmt: skip
        result = subprocess.run(command, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", result.stderr)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"{name}: callgrind failed\n{result.stderr[-3000:]}")
    return int(found.group(1)) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("calls", nargs="*", metavar="CALL", help=f"of {', '.join(CALLS)}")
    parser.add_argument("--shape", default="S6")
    parser.add_argument("--calls", dest="count", type=int, default=100)
    parser.add_argument("--out", help="JSON file for the figures")
    parser.add_argument("--inner", help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args()
    if args.inner:
        _run_calls(args.inner, args.shape, args.count)
        return
    unknown = set(args.calls) - set(CALLS)
    if unknown:
        parser.error(f"unknown calls {sorted(unknown)}; choose from {', '.join(CALLS)}")
    figures = {}
    for name in args.calls or CALLS:
        figures[name] = round(count_instructions(name, args.shape, args.count))
        print(f"{args.shape} {name:12s} {figures[name]:>10,} instructions a call", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
