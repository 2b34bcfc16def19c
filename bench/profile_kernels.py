"""GPU time of every kernel one scan call launches, per shape and direction (torch.profiler).

    python bench/profile_kernels.py --shapes S1,S3 [--calls 5] [--plain] [--config b.BF16_PARTS=0]
    python bench/profile_kernels.py --shapes S7 --compiled
    python bench/profile_kernels.py --shapes S1 --train

Where `gpu_bench.py` reports the sum, this splits a call into its launches (the ranges' local
pass, the main kernel, the partial-sum reductions, copies of padded rows), which is what a
change to one of them must be judged by. Each call's host and wall time are printed too
(host_and_wall_us): where they are equal, the call is host-bound. `--plain` runs each call once
without the profiler, for an outside profiler such as Nsight Compute (`ncu -k regex:_scan_bwd`).
`--compiled` splits the public forward's eager call and its call under
torch.compile(dynamic=True), compiled as `gpu_bench.py` compiles it, instead; `--train` a
training step of the public function (its loss, backward and gradient accumulation) eager and
compiled with static and dynamic shapes. With TORCH_LOGS=output_code, Inductor prints the
compiled calls' wrapper code (the launches and what is computed on the host between them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import FWD_ARGS, SHAPES, make_bench_inputs
from tune_gpu import parse, policy_of

from selective_scan import ops  # noqa: F401  (registers torch.ops.selective_scan)
from selective_scan.kernels.tiles import use_policy

OPS = torch.ops.selective_scan


def calls_of(shape: str, seqlen: int | None):
    """(forward call, backward call) of the Triton ops on the shape's benchmark inputs."""
    x = make_bench_inputs(shape, small_seqlen=seqlen)
    out, _, ckpt = OPS.scan_fwd_triton(*[x[k] for k in FWD_ARGS])
    dout = torch.randn_like(out)

    def fwd():
        return OPS.scan_fwd_triton(*[x[k] for k in FWD_ARGS])

    def bwd():
        return OPS.scan_bwd_triton(dout, None, *[x[k] for k in FWD_ARGS[:-1]], ckpt, True)

    return fwd, bwd


def per_kernel_us(fn, calls: int) -> list[tuple[str, float]]:
    """(kernel name, GPU us) of each launch of one call, in launch order (averaged over calls)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_call = len(events) // calls
    rows = [[events[k].name, 0.0] for k in range(per_call)]
    for k, e in enumerate(events[: per_call * calls]):
        rows[k % per_call][1] += e.device_time / calls
    return [(name, us) for name, us in rows]


def host_and_wall_us(fn, calls: int = 50) -> tuple[float, float]:
    """(host us a call, wall us a call) of ``calls`` calls made back to back: the host's time to
    queue them, and the time until the GPU has finished them. Equal figures mean the calls are
    host-bound: the GPU waits on the host, and kernel times alone understate what a call costs."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return 1e6 * (queued - start) / calls, 1e6 * (done - start) / calls


def compiled_calls(shape: str, seqlen: int | None):
    """(eager call, compiled call) of the public forward on the shape's benchmark inputs."""
    from gpu_bench import _no_grad, _public_fwd, compiled_public, leaf_args  # imports this

    x = make_bench_inputs(shape, small_seqlen=seqlen)
    compiled = compiled_public(leaf_args(x), x)
    return (lambda: _public_fwd(x)), (lambda: _no_grad(compiled, x))


def train_calls(shape: str, seqlen: int | None):
    """(mode, training step) of the public function eager, compiled static and compiled dynamic
    (as gpu_bench.py's compile_modes): a generator, since each compile follows a reset of
    Dynamo, so a step must run before the next one is made."""
    from gpu_bench import leaf_args, train_step

    args = leaf_args(make_bench_inputs(shape, small_seqlen=seqlen))
    for mode in ("eager", "static", "dynamic"):
        torch._dynamo.reset()
        yield f"{mode} train", train_step(args, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="S1,S3")
    parser.add_argument("--seqlen", type=int, default=None, help="override the shapes' seqlen")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="no profiler: one call each")
    parser.add_argument("--config", default="", help="tile overrides, as tune_gpu.py's")
    parser.add_argument(
        "--compiled", action="store_true", help="the public forward, eager and compiled"
    )
    parser.add_argument(
        "--train", action="store_true",
        help="a training step of the public function, eager and compiled static and dynamic",
    )  # fmt: skip
    args = parser.parse_args()
    with use_policy(policy_of(parse(args.config))):
        profile(args)


def profile(args) -> None:
    """Print each kernel's GPU time per call of every shape and direction args name."""

    def named_calls(shape):
        if args.train:
            return train_calls(shape, args.seqlen)
        names = ("eager fwd", "compiled fwd") if args.compiled else ("fwd", "bwd")
        of = compiled_calls if args.compiled else calls_of
        return zip(names, of(shape, args.seqlen), strict=True)

    for shape in args.shapes.split(","):
        for direction, fn in named_calls(shape):
            if args.plain:
                fn()
                torch.cuda.synchronize()
                continue
            rows = per_kernel_us(fn, args.calls)
            total = sum(us for _, us in rows)
            host, wall = host_and_wall_us(fn)
            print(f"{shape} {direction} {SHAPES[shape]} {args.config}: {total:.1f} us of kernels;"
                  f" {host:.1f} us of host, {wall:.1f} us of wall time a call")  # fmt: skip
            for name, us in rows:
                print(f"    {us:9.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
