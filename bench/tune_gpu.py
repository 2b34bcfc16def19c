"""Time the scan kernels under several tile configurations (GPU), to choose the defaults.

    python bench/tune_gpu.py --shapes S1,S7 --configs "NS=1;NS=2;NS=1,STAGES=2" [--which fwd,bwd]

Each configuration is a set of overrides of the forward's tiles (kernels/tiles.py: T, NS, NI,
CH, num_warps, STAGES, and maxnreg, a register cap passed to Triton's compiler) and, with a
"b." prefix, the backward's, plus TW for the policy's target_warps, run as a TilePolicy of its
own. Prints one
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
from selective_scan.kernels.tiles import DEFAULT_POLICY, TilePolicy, use_policy

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


def policy_of(overrides: dict) -> TilePolicy:
    """The tile policy of one configuration (see the module's docstring)."""
    return DEFAULT_POLICY.replace(
        fwd_overrides={k: v for k, v in overrides.items() if "." not in k and k != "TW"},
        bwd_overrides={k[2:]: v for k, v in overrides.items() if k.startswith("b.")},
        target_warps=overrides.get("TW", DEFAULT_POLICY.target_warps),
    )


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
            with use_policy(policy_of(parse(config))):
                try:
                    run_config(shape, config, inputs, dout, args)
                    if args.accuracy:
                        exact = exact or float64_grads(inputs, dout)
                        grads = bwd_call(inputs, dout)()
                        print(f"{shape} accuracy {config or 'default':23s} {errors(grads, exact)}")
                except Exception as e:
                    print(f"{shape} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)


def bwd_call(inputs: list, dout: torch.Tensor):
    ckpt = scan.scan_fwd(*inputs, True)[2]
    return lambda: scan.scan_bwd(dout, None, *inputs, ckpt, True)


def run_config(shape: str, config: str, inputs: list, dout: torch.Tensor, args) -> None:
    """Time the chosen directions under the active policy."""
    calls = {"fwd": lambda: scan.scan_fwd(*inputs, True), "bwd": bwd_call(inputs, dout)}
    for which in args.which.split(","):
        ms = timed(calls[which], args.graph)
        print(f"{shape} {which} {config or 'default':28s} {ms:8.4f} ms", flush=True)


if __name__ == "__main__":
    main()
