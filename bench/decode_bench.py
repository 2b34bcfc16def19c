"""Decode benchmark: the step ``selective_state_update`` and a whole-model decode step (H200).

    python bench/decode_bench.py --out $OUT                    (CUDA, all parts)
    python bench/decode_bench.py --device cpu --quick --out /tmp/x   (CPU smoke run)

Parts, each recorded on its own (a failing part records its error, the others still run):

* step: for batch 1, 16, 64, 256 at dim 5120, dstate 16 (fp32 state; bf16 x, dt, z, B, C;
  fp32 A, D, dt_bias; softplus): time per step replayed from CUDA graphs, (a) 64 steps on one
  state (up to batch 64 it stays in L2; how the anchors were timed is not recorded) and (b) one
  step on each of many states and A's that together exceed L2 (as a model's layers are); the
  bytes that must move (state read and written in fp32; x, dt, z, B, C read, out written; A, D,
  dt_bias not counted, as the anchors count) over that time, and its fraction of a
  device-to-device copy measured in this run; error against a float64 step.
* host: one eager call: host time (back-to-back calls, no sync) and synchronized time; the
  direct launch it makes (kernels/launch.py) alone, against Triton's own launch of the same
  kernel, both from a ready plan.
* model: MambaLMHeadModel (bf16) one token per step: latency eager vs the step captured in a
  CUDA graph, and whether the graph's logits equal eager's over a teacher-forced sequence.
* hf: a tiny random transformers MambaForCausalLM, greedy ``generate`` with and without
  ``selective_scan.hf.patch_transformers()``: same tokens?

Writes <out>/decode.json after every part and prints a table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from report import capture, environment, guarded

from selective_scan import MambaLMHeadModel, selective_state_update
from selective_scan.interface import use_triton

# mamba_ssm's Triton selective_state_update replayed from CUDA graphs on the H200, us per step
# (../shared/anchors.md), d=5120, n=16, by batch.
ANCHORS_US = {1: 6.0, 16: 9.1, 64: 17.9, 256: 54.5}
HOST_TARGET_US = 25.0
COPY_TARGET = 0.85  # fraction of copy bandwidth wanted at batch 256
L2_BYTES = 60e6  # H200
GRAPH_STEPS = 64


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_ms(fn: Callable, device: str, quick: bool = False) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA (it flushes L2 before each call), else
    wall time of single calls."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=50 if quick else 150, return_mode="median")
    return 1e3 * synced_s(fn, device, 3 if quick else 20)


def synced_s(fn: Callable, device: str, calls: int) -> float:
    """Median seconds of one call of fn followed by a device synchronization."""
    fn()
    sync(device)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def back_to_back_us(fn: Callable, device: str, calls: int = 100, rounds: int = 30) -> float:
    """Host us per call of fn: rounds of ``calls`` back-to-back calls without synchronizing
    (a round is short enough that the launch queue never fills), median over rounds."""
    for _ in range(20):
        fn()
    per_call = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls)
    sync(device)
    return 1e6 * statistics.median(per_call)


# ---- the step ------------------------------------------------------------------------------


def step_inputs(batch: int, dim: int, dstate: int, device: str, seed: int = 0) -> dict:
    """The anchor's step inputs: state, x, z, B, C ~ N(0, 1); dt ~ 0.5 U(0, 1);
    A = -(0.5 U(0, 1) + 0.1); D ~ N(0, 1); dt_bias ~ 0.5 U(0, 1); softplus on. state (batch,
    dim, dstate) and A, D, dt_bias fp32; x, dt, z (batch, dim) and B, C (batch, dstate) bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def normal(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    def uniform(*shape, dtype=torch.float32):
        return torch.rand(shape, generator=gen, device=device).to(dtype)

    return {
        "state": normal(batch, dim, dstate),
        "x": normal(batch, dim, dtype=bf16),
        "dt": 0.5 * uniform(batch, dim, dtype=bf16),
        "A": -(0.5 * uniform(dim, dstate) + 0.1),
        "B": normal(batch, dstate, dtype=bf16),
        "C": normal(batch, dstate, dtype=bf16),
        "D": normal(dim),
        "z": normal(batch, dim, dtype=bf16),
        "dt_bias": 0.5 * uniform(dim),
        "dt_softplus": True,
    }


def step_bytes(batch: int, dim: int, dstate: int) -> int:
    """Bytes one step must move: fp32 state read and written, bf16 x, dt, z, B, C read and
    out written (the anchors' count: A, D and dt_bias are left out)."""
    return 2 * batch * dim * dstate * 4 + 4 * batch * dim * 2 + 2 * batch * dstate * 2


def step_error(inputs: dict) -> dict:
    """Relative error (norm of the difference / norm of the reference) of one step's out and
    new state against the float64 PyTorch op; out is bf16, so about 2^-9 is the floor."""
    wide = {k: v.double() if torch.is_tensor(v) else v for k, v in inputs.items()}
    state = inputs["state"].clone()
    out = selective_state_update(**{**inputs, "state": state})
    expected = torch.ops.selective_scan.state_update(*wide.values())  # updates wide["state"]

    def rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
        return ((actual.double() - reference).norm() / reference.norm()).item()

    return {"out_rel_err": rel(out, expected), "state_rel_err": rel(state, wide["state"])}


def copy_bandwidth(device: str, quick: bool) -> float:
    """Bytes per second of a device-to-device copy (read + write) of a 512 MiB tensor."""
    src = torch.empty(2**25 if quick else 2**27, device=device)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), device, quick)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def bench_step(batch: int, dim: int, dstate: int, device: str, quick: bool, copy_bw) -> dict:
    inputs = step_inputs(batch, dim, dstate, device)
    result = step_error(inputs)
    nbytes = step_bytes(batch, dim, dstate)
    result["bytes"] = nbytes

    def rate(key: str, us: float) -> None:
        result[f"{key}_us"] = us
        result[f"{key}_GBps"] = nbytes / us * 1e-3
        if copy_bw:
            result[f"{key}_copy_fraction"] = nbytes / (us * 1e-6) / copy_bw

    if device != "cuda":  # no graphs: time eager calls
        rate("eager", 1e3 * device_ms(lambda: selective_state_update(**inputs), device, quick))
        return result
    steps = 4 if quick else GRAPH_STEPS
    graph, _ = capture(lambda: [selective_state_update(**inputs) for _ in range(steps)])
    rate("graph", 1e3 * device_ms(graph.replay, device, quick) / steps)
    if batch in ANCHORS_US and dim == 5120 and dstate == 16:
        result["anchor_us"] = ANCHORS_US[batch]
        result["anchor_over_ours"] = ANCHORS_US[batch] / result["graph_us"]
    # A model's layers each have their own state and A: rotate over enough of them that they
    # cannot stay in L2 (the activations are shared: a model's sit in L2, written just before).
    layer_bytes = (batch + 1) * dim * dstate * 4
    count = 2 if quick else min(256, max(2, math.ceil(3 * L2_BYTES / layer_bytes)))
    layers = [(inputs["state"].clone(), inputs["A"].clone()) for _ in range(count)]
    graph_cold, _ = capture(
        lambda: [selective_state_update(**{**inputs, "state": s, "A": a}) for s, a in layers]
    )
    result["rotating_layers"] = count
    rate("graph_rotating", 1e3 * device_ms(graph_cold.replay, device, quick) / count)
    graph_one, _ = capture(lambda: selective_state_update(**inputs))
    result["graph_one_step_replay_us"] = 1e3 * device_ms(graph_one.replay, device, quick)
    return result


def part_step(args) -> dict:
    copy_bw = copy_bandwidth(args.device, args.quick) if args.device == "cuda" else None
    result = {
        "dim": args.dim,
        "dstate": args.dstate,
        "copy_bandwidth_GBps": copy_bw and copy_bw * 1e-9,
        "copy_fraction_target_at_batch_256": COPY_TARGET,
        "method": f"graph: {GRAPH_STEPS} steps on one state in one CUDA graph; graph_rotating: "
        "one step on each of 'rotating_layers' states and A's; do_bench median of the replay "
        "divided by the steps; GBps = bytes / time",
        "batches": {},
    }
    for batch in args.batches:
        result["batches"][batch] = guarded(
            bench_step, batch, args.dim, args.dstate, args.device, args.quick, copy_bw
        )
    return result


# ---- host time of an eager call -------------------------------------------------------------


def ready_launch(inputs: dict) -> tuple:
    """(jitted kernel, grid, tensors with out by parameter name, scalar arguments, options) of
    a launch of the step on inputs, from the launcher's own plan."""
    from selective_scan.kernels import state_update as kernel_module

    tensors = tuple(inputs.values())[:-1]  # step_inputs' order is the kernel's
    grid, scalars, options = kernel_module._plan(*tensors, inputs["dt_softplus"])
    out = torch.empty_like(inputs["x"])
    # No state_batch_indices: the kernel's argument before out.
    named = dict(zip(kernel_module._TENSORS, (*tensors, None, out), strict=True))
    return kernel_module._state_update_kernel, grid, named, scalars, options


def launch_breakdown(inputs: dict, device: str, rounds: int) -> dict:
    """Host us of the direct launch that eager calls make (kernels/launch.py) and, for
    comparison, of Triton's own launch of the same kernel (argument binding, cache lookup);
    both from a ready plan. Whether the direct launch gives Triton's result is checked too."""
    from selective_scan.kernels.launch import Launcher

    jit, grid, tensors, scalars, options = ready_launch(inputs)
    launcher = Launcher(jit, grid, scalars, options)
    state, out = tensors["state_ptr"], tensors["out_ptr"]
    before = state.clone()
    jit[grid](**tensors, **scalars, **options)
    expected_state, expected_out = state.clone(), out.clone()
    same = True
    for _ in range(2):  # the first call launches through Triton and keeps the kernel
        state.copy_(before)
        launcher(tensors)
        sync(device)
        same &= torch.equal(state, expected_state) and torch.equal(out, expected_out)
    return {
        "direct_launch_us": back_to_back_us(lambda: launcher(tensors), device, rounds=rounds),
        "triton_launch_us": back_to_back_us(
            lambda: jit[grid](**tensors, **scalars, **options), device, rounds=rounds
        ),
        "direct_equals_triton": same,
    }


def part_host(args) -> dict:
    rounds = 3 if args.quick else 30
    result = {
        "target_us": HOST_TARGET_US,
        "method": "host: perf_counter around rounds of 100 back-to-back calls, no sync, "
        "median per call; synced: one call + synchronize, median of 200",
    }
    for batch in (args.batches[0], args.batches[-1]):
        inputs = step_inputs(batch, args.dim, args.dstate, args.device)

        def call(inputs=inputs):
            return selective_state_update(**inputs)

        host_us = back_to_back_us(call, args.device, rounds=rounds)
        result[f"batch_{batch}"] = {
            "eager_host_us": host_us,
            "meets_target": host_us <= HOST_TARGET_US,
            "eager_synced_us": 1e6 * synced_s(call, args.device, 20 if args.quick else 200),
        }
    small = step_inputs(args.batches[0], args.dim, args.dstate, args.device)
    if use_triton(small["state"]):
        result["breakdown"] = guarded(launch_breakdown, small, args.device, rounds)
    else:
        result["breakdown"] = {"skipped": "the torch backend runs here: no Triton launch"}
    return result


# ---- a whole model ---------------------------------------------------------------------------


def model_decode(model: MambaLMHeadModel, batch: int, vocab: int, device: str, quick) -> dict:
    """Per-token latency of one model step, eager and replayed from a CUDA graph, and the
    graph's logits against eager's over a teacher-forced token sequence from a zero cache."""
    zero = model.allocate_inference_cache(batch)
    cache = [(conv.clone(), ssm.clone()) for conv, ssm in zero]
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(vocab, (4 if quick else 16, batch, 1), generator=gen, device=device)

    @torch.no_grad()
    def step() -> torch.Tensor:
        """One token from the static ids and cache; the new cache is copied back into it."""
        logits, new_cache = model.step(ids, cache)
        for (conv, ssm), (new_conv, new_ssm) in zip(cache, new_cache, strict=True):
            conv.copy_(new_conv)
            ssm.copy_(new_ssm)
        return logits

    def decode(run: Callable[[], torch.Tensor]) -> torch.Tensor:
        for (conv, ssm), (conv0, ssm0) in zip(cache, zero, strict=True):
            conv.copy_(conv0)
            ssm.copy_(ssm0)
        logits = []
        for token in tokens:
            ids.copy_(token)
            logits.append(run().clone())
        return torch.stack(logits)

    eager_logits = decode(step)
    result = {
        "eager_ms": device_ms(step, device, quick),
        "eager_synced_ms": 1e3 * synced_s(step, device, 5 if quick else 50),
    }
    if device != "cuda":
        result["graph"] = "skipped: needs CUDA"
        return result
    graph, static_logits = capture(step)

    def replay() -> torch.Tensor:
        graph.replay()
        return static_logits

    graph_logits = decode(replay)
    result.update(
        graph_ms=device_ms(graph.replay, device, quick),
        graph_synced_ms=1e3 * synced_s(graph.replay, device, 5 if quick else 50),
        graph_equals_eager=torch.equal(graph_logits, eager_logits),
        graph_max_abs_diff=(graph_logits.float() - eager_logits.float()).abs().max().item(),
        same_argmax=torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1)),
        tokens_compared=len(tokens),
    )
    result["graph_speedup"] = result["eager_ms"] / result["graph_ms"]
    return result


def part_model(args) -> dict:
    d_model, n_layer, vocab = (64, 2, 256) if args.quick else (2560, 4, 50280)
    torch.manual_seed(0)
    model = MambaLMHeadModel(
        d_model, n_layer, vocab, pad_vocab_size_multiple=8, device=args.device,
        dtype=torch.bfloat16,
    ).eval()  # fmt: skip
    result = {"d_model": d_model, "n_layer": n_layer, "vocab": vocab, "dtype": "bf16"}
    for batch in (1,) if args.quick else (1, 16):
        result[f"batch_{batch}"] = guarded(
            model_decode, model, batch, vocab, args.device, args.quick
        )
    return result


# ---- transformers ----------------------------------------------------------------------------


@contextlib.contextmanager
def patched_transformers(calls: Counter):
    """transformers' Mamba on our functions, counting the calls to each patched global."""
    from transformers.models.mamba import modeling_mamba

    from selective_scan import hf

    def counting(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    try:
        for name, value in hf.patch_transformers().items():
            if callable(value):
                setattr(modeling_mamba, name, counting(name, value))
        yield
    finally:
        hf.unpatch_transformers()


def part_hf(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network
    import transformers
    from transformers import MambaConfig, MambaForCausalLM

    config = dict(vocab_size=1000, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                  conv_kernel=4)  # fmt: skip
    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(**config)).to(args.device).eval()
    gen = torch.Generator(device=args.device).manual_seed(2)
    ids = torch.randint(config["vocab_size"], (2, 8), generator=gen, device=args.device)
    kwargs = dict(max_new_tokens=8 if args.quick else 32, do_sample=False, pad_token_id=0)
    result = {"transformers": transformers.__version__, "config": config, "prompt": list(ids.shape)}
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        # Near-ties between the two best logits are where two correct implementations may
        # pick different tokens: report the smallest gap along the reference sequence.
        top2 = model(expected).logits[:, ids.shape[1] - 1 : -1].float().topk(2, dim=-1).values
        result["min_top2_gap"] = (top2[..., 0] - top2[..., 1]).min().item()
        calls = Counter()
        with patched_transformers(calls):
            ours = model.generate(ids, **kwargs)
    same = ours.shape == expected.shape and torch.equal(ours, expected)
    result.update(same_tokens=same, generated=list(ours.shape), calls=dict(calls))
    if not same and ours.shape == expected.shape:
        differ = (ours != expected).nonzero()
        result["first_difference"] = differ[0].tolist()
    return result


# ---- driver ----------------------------------------------------------------------------------


PARTS = {
    "step": part_step,
    "host": part_host,
    "model": part_model,
    "hf": part_hf,
}


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_step(step: dict) -> None:
    copy = _num(step["copy_bandwidth_GBps"], ".0f")
    target = 100 * step["copy_fraction_target_at_batch_256"]
    print(f"\nstep, dim {step['dim']}, dstate {step['dstate']}: us per step (copy {copy} GB/s; "
          f"target >= {target:.0f}% of it at batch 256)")  # fmt: skip
    print("batch    graph anchor  GB/s %copy | rotating  GB/s %copy | 1-step  out err")
    for batch, r in step["batches"].items():
        if "error" in r:
            print(f"{batch:>5} {r['error'][:100]}")
            continue
        key = "graph" if "graph_us" in r else "eager"
        fraction = 100 * r.get(f"{key}_copy_fraction", math.nan)
        cold, cold_fraction = (
            r.get("graph_rotating_us", math.nan),
            100 * r.get("graph_rotating_copy_fraction", math.nan),
        )
        print(
            f"{batch:>5} {r[f'{key}_us']:8.2f} {_num(r.get('anchor_us'), '6.1f'):>6} "
            f"{r[f'{key}_GBps']:5.0f} {fraction:4.0f}% | {cold:8.2f} "
            f"{r.get('graph_rotating_GBps', math.nan):5.0f} {cold_fraction:4.0f}% | "
            f"{r.get('graph_one_step_replay_us', math.nan):6.2f} {r['out_rel_err']:8.1e}"
        )


def print_host(host: dict) -> None:
    print(f"\neager call, us per call (target <= {host['target_us']:.0f} us of host time):")
    for key, r in host.items():
        if key.startswith("batch_"):
            print(f"  {key}: host {_num(r.get('eager_host_us'), '.1f')}, "
                  f"synchronized {_num(r.get('eager_synced_us'), '.1f')}")  # fmt: skip
    parts = host.get("breakdown", {})
    if "error" in parts or "skipped" in parts:
        print(f"  breakdown: {parts.get('error', parts.get('skipped'))[:300]}")
    else:
        print("  breakdown: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))


def print_model(model: dict) -> None:
    print(f"\nmodel d_model {model['d_model']}, {model['n_layer']} layers, bf16: ms per token")
    for key, r in model.items():
        if key.startswith("batch_"):
            print(f"  {key}: eager {_num(r.get('eager_ms'), '.3f')}, graph "
                  f"{_num(r.get('graph_ms'), '.3f')}, graph logits == eager: "
                  f"{r.get('graph_equals_eager', r.get('graph', r.get('error')))}")  # fmt: skip


def print_hf(hf: dict) -> None:
    print(f"\ntransformers {hf['transformers']}: generate gives the same tokens with and without "
          f"patch_transformers: {hf['same_tokens']} (calls {hf['calls']})")  # fmt: skip


def print_table(results: dict) -> None:
    printers = {
        "step": print_step,
        "host": print_host,
        "model": print_model,
        "hf": print_hf,
    }
    for name, printer in printers.items():
        if name not in results:
            continue
        if "error" in results[name]:
            print(f"\n{name}: {results[name]['error'][:300]}")
            continue
        try:
            printer(results[name])
        except Exception as e:  # a missing number must not hide the others
            print(f"\n{name}: (table: {e!r})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--batches", default=None, help="1,16,64,256 (1,4 with --quick)")
    parser.add_argument("--dim", type=int, default=None, help="5120 (64 with --quick)")
    parser.add_argument("--dstate", type=int, default=16)
    args = parser.parse_args()
    args.batches = [
        int(b) for b in (args.batches or ("1,4" if args.quick else "1,16,64,256")).split(",")
    ]
    args.dim = args.dim or (64 if args.quick else 5120)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = environment(args.device)
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        results[name] = guarded(PARTS[name], args)
        results[name]["part_seconds"] = time.perf_counter() - t0
        print(name, json.dumps(results[name], default=str)[:400], flush=True)
        (out_dir / "decode.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results)


if __name__ == "__main__":
    main()
