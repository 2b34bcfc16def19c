"""Time the scan kernels under several tile configurations (GPU), to choose the defaults.

    python bench/tune_gpu.py --shapes S1,S7 --configs "NS=1;NS=2;NS=1,STAGES=2" [--which fwd,bwd]

Each configuration is a set of overrides of the forward's tiles (kernels.scan.config: T, NS,
NI, CH, num_warps, STAGES, and maxnreg, a register cap passed to Triton's compiler) and, with a
"b." prefix, the backward's (kernels.scan.bwd_config), plus TW for scan.TARGET_WARPS. Prints one
line per (shape, direction, configuration): median ms (do_bench) of eager calls, or with
--graph of a CUDA-graph replay of the call: the kernels' time without the host's, which
decides small shapes (S6) whose eager calls wait on the host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SCAN_INPUTS, make_bench_inputs

from selective_scan.kernels import scan


def timed(fn, graph: bool) -> float:
    """Median ms of fn(), or of a CUDA-graph replay of it (compiled and warmed up first)."""
    if not graph:
        return do_bench(fn, warmup=50, rep=200, return_mode="median")
    fn()
    torch.cuda.synchronize()
    replay = torch.cuda.CUDAGraph()
    with torch.cuda.graph(replay):
        fn()
    return do_bench(replay.replay, warmup=50, rep=200, return_mode="median")


def parse(config: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in config.split(",") if kv)}


def use_config(overrides: dict) -> None:
    """Patch scan's tile functions; the plan cache is emptied so that they are called."""
    scan.TARGET_WARPS = overrides.get("TW", DEFAULT_TARGET_WARPS)
    fwd = {k: v for k, v in overrides.items() if "." not in k and k != "TW"}
    bwd = {k[2:]: v for k, v in overrides.items() if k.startswith("b.")}
    for name, chosen in (("config", fwd), ("bwd_config", bwd)):
        setattr(scan, name, scan.overridden(DEFAULTS[name], chosen))
    scan._PLANS.clear()


DEFAULTS = {"config": scan.config, "bwd_config": scan.bwd_config}
DEFAULT_TARGET_WARPS = scan.TARGET_WARPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="S1,S7")
    parser.add_argument("--configs", default="")
    parser.add_argument("--which", default="fwd,bwd")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        x = make_bench_inputs(shape)
        inputs = [x[k] for k in SCAN_INPUTS]
        for config in args.configs.split(";"):
            use_config(parse(config))
            try:
                out, _, ckpt = scan.scan_fwd(*inputs, True)
                dout = torch.randn_like(out)
                calls = {
                    "fwd": lambda inputs=inputs: scan.scan_fwd(*inputs, True),
                    "bwd": lambda inputs=inputs, dout=dout, ckpt=ckpt: scan.scan_bwd(
                        dout, None, *inputs, ckpt, True
                    ),
                }
                for which in args.which.split(","):
                    ms = timed(calls[which], args.graph)
                    print(f"{shape} {which} {config or 'default':28s} {ms:8.4f} ms", flush=True)
            except Exception as e:
                print(f"{shape} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
