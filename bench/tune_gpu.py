"""Time the scan kernels under several tile configurations (GPU), to choose the defaults.

    python bench/tune_gpu.py --shapes S1,S7 --configs "NS=1;NS=2;NS=1,STAGES=2" [--which fwd,bwd]

Each configuration is a set of overrides of the forward's tiles (kernels.scan.config: T, NS,
NI, CH, num_warps, STAGES, and maxnreg, a register cap passed to Triton's compiler) and, with a
"b." prefix, the backward's (kernels.scan.bwd_config), plus TW for scan.TARGET_WARPS. Prints one
line per (shape, direction, configuration): median ms (do_bench) of eager calls, or with
--graph of a CUDA-graph replay of the call: the kernels' time without the host's, which
decides small shapes (S6) whose eager calls wait on the host. With --accuracy, each
configuration's backward is also compared with float64 gradients of the same inputs
(selective_scan_ref): relative error (norm) of du, dA, dB, dC.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SCAN_INPUTS, make_bench_inputs

from selective_scan import selective_scan_ref
from selective_scan.kernels import scan

GRADS = {"du": 0, "dA": 2, "dB": 3, "dC": 4}  # positions in scan_bwd's result


def float64_grads(inputs: list, dout: torch.Tensor) -> dict:
    """Gradients of sum(out * dout) in float64, by the reference (autograd)."""
    wide = [t.detach().double().requires_grad_(True) if t is not None else None for t in inputs]
    out = selective_scan_ref(*wide[:8], delta_softplus=True)
    (out * dout.double()).sum().backward()
    return {name: wide[SCAN_INPUTS.index(name[1:])].grad for name in GRADS}


def errors(grads: tuple, exact: dict) -> str:
    """Relative errors (norm) of scan_bwd's result against float64 gradients."""
    return " ".join(
        f"{name} {((grads[i].double() - exact[name]).norm() / exact[name].norm()).item():.2e}"
        for name, i in GRADS.items()
    )


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
    parser.add_argument("--accuracy", action="store_true", help="backward against float64")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        x = make_bench_inputs(shape)
        inputs = [x[k] for k in SCAN_INPUTS]
        dout = torch.randn_like(x["u"])
        exact = None
        for config in args.configs.split(";"):
            use_config(parse(config))
            try:
                ckpt = scan.scan_fwd(*inputs, True)[2]
                calls = {
                    "fwd": lambda inputs=inputs: scan.scan_fwd(*inputs, True),
                    "bwd": lambda inputs=inputs, dout=dout, ckpt=ckpt: scan.scan_bwd(
                        dout, None, *inputs, ckpt, True
                    ),
                }
                for which in args.which.split(","):
                    ms = timed(calls[which], args.graph)
                    print(f"{shape} {which} {config or 'default':28s} {ms:8.4f} ms", flush=True)
                if args.accuracy:
                    exact = exact or float64_grads(inputs, dout)
                    grads = calls["bwd"]()
                    print(f"{shape} accuracy {config or 'default':23s} {errors(grads, exact)}")
            except Exception as e:
                print(f"{shape} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
