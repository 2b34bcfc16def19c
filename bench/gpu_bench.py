"""GPU benchmark of the Triton selective scan against the anchor figures (H200).

    python bench/gpu_bench.py --out $OUT [--shapes S1,S7] [--extras seqlen_sweep_S1]
        [--resume RESULTS]   (complete a run that a time limit cut, from its h200.json)

For every shape: forward and backward kernel time (median of triton.testing.do_bench after
warm-up; inputs rotated so that they never sit in L2), the fraction of the physical floor
reached, peak memory of forward + backward, and the anchor ratios; the GPU time of the calls'
kernels alone (profiler), a compiled call's and a training step's kernels one by one, and the
public forward, eager and through torch.compile. Also: eager
call vs torch.compile vs CUDA-graph replay for the small shape, eager vs compiled with static
and dynamic shapes (S1, forward and forward + backward), first-call compile time, determinism
of the backward, the backward given an expanded dout, S6's training step with autograd's
device threads on and off (ours and the anchor's), S6's and S1's training steps replayed from
CUDA graphs (whole-step capture, and torch.compile's "reduce-overhead"), and time vs seqlen for
the plot (2049 and 2056 steps too). The public calls are also timed queued back to back
(*_b2b_ms, see time_rotating): a call's host time counts there only where it exceeds its GPU
time. Writes <out>/h200.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor
from profile_kernels import per_kernel_us
from report import capture, git_commit, guarded
from shapes import ANCHORS_MS, FWD_ARGS, SHAPES, make_bench_inputs

import selective_scan  # noqa: F401  (registers the ops)
from selective_scan import selective_scan_fn, selective_scan_ref
from selective_scan.kernels.tiles import DEFAULT_POLICY, use_policy

COPY_BW = 4.27e12  # bytes/s, measured device-to-device copy on the H200 (anchors.md)
EXP_RATE = 4.15e12  # ex2/s, measured MUFU rate on the H200 (anchors.md)
L2_BYTES = 60e6

OPS = torch.ops.selective_scan


def floors_ms(shape: str, dtype: torch.dtype) -> tuple[float, float]:
    """(forward floor, backward floor) in ms: the larger of bytes / copy bandwidth and
    batch * dim * dstate * seqlen exponentials / MUFU rate."""
    batch, dim, dstate, seqlen, groups, _ = SHAPES[shape]
    elt = torch.empty((), dtype=dtype).element_size()
    E, G = batch * dim * seqlen, batch * groups * dstate * seqlen
    exps = batch * dim * dstate * seqlen / EXP_RATE
    fwd_bytes = (4 * E + 2 * G) * elt  # read u, delta, z, B, C; write out
    bwd_bytes = (7 * E + 4 * G) * elt  # read u, delta, z, dout, B, C; write du, ddelta, dz, dB, dC
    return 1e3 * max(fwd_bytes / COPY_BW, exps), 1e3 * max(bwd_bytes / COPY_BW, exps)


def input_sets(shape: str, dtype=None, seqlen=None) -> list[dict]:
    """Enough independent input sets that together they exceed 3x the L2 cache."""
    first = make_bench_inputs(shape, dtype=dtype, small_seqlen=seqlen)
    size = sum(t.numel() * t.element_size() for t in first.values() if torch.is_tensor(t))
    count = max(1, min(8, math.ceil(3 * L2_BYTES / size)))
    return [first] + [make_bench_inputs(shape, dtype=dtype, small_seqlen=seqlen, seed=s)
                      for s in range(1, count)]  # fmt: skip


BACK_TO_BACK = 10  # calls a timed repetition makes in the *_b2b_ms figures
# The figures' suffixes by the calls a repetition makes: one call, and calls queued back to back.
REPETITIONS = {"ms": 1, "b2b_ms": BACK_TO_BACK}


def time_rotating(fn, count: int, calls: int = 1) -> float:
    """Median ms of fn(i), i cycling through count input sets; with calls > 1, of `calls` calls
    queued back to back, per call. do_bench flushes L2 and records an event before each
    repetition: with one call a repetition, the call's host time before its last launch shows in
    its figure wherever it exceeds the flush's GPU time (a latency: the GPU waits for the call),
    and host time up to the flush's is hidden behind it. Back to back, the host queues the next
    call while the GPU runs this one, as a training loop that never synchronizes does: the figure
    is close to the larger of the host's and the GPU's time a call."""
    state = {"i": 0}

    def call():
        for _ in range(calls):
            fn(state["i"] % count)
            state["i"] += 1

    return do_bench(call, warmup=100, rep=400, return_mode="median") / calls


def fwd_op(x: dict):
    return OPS.scan_fwd_triton(*[x[k] for k in FWD_ARGS])


def bwd_op(x: dict, dout: torch.Tensor, checkpoints: torch.Tensor):
    """The backward of fwd_op(x), softplus on (as make_bench_inputs sets it)."""
    return OPS.scan_bwd_triton(dout, None, *[x[k] for k in FWD_ARGS[:-1]], checkpoints, True)


PUBLIC_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus")


def _public_fwd(x: dict):
    return selective_scan_fn(**{k: x[k] for k in PUBLIC_ARGS})


def kernel_ms(fn, calls: int = 5) -> float:
    """GPU time per call summed over all kernels it launches (torch.profiler), without the
    host's share: what a CUDA-graph replay of the call would cost, launch gaps aside."""
    return sum(us for _, us in per_kernel_us(fn, calls)) / 1e3


def step_kernels_us(step, calls: int = 3) -> list[list]:
    """[kernel name, GPU us] of each launch of ``step(0)`` (a call or a training step), in
    launch order: where an eager and a compiled call's GPU time differ (design §18)."""
    return [[name, round(us, 1)] for name, us in per_kernel_us(lambda: step(0), calls)]


def _timed(spent: dict, name: str, fn):
    """fn(), its wall seconds kept in spent[name] and printed as they come: a run cut by its
    time limit still says where its time went."""
    t0 = time.perf_counter()
    value = fn()
    spent[name] = round(time.perf_counter() - t0, 1)
    print(f"  {name}: {spent[name]} s", file=sys.stderr, flush=True)
    return value


def fwd_bwd_step(fn, leaves: dict, dout: torch.Tensor):
    """A training step's share of the scan: fn(**leaves) forward, then backward from dout
    through autograd, with the leaves' .grad reset first (as zero_grad(set_to_none=True)
    leaves them, so the gradients are set, not accumulated)."""
    for t in leaves.values():
        if torch.is_tensor(t):
            t.grad = None
    fn(**leaves).backward(dout)


def compiled_public(leaves: dict, plain: dict):
    """selective_scan_fn under torch.compile(dynamic=True, fullgraph=True), compiled at the
    example's sizes for a forward + backward (leaves, leaf_args) and for a forward without
    gradients on inputs that require none (plain: bench inputs, as the timed calls pass them;
    compiled on the leaves instead, Dynamo's guards on requires_grad fail at the first timed
    call, which compiles a third graph outside the cache switch).
    The tiles follow the sizes of the example compiled (kernels/tiles.py), so each shape
    compiles its own: from a copy of the function's code (Dynamo keeps its graphs by code
    object), with the compile caches off (their keys omit the sizes: a graph compiled for another
    shape would be served)."""
    fn = torch.compile(_own_public_call(), dynamic=True, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        fwd_bwd_step(fn, leaves, torch.randn_like(leaves["u"]))
        _no_grad(fn, plain)
    return fn


def _public_call(**kwargs):
    return selective_scan_fn(**kwargs)


def _own_public_call():
    """_public_call from a copy of its code: Dynamo keeps graphs by code object, so each copy
    compiles its own."""
    return types.FunctionType(_public_call.__code__.replace(), _public_call.__globals__)


def anchor_figures(module, sets: list[dict], douts: list[torch.Tensor], leaves: list[dict]) -> dict:
    """The anchor's forward, backward and forward + backward on the same inputs, timed like
    ours (rotating sets), its kernels called directly; and a training step's forward + backward
    through autograd (anchor.AnchorScan, on the leaves), as ours is timed. The recorded figures
    where the anchor is not built."""
    if module is None:
        return {"anchor_source": "recorded (../shared/anchors.md), not built in this process"}
    args = [anchor.anchor_inputs(x) for x in sets]
    saved = [anchor.forward(module, a) for a in args]
    count = len(sets)

    def bwd(i):
        anchor.backward(module, args[i], saved[i], douts[i])

    figures = {
        "anchor_source": "state-spaces/mamba selective_scan_cuda built and timed in this process",
        "anchor_fwd_ms": time_rotating(lambda i: anchor.forward(module, args[i]), count),
        "anchor_bwd_ms": time_rotating(bwd, count),
        "anchor_fwd_bwd_ms": time_rotating(
            lambda i: anchor.forward_backward(module, args[i], douts[i]), count
        ),
    }
    step = anchor_step(module)

    def autograd_step(i):
        fwd_bwd_step(step, leaves[i], douts[i])

    autograd = guarded(time_rotating, autograd_step, count)
    figures["anchor_fwd_bwd_autograd_ms" if isinstance(autograd, float) else "anchor_autograd"] = (
        autograd
    )
    if isinstance(autograd, float):
        figures["anchor_fwd_bwd_autograd_b2b_ms"] = time_rotating(
            autograd_step, count, BACK_TO_BACK
        )
    return figures


def anchor_step(module):
    """The anchor as a function of the public function's keyword arguments, through autograd."""

    def call(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        return anchor.AnchorScan.apply(module, u, delta, A, B, C, D, z, delta_bias,
                                       delta_softplus)  # fmt: skip

    return call


def bench_shape(shape: str, seqlen=None, anchor_module=None) -> dict:
    """The shape's eager figures; anchor_module: the built anchor (anchor.build) or None."""
    dtype = SHAPES[shape][-1]
    spent = {}
    sets = _timed(spent, "inputs", lambda: input_sets(shape, seqlen=seqlen))
    saved = []
    for x in sets:
        out, _, ckpt = fwd_op(x)
        saved.append((torch.randn_like(out), ckpt))
    douts = [d for d, _ in saved]

    def bwd(i):
        return bwd_op(sets[i], *saved[i])

    fwd_ms = _timed(spent, "fwd", lambda: time_rotating(lambda i: fwd_op(sets[i]), len(sets)))
    bwd_ms = _timed(spent, "bwd", lambda: time_rotating(bwd, len(sets)))
    result = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms}
    if seqlen is not None:
        result["wall_s"] = spent
        return result
    leaves = [leaf_args(x) for x in sets]

    def public(i):
        _public_fwd(sets[i])

    def public_step(i):
        fwd_bwd_step(selective_scan_fn, leaves[i], douts[i])

    result.update(
        fwd_kernel_ms=_timed(
            spent, "fwd_kernels", lambda: guarded(lambda: kernel_ms(lambda: fwd_op(sets[0])))
        ),
        bwd_kernel_ms=_timed(
            spent, "bwd_kernels", lambda: guarded(lambda: kernel_ms(lambda: bwd(0)))
        ),
        fwd_public_ms=_timed(spent, "public", lambda: time_rotating(public, len(sets))),
        fwd_bwd_ms=_timed(spent, "fwd_bwd", lambda: time_rotating(public_step, len(sets))),
        fwd_public_b2b_ms=_timed(
            spent, "public_b2b", lambda: time_rotating(public, len(sets), BACK_TO_BACK)
        ),
        fwd_bwd_b2b_ms=_timed(
            spent, "fwd_bwd_b2b", lambda: time_rotating(public_step, len(sets), BACK_TO_BACK)
        ),
        fwd_bwd_kernels_us=_timed(
            spent, "fwd_bwd_kernels", lambda: guarded(step_kernels_us, public_step)
        ),
    )  # fmt: skip
    result.update(
        _timed(spent, "anchor", lambda: anchor_figures(anchor_module, sets, douts, leaves))
    )
    floor_f, floor_b = floors_ms(shape, dtype)
    recorded_f, recorded_b = ANCHORS_MS[shape]
    anchor_f = result.get("anchor_fwd_ms", recorded_f)
    anchor_b = result.get("anchor_bwd_ms", recorded_b)
    anchor_fb = result.get("anchor_fwd_bwd_ms", recorded_f + recorded_b)
    result.update(
        recorded_anchor_fwd_ms=recorded_f, recorded_anchor_bwd_ms=recorded_b,
        floor_fwd_ms=floor_f, floor_bwd_ms=floor_b,
        fwd_speedup=anchor_f / result["fwd_public_ms"], bwd_speedup=anchor_b / bwd_ms,
        fwd_bwd_speedup=anchor_fb / result["fwd_bwd_ms"],
        fwd_floor_fraction=floor_f / fwd_ms, bwd_floor_fraction=floor_b / bwd_ms,
        peak_mem_bytes=_timed(spent, "peak_memory", lambda: peak_memory(sets[0])),
    )  # fmt: skip
    if "anchor_fwd_bwd_autograd_ms" in result:
        result["fwd_bwd_autograd_speedup"] = (
            result["anchor_fwd_bwd_autograd_ms"] / result["fwd_bwd_ms"]
        )
    result["wall_s"] = spent
    return result


def compiled_figures(shape: str) -> dict:
    """The shape's forward and forward + backward through selective_scan_fn compiled by
    compiled_public (compile time included as compile_s)."""
    sets = input_sets(shape)
    leaves = [leaf_args(x) for x in sets]
    douts = [torch.randn_like(x["u"]) for x in sets]
    t0 = time.perf_counter()
    compiled = compiled_public(leaves[0], sets[0])
    figures = {"compile_s": round(time.perf_counter() - t0, 1)}

    def fwd(i):
        _no_grad(compiled, sets[i])

    def fwd_bwd(i):
        fwd_bwd_step(compiled, leaves[i], douts[i])

    for suffix, calls in REPETITIONS.items():
        figures[f"fwd_compiled_{suffix}"] = guarded(time_rotating, fwd, len(sets), calls)
        figures[f"fwd_bwd_compiled_{suffix}"] = guarded(time_rotating, fwd_bwd, len(sets), calls)
    figures["fwd_compiled_kernels_us"] = guarded(step_kernels_us, fwd)
    figures["fwd_bwd_compiled_kernels_us"] = guarded(step_kernels_us, fwd_bwd)
    return figures


def _no_grad(fn, x: dict):
    with torch.no_grad():
        return fn(**{k: x[k] for k in PUBLIC_ARGS})


def warm_shape(shape: str) -> None:
    """Compile (Triton, Inductor) what bench_shape runs, untimed (--warm): processes of one
    shape each can fill the caches in parallel before a timed run."""
    x = make_bench_inputs(shape)
    out, _, ckpt = fwd_op(x)
    bwd_op(x, torch.randn_like(out), ckpt)
    _public_fwd(x)
    compiled_public(leaf_args(x), x)
    peak_memory(x)
    torch.cuda.synchronize()


def peak_memory(x: dict) -> int:
    """Peak bytes allocated during forward + backward through the public function, above the
    inputs already resident."""
    inputs = {k: v.detach().requires_grad_(v.is_floating_point()) if torch.is_tensor(v) else v
              for k, v in x.items()}  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, last = selective_scan_fn(**inputs, return_last_state=True)
    (out.float().sum() + last.sum()).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_modes(shape: str = "S6") -> dict:
    """Eager call vs torch.compile'd call vs CUDA-graph replays of the compiled call and of the
    eager call (the eager launches: direct, and the forward's dependent launch, see
    kernels/scan.py; Inductor's launches set no launch attributes)."""
    x = make_bench_inputs(shape)
    args = {k: v for k, v in x.items()}

    def eager():
        return selective_scan_fn(**args)

    t0 = time.perf_counter()
    compiled = torch.compile(lambda: selective_scan_fn(**args), fullgraph=True)
    compiled()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    graph, static = capture(compiled)
    eager_graph, _ = capture(eager)
    # The method's floor: a graph of one launch that does next to nothing, timed alike (the
    # event pair, the graph's launch, after do_bench's L2 flush).
    one = torch.zeros(1, device="cuda")
    tiny_graph, _ = capture(lambda: one.add_(1))
    result = {
        "eager_ms": do_bench(eager, warmup=50, rep=200, return_mode="median"),
        "compiled_ms": do_bench(compiled, warmup=50, rep=200, return_mode="median"),
        "cuda_graph_ms": do_bench(graph.replay, warmup=50, rep=200, return_mode="median"),
        "eager_cuda_graph_ms": do_bench(
            eager_graph.replay, warmup=50, rep=200, return_mode="median"
        ),
        "one_element_kernel_cuda_graph_ms": do_bench(
            tiny_graph.replay, warmup=50, rep=200, return_mode="median"
        ),
        "compile_first_call_s": compile_s,
    }
    ref = selective_scan_ref(**{k: v.double() if torch.is_tensor(v) and v.is_floating_point()
                                 else v for k, v in args.items()})  # fmt: skip
    result["graph_rel_err"] = ((static.double() - ref).norm() / ref.norm()).item()
    return result


def leaf_args(x: dict) -> dict:
    """The public function's arguments from bench inputs, as leaves that require grad."""
    return {k: x[k].detach().clone().requires_grad_(x[k].is_floating_point())
            if torch.is_tensor(x[k]) else x[k] for k in PUBLIC_ARGS}  # fmt: skip


def in_mode(fn, mode: str):
    """fn as run in mode eager (itself), static or dynamic (torch.compile, fullgraph)."""
    if mode == "eager":
        return fn
    return torch.compile(fn, dynamic=mode == "dynamic", fullgraph=True)


def train_step(args: dict, mode: str):
    """A training step of the public function (loss = out.float().sum(), then backward) in
    mode eager, static or dynamic (in_mode of the loss; Dynamo does not trace .backward(): it
    is called after)."""

    def loss():
        return selective_scan_fn(**args).float().sum()

    compiled_loss = in_mode(loss, mode)
    return lambda: compiled_loss().backward()


def compile_modes(shape: str = "S1") -> dict:
    """The public function eager vs under torch.compile with static and with dynamic shapes
    (symbolic sizes: the grids pick the aligned or the plain kernels at run time), forward alone
    and forward + backward."""
    args = leaf_args(make_bench_inputs(shape))

    def fwd():
        with torch.no_grad():
            return selective_scan_fn(**args)

    result = {}
    for mode in ("eager", "static", "dynamic"):
        torch._dynamo.reset()
        for name, fn in (("fwd", in_mode(fwd, mode)), ("fwd_bwd", train_step(args, mode))):
            fn()
            result[f"{mode}_{name}_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return result


def compiled_lengths(shape: str = "S1", lengths: tuple[int, ...] = (2048, 2049, 2056)) -> dict:
    """The public function compiled once with dynamic shapes (a symbolic length) and called at
    lengths 16 divides, 8 only, and neither: forward and forward + backward, with symbolic lengths
    in padded rows (the default) and in rows of their own (``pad_rows=False``: the kernels then
    check the alignment at run time and take the plain body where T does not divide the
    length). Also the largest error of the compiled output and du against eager's, and the
    graphs compiled (two a policy, with and without gradients, when no length recompiles).
    The forward + backward is a training step as fwd_bwd_step times it, .grad reset first."""
    result = {}
    policies = {"padded": DEFAULT_POLICY, "unpadded": DEFAULT_POLICY.replace(pad_rows=False)}
    for name, policy in policies.items():
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        # The backward on this thread: a compiled graph's backward op runs under the policy
        # current where it runs (tiles.use_policy).
        with (
            use_policy(policy),
            torch._inductor.config.patch(force_disable_caches=True),
            torch.autograd.set_multithreading_enabled(False),
        ):
            fn = torch.compile(_own_public_call(), dynamic=True, fullgraph=True)
            for L in lengths:
                result[f"{name}_{L}"] = _compiled_length(fn, shape, L)
                print(" ", name, L, json.dumps(result[f"{name}_{L}"]), file=sys.stderr, flush=True)
        result[f"{name}_graphs"] = counters["stats"]["unique_graphs"]
    return result


def _compiled_length(fn, shape: str, seqlen: int) -> dict:
    """compiled_lengths' figures of the compiled public function fn at one length."""
    args = leaf_args(make_bench_inputs(shape, small_seqlen=seqlen))
    plain = {k: v.detach() if torch.is_tensor(v) else v for k, v in args.items()}
    out = fn(**args)
    dout = torch.randn_like(out)
    out.backward(dout)
    eager = leaf_args(plain)
    selective_scan_fn(**eager).backward(dout)
    errors = {
        "out_max_abs_err": (out - selective_scan_fn(**plain)).abs().max().item(),
        "du_max_abs_err": (args["u"].grad - eager["u"].grad).abs().max().item(),
    }
    return {
        "fwd_ms": do_bench(lambda: fn(**plain), warmup=25, rep=100, return_mode="median"),
        "fwd_bwd_ms": do_bench(lambda: fwd_bwd_step(fn, args, dout), warmup=25, rep=100,
                               return_mode="median"),
        **errors,
    }  # fmt: skip


def keep_steps(shapes: tuple[str, ...] = ("S1", "S2", "S3", "S4", "S5", "S7")) -> dict:
    """The backward's KEEP_STEPS on and off (tiles.bwd_tiles; scan_bwd.py): its kernels timed
    alone (bwd_op, median ms) and the public function's forward + backward through autograd
    (fwd_bwd_step), each shape in both settings in this process."""
    result = {}
    for shape in shapes:
        result.update(_keep_steps_shape(shape))
        torch.cuda.empty_cache()
    return result


def _keep_steps_shape(shape: str) -> dict:
    """keep_steps' figures of one shape."""
    sets = input_sets(shape)
    leaves = [leaf_args(x) for x in sets]
    douts = [torch.randn_like(x["u"]) for x in sets]
    result = {}
    for keep in (0, 1):
        with use_policy(DEFAULT_POLICY.replace(bwd_overrides={"KEEP_STEPS": keep})):
            ckpts = [fwd_op(x)[2] for x in sets]
            result[f"{shape}_keep{keep}"] = {
                "bwd_ms": time_rotating(lambda i, c=ckpts: bwd_op(sets[i], douts[i], c[i]),
                                        len(sets)),
                "fwd_bwd_ms": time_rotating(
                    lambda i: fwd_bwd_step(selective_scan_fn, leaves[i], douts[i]), len(sets)
                ),
            }  # fmt: skip
        print(shape, keep, json.dumps(result[f"{shape}_keep{keep}"]), file=sys.stderr, flush=True)
    return result


def determinism(shape: str = "S1") -> dict:
    x = make_bench_inputs(shape)
    out, _, ckpt = fwd_op(x)
    dout = torch.randn_like(out)
    first = bwd_op(x, dout, ckpt)
    same = all(
        all(torch.equal(a, b) for a, b in zip(first, bwd_op(x, dout, ckpt), strict=True))
        for _ in range(3)
    )
    return {"bitwise_identical_backward_x3": same}


def broadcast_dout(shape: str = "S1") -> dict:
    """The backward given an expanded dout (time stride 0, as out.sum().backward() gives it),
    which the launcher copies into fresh rows (kernels/scan.py, restaged), against a
    contiguous dout of the same values."""
    x = make_bench_inputs(shape)
    out, _, ckpt = fwd_op(x)
    douts = {"expanded": torch.ones((), dtype=out.dtype, device=out.device).expand_as(out)}
    douts["contiguous"] = douts["expanded"].contiguous()
    return {
        f"{name}_bwd_ms": do_bench(
            lambda d=d: bwd_op(x, d, ckpt),
            warmup=25, rep=100, return_mode="median",
        )
        for name, d in douts.items()
    }  # fmt: skip


def cold_call(shape: str) -> dict:
    """Seconds of this process's first forward and backward call of a shape (bench inputs)."""
    x = make_bench_inputs(shape)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, _, ckpt = fwd_op(x)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    bwd_op(x, torch.randn_like(out), ckpt)
    torch.cuda.synchronize()
    return {"fwd_first_call_s": t1 - t0, "bwd_first_call_s": time.perf_counter() - t1}


def cold_compile() -> dict:
    """cold_call of every shape, each in a fresh process with an empty Triton cache: the time
    a first call spends compiling its configuration's kernels (the shapes' tiles, dtypes and
    passes differ: S4 float32, S3 ranges, S3/S5/S7 2-lane tiles, S5 groups, S6 the PRE pass).
    A process of its own, because kernels compiled earlier in this one stay in memory. About
    140 s on the H200: a call of its own, `--shapes '' --extras cold_compile`."""
    result = {}
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            run = subprocess.run(
                [sys.executable, __file__, "--cold-call", shape],
                env=os.environ | {"TRITON_CACHE_DIR": cache},
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        if run.returncode == 0:
            result[shape] = json.loads(run.stdout.strip().splitlines()[-1])
        else:
            result[shape] = {"error": run.stderr[-500:]}
        print("  cold", shape, json.dumps(result[shape]), file=sys.stderr, flush=True)
    return result


def seqlen_sweep(shape: str = "S1") -> dict:
    """bench_shape at other lengths; 2049 (padded rows) and 2056 (a multiple of T, not of 16)
    check the alignment paths (kernels/scan.py)."""
    result = {}
    for L in (256, 512, 1024, 2048, 2049, 2056, 4096, 8192):
        try:
            result[L] = bench_shape(shape, seqlen=L)
        except Exception as e:
            result[L] = {"error": repr(e)}
    return result


def calling_thread(shape: str = "S6") -> dict:
    """A training step's forward + backward through autograd, ours and the anchor's (through its
    autograd.Function, where it builds), with autograd's device threads on and off
    (torch.autograd.set_multithreading_enabled(False) runs the backward on the calling thread):
    what a host-bound step pays for the engine's hand-off to its device thread."""
    sets = input_sets(shape)
    leaves = [leaf_args(x) for x in sets]
    douts = [torch.randn_like(x["u"]) for x in sets]
    steps = {"ours": selective_scan_fn}
    module = guarded(anchor.build)
    if module is not None and not isinstance(module, dict):
        steps["anchor"] = anchor_step(module)
    result = {}
    for threads, where in ((True, "device_thread"), (False, "calling_thread")):
        with torch.autograd.set_multithreading_enabled(threads):
            for name, fn in steps.items():
                for suffix, calls in REPETITIONS.items():
                    result[f"{name}_fwd_bwd_{where}_{suffix}"] = time_rotating(
                        lambda i, fn=fn: fwd_bwd_step(fn, leaves[i], douts[i]), len(sets), calls
                    )
    return result


def graphed_steps(shapes: tuple[str, ...] = ("S6", "S1")) -> dict:
    """A training step's forward + backward through autograd without the host's time: captured
    whole in a CUDA graph and replayed, ours and the anchor's (through its autograd.Function,
    where it builds), and ours under torch.compile(mode="reduce-overhead"), which records CUDA
    graphs itself; with the eager steps timed in the same run."""
    module = guarded(anchor.build)
    steps = {"ours": selective_scan_fn}
    if module is not None and not isinstance(module, dict):
        steps["anchor"] = anchor_step(module)
    result = {}
    for shape in shapes:
        result[shape] = graphed_shape(shape, steps)
        print(shape, "graphed", json.dumps(result[shape]), flush=True)
        torch.cuda.empty_cache()
    return result


def graphed_shape(shape: str, steps: dict) -> dict:
    """graphed_steps' figures of one shape; steps: the scan functions by name."""
    sets = input_sets(shape)
    leaves = [leaf_args(x) for x in sets]
    douts = [torch.randn_like(x["u"]) for x in sets]
    count = len(sets)
    figures = {}
    for name, fn in steps.items():
        eager = [functools.partial(fwd_bwd_step, fn, leaves[i], douts[i]) for i in range(count)]
        graphs = [capture(step)[0] for step in eager]
        figures[f"{name}_fwd_bwd_ms"] = time_rotating(lambda i, e=eager: e[i](), count)
        figures[f"{name}_fwd_bwd_graph_ms"] = time_rotating(
            lambda i, g=graphs: g[i].replay(), count
        )
    compiled = torch.compile(_own_public_call(), mode="reduce-overhead", fullgraph=True)

    def reduce_overhead(i):
        torch.compiler.cudagraph_mark_step_begin()
        fwd_bwd_step(compiled, leaves[i], douts[i])

    for i in range(3 * count):  # warm-up and recording
        reduce_overhead(i % count)
    for suffix, calls in REPETITIONS.items():
        figures[f"ours_fwd_bwd_reduce_overhead_{suffix}"] = time_rotating(
            reduce_overhead, count, calls
        )
    return figures


EXTRAS = {
    "modes_S6": bench_modes,
    "calling_thread_S6": calling_thread,
    "graphed_steps": graphed_steps,
    "compile_modes_S1": compile_modes,
    "compiled_lengths_S1": compiled_lengths,
    "determinism_S1": determinism,
    "keep_steps": keep_steps,
    "cold_compile": cold_compile,
    "broadcast_dout_S1": broadcast_dout,
    "seqlen_sweep_S1": seqlen_sweep,
}


def resumed(path: str) -> dict:
    """The results of an earlier run of this commit on this device, to complete (--resume):
    the figures of one run may take more than one call of a time-limited machine."""
    results = json.loads(Path(path).read_text())
    here = (git_commit(), torch.cuda.get_device_name(), torch.__version__)
    there = (results["commit"], results["device"], results["torch"])
    if here != there:
        sys.exit(f"--resume: {path} holds a run of {there}, not of {here}")
    results["calls"] = results.get("calls", 1) + 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--extras", default=",".join(EXTRAS), help="comma-separated extras to run ('' for none)"
    )
    parser.add_argument(
        "--compiled", default=None,
        help="shapes whose forward is also timed under torch.compile(dynamic=True) (default: "
        "all; each compiles once more)",
    )  # fmt: skip
    parser.add_argument(
        "--warm", action="store_true",
        help="compile what the shapes and extras run, time and save nothing",
    )  # fmt: skip
    parser.add_argument(
        "--no-anchor", action="store_true",
        help="use the recorded anchor figures instead of building the anchor (bench/anchor.py)",
    )  # fmt: skip
    parser.add_argument(
        "--table", metavar="RESULTS",
        help="print the README's markdown table from a results file (h200.json), run nothing",
    )  # fmt: skip
    parser.add_argument(
        "--resume", metavar="RESULTS",
        help="continue a run of this commit cut by a time limit: start from its results file "
        "and run only the figures it lacks (shapes, compiled figures, extras)",
    )  # fmt: skip
    parser.add_argument("--cold-call", help=argparse.SUPPRESS)  # cold_compile's processes
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())["shapes"]))
        return
    if args.cold_call:
        print(json.dumps(cold_call(args.cold_call)))
        return
    if args.warm:
        for shape in filter(None, args.shapes.split(",")):
            warm_shape(shape)
        for name in filter(None, args.extras.split(",")):
            if name != "cold_compile":  # compiles in processes of its own, into no shared cache
                EXTRAS[name]()
        return
    compiled = set((args.shapes if args.compiled is None else args.compiled).split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "method": "triton.testing.do_bench median (warmup 100 ms, rep 400 ms), inputs rotated "
        "over >= 3x L2; bf16 unless noted; variable B/C, D, z, delta_bias, softplus; *_b2b_ms: "
        f"per call of {BACK_TO_BACK} calls queued back to back a repetition (time_rotating)",
        "shapes": {},
    }
    results = resumed(args.resume) if args.resume else fresh

    def save() -> None:  # after every result: a run cut by its time limit keeps what it measured
        (out_dir / "h200.json").write_text(json.dumps(results, indent=1))

    shapes = list(filter(None, args.shapes.split(",")))
    done = {s for s, figures in results["shapes"].items() if "error" not in figures}
    anchor_module = None
    if not args.no_anchor and not done.issuperset(shapes):
        anchor_module = guarded(anchor.build)
    if not done:
        results["anchor"] = "built in this process" if anchor_module else "recorded figures"
    # Every eager figure before the first compile: a compile's worker processes outlive it
    # (eager host time would share the CPU with them), and a run cut by its time limit keeps
    # the eager figures of every shape.
    for shape in filter(lambda s: s not in done, shapes):
        try:
            results["shapes"][shape] = bench_shape(shape, anchor_module=anchor_module)
        except Exception as e:  # keep the other shapes' numbers
            results["shapes"][shape] = {"error": repr(e)}
        print(shape, json.dumps(results["shapes"][shape]), flush=True)
        save()
    for shape in filter(compiled.__contains__, shapes):
        if "fwd_compiled_ms" in results["shapes"][shape]:  # resumed
            continue
        figures = guarded(compiled_figures, shape)
        if "error" in figures:  # the shape's own "error" means its eager figures failed
            figures = {"compiled_error": figures["error"]}
        results["shapes"][shape].update(figures)
        print(shape, "compiled", json.dumps(figures), flush=True)
        save()
    for name in filter(lambda n: n and n not in results, args.extras.split(",")):
        try:
            results[name] = EXTRAS[name]()
        except Exception as e:
            results[name] = {"error": repr(e)}
        print(name, json.dumps(results[name]), flush=True)
        save()
    print_table(results["shapes"])


def print_table(shapes: dict) -> None:
    """What users pay, per shape: the public forward and forward + backward (eager, compiled)
    against the anchor's, and the backward kernels against the anchor's backward."""
    print(
        f"\n{'shape':6} {'fwd':>7} {'anchor':>7} {'x':>5} | {'fwd+bwd':>7} {'compiled':>8} "
        f"{'anchor':>7} {'x':>5} | {'bwd op':>7} {'anchor':>7} {'x':>5} | floor% f/b | MB"
    )
    for shape, r in shapes.items():
        if "error" in r:
            print(shape, r["error"][:100])
            continue
        compiled = r.get("fwd_bwd_compiled_ms")
        print(
            f"{shape:6} {r['fwd_public_ms']:7.3f} {r.get('anchor_fwd_ms', float('nan')):7.3f} "
            f"{r['fwd_speedup']:5.2f} | {r['fwd_bwd_ms']:7.3f} "
            f"{compiled if compiled is None else round(compiled, 3)!s:>8} "
            f"{r.get('anchor_fwd_bwd_ms', float('nan')):7.3f} {r['fwd_bwd_speedup']:5.2f} | "
            f"{r['bwd_ms']:7.3f} {r.get('anchor_bwd_ms', float('nan')):7.3f} "
            f"{r['bwd_speedup']:5.2f} | {100 * r['fwd_floor_fraction']:4.0f} "
            f"{100 * r['bwd_floor_fraction']:4.0f} | {r['peak_mem_bytes'] / 2**20:.0f}"
        )


def markdown_table(shapes: dict) -> str:
    """The README's table: the public function's forward and forward + backward through
    autograd (eager), the anchor's in the same process (its kernels called directly, and
    through autograd), and the backward's kernels against the anchor's. Compiled figures, which
    a run has for the shapes it compiles only, go in the README's text."""

    def ms(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    def ratio(anchor_ms, ours_ms) -> str:
        return "-" if anchor_ms is None else f"{anchor_ms / ours_ms:.2f}"

    lines = [
        "| shape (batch, dim, dstate, seqlen, groups) | fwd | anchor fwd | x | fwd+bwd "
        "| anchor fwd+bwd | x | anchor fwd+bwd, autograd | x | bwd kernels | anchor bwd | x |",
        "|---" * 12 + "|",
    ]
    for shape, r in shapes.items():
        if "error" in r:
            continue
        batch, dim, dstate, seqlen, groups, dtype = SHAPES[shape]
        name = f"{shape} {batch}, {dim}, {dstate}, {seqlen}, {groups}" + (
            ", fp32" if dtype == torch.float32 else ""
        )
        # The recorded anchor figures where the anchor was not built (as the speedups take them).
        anchor_f = r.get("anchor_fwd_ms", r["recorded_anchor_fwd_ms"])
        anchor_b = r.get("anchor_bwd_ms", r["recorded_anchor_bwd_ms"])
        anchor_fb = r.get("anchor_fwd_bwd_ms", anchor_f + anchor_b)
        autograd = r.get("anchor_fwd_bwd_autograd_ms")
        cells = [
            name, ms(r["fwd_public_ms"]), ms(anchor_f), f"{r['fwd_speedup']:.2f}",
            ms(r["fwd_bwd_ms"]), ms(anchor_fb),
            f"{r['fwd_bwd_speedup']:.2f}", ms(autograd), ratio(autograd, r["fwd_bwd_ms"]),
            ms(r["bwd_kernel_ms"]), ms(anchor_b), ratio(anchor_b, r["bwd_kernel_ms"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
