"""Where the host time of an eager scan call goes (GPU): per-call host time of the ops
and of the public function, and a profile (cProfile by function, torch.profiler by operator) of
the forward op's eager call, of the public function's without grad (its direct path), or of a
training step's forward and backward through autograd.

    python bench/host_profile.py [--shape S6] [--calls 200] [--top 25] [--profile train]

With ``--profile train`` it also splits the step: the backward node's own time, timed and
profiled inside the node (it runs on autograd's device thread, which a profiler started on this
thread may not see), the step with autograd's device threads off (the backward on this thread,
its node timed inside too), the engine's floor (a step of a no-op autograd.Function with as
many inputs), and a probe's step on each thread (a backward of fixed Python work and nine
allocations, timed inside: whether either runs slower on the device thread).
On a GPU it also lists what CUDA's sync debug mode reports in a step, and ``--trace`` writes a
Chrome trace of five steps.

Host time = wall time of back-to-back calls without synchronization, per call, after warm-up
(the kernels of these shapes are shorter than their launches, so the GPU waits on the host).

With ``--device cpu`` (environment TRITON_INTERPRET=1 SELECTIVE_SCAN_BACKEND=triton) the same
calls run the Triton launchers' host work on CPU tensors, their kernels not launched
(kernels.launch.skipping_launches): plans, checks, allocations and autograd, without the CUDA
allocator, the launches or autograd's device thread. CPU tensors get no direct launches, so no
replayed launch sequences either (kernels.launch.launch_sequence): every call derives its
launches' arguments, as a GPU call does only the first time with a layout.

Each call's allocations and copies are counted too (a gradient that autograd copies into .grad
instead of taking it shows as a copy), and a small Mamba layer's training step through
mamba_inner_fn is timed each way its checkpoint_lvl=1 can run (``layer_steps``); ``--out FILE``
writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gzip
import io
import json
import os
import pstats
import sys
import time
import warnings
from pathlib import Path
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import fwd_bwd_step, leaf_args
from report import cpu_model, environment, git_commit
from shapes import SCAN_INPUTS, make_bench_inputs

from selective_scan import mamba_inner_fn, ops, selective_scan_fn
from selective_scan.kernels import scan
from selective_scan.kernels.launch import skipping_launches

# "cuda", or "cpu" (kernels not launched): set by main.
DEVICE = "cuda"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host time per call, in microseconds."""
    for _ in range(10):
        fn()
    synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        synchronize()
    return sorted(rounds)[2]


def op_counts(fn) -> tuple[int, int]:
    """(allocations, copies) of one call of fn: aten::empty and aten::empty_strided calls
    (those within other factories too), and aten::copy_ calls."""
    fn()
    synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        synchronize()
    counts = {e.key: e.count for e in prof.key_averages()}
    allocations = counts.get("aten::empty", 0) + counts.get("aten::empty_strided", 0)
    return allocations, counts.get("aten::copy_", 0)


def stats_text(profiler: cProfile.Profile, top: int) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


@contextlib.contextmanager
def node_timed(function: type[torch.autograd.Function], profiler: cProfile.Profile | None):
    """Inside the block, the backward of ``function`` appends its wall time per call to the
    list yielded, under ``profiler`` when given (enabled only while the node runs)."""
    backward, seconds = function.backward, []

    def timed(ctx, *grads):
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        try:
            return backward(ctx, *grads)
        finally:
            if profiler is not None:
                profiler.disable()
            seconds.append(time.perf_counter() - start)

    function.backward = staticmethod(timed)  # the node looks it up on its class each call
    try:
        yield seconds
    finally:
        function.backward = staticmethod(backward)


class _NoOp(torch.autograd.Function):
    """The engine's floor: one kernel forward, a backward returning dout for the first input."""

    @staticmethod
    def forward(ctx, u, *rest):
        ctx.count = len(rest)
        return u * 1

    @staticmethod
    def backward(ctx, dout):
        return (dout, *([None] * ctx.count))


class _Probe(torch.autograd.Function):
    """A backward of fixed work, timed inside: 3,000 iterations of Python arithmetic, then nine
    allocations like dout (``seconds``: (Python, allocations) a call). Whether Python and the
    allocator run slower on autograd's device thread than on the calling thread, and what the
    handoff costs a node that does some work."""

    seconds: ClassVar[list] = []

    @staticmethod
    def forward(ctx, u):
        return u * 1

    @staticmethod
    def backward(ctx, dout):
        start = time.perf_counter()
        sum(i * 3 % 7 for i in range(3000))
        middle = time.perf_counter()
        for _ in range(9):
            torch.empty_like(dout)
        _Probe.seconds.append((middle - start, time.perf_counter() - middle))
        return dout


def probe_by_thread(u: torch.Tensor, dout: torch.Tensor, calls: int) -> dict:
    """_Probe's step and its inside times (us, medians) on each thread."""
    figures = {}
    for name, threads in (("device thread", True), ("calling thread", False)):
        _Probe.seconds.clear()
        with torch.autograd.set_multithreading_enabled(threads):
            step = host_us(lambda: _Probe.apply(u).backward(dout), calls)
        columns = zip(*_Probe.seconds, strict=True)
        python, allocations = (sorted(column)[len(column) // 2] for column in columns)
        figures[name] = {"step": round(step, 1), "python": round(python * 1e6, 1),
                         "9 allocations": round(allocations * 1e6, 1)}  # fmt: skip
    return figures


def train_split(leaves: dict, dout: torch.Tensor, calls: int, top: int) -> dict:
    """Print where a training step's host time goes (see the module's docstring); returns the
    figures, in microseconds per step."""
    function = ops.EAGER_FUNCTIONS[ops.triton_ops()[0]]

    def train():
        fwd_bwd_step(selective_scan_fn, leaves, dout)

    tensors = [t for t in leaves.values() if torch.is_tensor(t)]
    with node_timed(function, None) as seconds:
        step = host_us(train, calls)
        node = sorted(seconds)[len(seconds) // 2] * 1e6
    with torch.autograd.set_multithreading_enabled(False), node_timed(function, None) as here:
        on_this_thread = host_us(train, calls)
        node_here = sorted(here)[len(here) // 2] * 1e6
    floor = host_us(lambda: _NoOp.apply(*tensors).backward(dout), calls)
    probe = probe_by_thread(leaves["u"], dout, calls)
    print(
        f"train step {step:.1f} us host; backward node (median, timed inside) {node:.1f} us; "
        f"step with the backward on this thread {on_this_thread:.1f} us, its node "
        f"{node_here:.1f} us; no-op autograd step (engine floor) {floor:.1f} us; "
        f"probe (step, Python, allocations) by thread {probe}"
    )
    profiler = cProfile.Profile()
    with node_timed(function, profiler):
        for _ in range(calls):
            train()
        synchronize()
    print("backward node, profiled inside:")
    print(stats_text(profiler, top))
    return {
        "train step": round(step, 1),
        "backward node, timed inside": round(node, 1),
        "train step, backward on this thread": round(on_this_thread, 1),
        "backward node on this thread, timed inside": round(node_here, 1),
        "no-op autograd step (engine floor)": round(floor, 1),
        "probe by thread (_Probe)": probe,
    }


def synchronizing_calls(step) -> list[str]:
    """What CUDA's sync debug mode reports during three calls of step (on either thread): a
    host-device synchronization would make the host wait for the GPU's queue."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # outside the catch: it warns that it is a prototype
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sorted({str(w.message).splitlines()[0] for w in caught})


def chrome_trace(step, path: str) -> None:
    """Write a Chrome trace of five calls of step: the calling thread, autograd's device
    thread and the kernels, to read where a step's host time goes between threads."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    plain = path.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        os.remove(plain)


class _Intercepting(TorchFunctionMode):
    """Changes nothing, but calls under it are not plain eager (launch.intercepted)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def layer_steps() -> dict:
    """Training steps (forward, backward) of mamba_inner_fn at a small Mamba layer's sizes
    (d_model 64, d_inner 128, 16 states, rank 4, batch 1, 64 steps: host work, little compute):
    checkpoint_lvl=1 as plain eager calls run it (mamba_inner._EagerRegion), through the
    selective checkpoint (what calls that something intercepts take), and checkpoint_lvl=0."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def leaf(*shape, scale=0.1):
        t = scale * torch.randn(shape, generator=gen, device=DEVICE)
        return t.requires_grad_()

    d_model, d_inner, dstate, rank, seqlen = 64, 128, 16, 4, 64
    inputs = dict(
        xz=leaf(1, 2 * d_inner, seqlen, scale=1.0), conv1d_weight=leaf(d_inner, 1, 4),
        conv1d_bias=leaf(d_inner), x_proj_weight=leaf(rank + 2 * dstate, d_inner),
        delta_proj_weight=leaf(d_inner, rank), out_proj_weight=leaf(d_model, d_inner),
        out_proj_bias=None, A=leaf(d_inner, dstate), D=leaf(d_inner), delta_bias=leaf(d_inner),
    )  # fmt: skip

    def step(level: int, mode=contextlib.nullcontext):
        def run():
            with mode():
                mamba_inner_fn(**inputs, checkpoint_lvl=level).sum().backward()

        return run

    return {
        "mamba_inner_fn step, level 1, eager region": step(1),
        "mamba_inner_fn step, level 1, selective checkpoint": step(1, _Intercepting),
        "mamba_inner_fn step, level 0": step(0),
    }


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="S6")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--profile", choices=("op", "public", "train"), default="op")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", help="JSON file for the figures")
    parser.add_argument(
        "--trace",
        help="Chrome trace (.json or .json.gz) of 5 training steps, "
        "both threads and the GPU's kernels (CUDA only)",
    )
    args = parser.parse_args()
    DEVICE = args.device
    if DEVICE == "cpu" and (
        os.environ.get("TRITON_INTERPRET") != "1"
        or os.environ.get("SELECTIVE_SCAN_BACKEND") != "triton"
    ):
        sys.exit("--device cpu needs TRITON_INTERPRET=1 SELECTIVE_SCAN_BACKEND=triton")
    with skipping_launches() if DEVICE == "cpu" else contextlib.nullcontext():
        figures = profile(args)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


def profile(args) -> dict:
    """Time, count and profile the calls (see the module's docstring); returns the figures."""
    x = make_bench_inputs(args.shape, device=DEVICE)
    inputs = [x[k] for k in SCAN_INPUTS]
    out, _, ckpt = scan.scan_fwd(*inputs, True)
    dout = torch.randn_like(out)
    public = {k: x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")}
    ops = torch.ops.selective_scan
    leaves = leaf_args(x)  # delta_softplus=True, as make_bench_inputs sets it

    def train():
        fwd_bwd_step(selective_scan_fn, leaves, dout)

    def fwd_op():
        return ops.scan_fwd_triton(*inputs, True)

    calls = {
        "scan_fwd_triton op": fwd_op,
        "scan_bwd_triton op": lambda: ops.scan_bwd_triton(dout, None, *inputs, ckpt, True),
        # The op's implementation with its checks, and what an eager autograd backward calls
        # instead (ops.run_backward): no dispatcher, no checks that autograd has made.
        "scan_bwd implementation": lambda: scan.scan_bwd(dout, None, *inputs, ckpt, True),
        "scan_bwd_autograd": lambda: scan.scan_bwd_autograd(dout, None, *inputs, ckpt, True),
        # Outside the op, wrap_triton takes its tracing path: not what users run, kept to show it.
        "scan_fwd launcher outside the op": lambda: scan.scan_fwd(*inputs, True),
        "selective_scan_fn (no grad)": lambda: selective_scan_fn(**public, delta_softplus=True),
        "selective_scan_fn (with grad)": lambda: selective_scan_fn(**leaves),
        "selective_scan_fn fwd+bwd": train,
        f"empty {DEVICE} tensor": lambda: torch.empty(16, device=DEVICE),
    }
    figures = {
        **environment(DEVICE if DEVICE == "cuda" else cpu_model()),
        "commit": git_commit(),
        "shape": args.shape,
        "method": f"bench/host_profile.py --device {DEVICE}: wall time of {args.calls} "
        "back-to-back calls, per call, median of 5 rounds"
        + (", kernels not launched" if DEVICE == "cpu" else ""),
        "us_per_call": {},
        "allocations_per_call": {},
        "copies_per_call": {},
    }
    for name, fn in calls.items():
        us = figures["us_per_call"][name] = round(host_us(fn, args.calls), 1)
        made, copied = op_counts(fn)
        figures["allocations_per_call"][name] = made
        figures["copies_per_call"][name] = copied
        print(f"{args.shape} {name:34s} {us:9.1f} us host per call, {made:3d} allocations, "
              f"{copied} copies")  # fmt: skip
    figures["layer_us_per_step"] = {}
    for name, fn in layer_steps().items():
        us = figures["layer_us_per_step"][name] = round(host_us(fn, args.calls), 1)
        print(f"{name:60s} {us:9.1f} us host per step")
    profiled = {"op": fwd_op, "public": calls["selective_scan_fn (no grad)"], "train": train}[
        args.profile
    ]
    if args.profile == "train":
        figures["train_split_us"] = train_split(leaves, dout, args.calls, args.top)
    if DEVICE == "cuda":
        figures["synchronizing_calls"] = synchronizing_calls(train)
        print(
            "calls that synchronize with the GPU in a training step:",
            figures["synchronizing_calls"] or "none",
        )
        if args.trace:
            chrome_trace(train, args.trace)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        profiled()
    profiler.disable()
    synchronize()
    print(stats_text(profiler, args.top))
    # cProfile sees this thread only; a CUDA backward runs on autograd's device thread.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            profiled()
        synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return figures


if __name__ == "__main__":
    main()
