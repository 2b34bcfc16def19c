"""Packed sequences (``cu_seqlens``) vs a padded batch, on a realistic mix of lengths (H200).

    python bench/varlen_bench.py --out $OUT [--dim 2048] [--seqs 64]
    python bench/varlen_bench.py --device cpu --quick --out /tmp/x      (CPU smoke run)

64 sequences with lengths drawn log-uniformly from 64..8192 (seeded), dim 2048, dstate 16,
bf16, variable B/C, D, z, delta_bias and softplus, inputs drawn as the anchors' (shapes.py).
Packed: batch 1, the sequences one after the other along seqlen, ``cu_seqlens`` marking them.
Padded: batch 64, every sequence zero-padded at its end to the longest.

For each layout: forward and forward + backward time of ``selective_scan_fn`` (do_bench
median), real tokens per second (padding not counted), peak memory of forward + backward;
the padding fraction; and the packed results against the padded ones on the real tokens:
out, and the gradients of every input (those of A, D, delta_bias summed over all tokens).
Writes <out>/varlen.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from report import environment, guarded

from selective_scan import selective_scan_fn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PER_TOKEN = ("u", "delta", "z", "B", "C")  # inputs with a seqlen axis; the rest are weights
WEIGHTS = ("A", "D", "delta_bias")


def draw_lengths(count: int, shortest: int, longest: int, seed: int) -> list[int]:
    """count lengths, log-uniform in [shortest, longest]."""
    gen = torch.Generator().manual_seed(seed)
    logs = torch.empty(count).uniform_(math.log(shortest), math.log(longest), generator=gen)
    return [round(math.exp(v)) for v in logs.tolist()]


def packed_inputs(lengths: list[int], dim: int, dstate: int, dtype, device: str) -> dict:
    """Batch-1 inputs of sum(lengths) tokens: u, z, B, C ~ N(0, 1); delta ~ 0.5 U(0, 1);
    A = -(0.5 U(0, 1) + 0.1); D ~ N(0, 1); delta_bias ~ 0.5 U(0, 1); and cu_seqlens."""
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)

    def normal(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device=device).to(dt)

    def uniform(*shape, dt=torch.float32):
        return torch.rand(shape, generator=gen, device=device).to(dt)

    ends = torch.tensor([0, *lengths], device=device).cumsum(0)
    return {
        "u": normal(1, dim, total),
        "delta": 0.5 * uniform(1, dim, total, dt=dtype),
        "A": -(0.5 * uniform(dim, dstate) + 0.1),
        "B": normal(1, dstate, total),
        "C": normal(1, dstate, total),
        "D": normal(dim, dt=torch.float32),
        "z": normal(1, dim, total),
        "delta_bias": 0.5 * uniform(dim),
        "cu_seqlens": ends.to(torch.int32),
    }


def segments(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(sequence index, start in the packed layout, length) of each sequence."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    return list(zip(range(len(lengths)), starts, lengths, strict=True))


def pad(packed: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(1, channels, total) -> (len(lengths), channels, max(lengths)), zeros after each end."""
    out = packed.new_zeros(len(lengths), packed.shape[1], max(lengths))
    for i, start, length in segments(lengths):
        out[i, :, :length] = packed[0, :, start : start + length]
    return out


def padded_inputs(packed: dict, lengths: list[int]) -> dict:
    return {
        **{k: pad(packed[k], lengths) for k in PER_TOKEN},
        **{k: packed[k] for k in WEIGHTS},
        "cu_seqlens": None,
    }


def time_ms(fn: Callable, device: str, quick: bool) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA, wall time of single calls elsewhere."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100 if quick else 400, return_mode="median")
    fn()
    times = []
    for _ in range(3 if quick else 10):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def forward_backward(inputs: dict, dout: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(out, {name: gradient}) of selective_scan_fn with softplus, backward from dout."""
    leaves = {k: inputs[k].detach().requires_grad_() for k in (*PER_TOKEN, *WEIGHTS)}
    out = selective_scan_fn(**leaves, delta_softplus=True, cu_seqlens=inputs["cu_seqlens"])
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return out, dict(zip(leaves, grads, strict=True))


def bench_layout(inputs: dict, dout: torch.Tensor, tokens: int, device: str, quick) -> dict:
    def forward():
        with torch.no_grad():
            return selective_scan_fn(**inputs, delta_softplus=True)

    fwd_ms = time_ms(forward, device, quick)
    fwd_bwd_ms = time_ms(lambda: forward_backward(inputs, dout), device, quick)
    result = {
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_tokens_per_s": tokens / (fwd_ms * 1e-3),
        "fwd_bwd_tokens_per_s": tokens / (fwd_bwd_ms * 1e-3),
    }
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward(inputs, dout)
        torch.cuda.synchronize()
        result["fwd_bwd_peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return result


class Agreement:
    """Max abs difference and relative (norm) error of packed results against padded ones,
    accumulated sequence by sequence over the real tokens."""

    def __init__(self):
        self.max_abs, self.diff_sq, self.ref_sq = 0.0, 0.0, 0.0

    def add(self, actual: torch.Tensor, reference: torch.Tensor) -> None:
        diff = actual.double() - reference.double()
        self.max_abs = max(self.max_abs, diff.abs().max().item())
        self.diff_sq += diff.square().sum().item()
        self.ref_sq += reference.double().square().sum().item()

    def report(self) -> dict:
        return {"max_abs_diff": self.max_abs, "rel_err": math.sqrt(self.diff_sq / self.ref_sq)}


def compare(packed: tuple, padded: tuple, lengths: list[int]) -> dict:
    """Packed (out, grads) against padded (out, grads) on the real tokens."""
    (out_k, grads_k), (out_p, grads_p) = packed, padded
    result = {}
    pairs = [("out", out_k, out_p), *((f"d{k}", grads_k[k], grads_p[k]) for k in PER_TOKEN)]
    for name, a, b in pairs:
        agreement = Agreement()
        for i, start, length in segments(lengths):
            agreement.add(a[0, :, start : start + length], b[i, :, :length])
        result[name] = agreement.report()
    for name in WEIGHTS:
        agreement = Agreement()
        agreement.add(grads_k[name], grads_p[name])
        result[f"d{name}"] = agreement.report()
    return result


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    lengths = draw_lengths(args.seqs, args.shortest, args.longest, args.seed)
    lengths[-1] += -sum(lengths) % args.total_multiple
    tokens, padded_tokens = sum(lengths), len(lengths) * max(lengths)
    packed = packed_inputs(lengths, args.dim, args.dstate, dtype, args.device)
    padded = padded_inputs(packed, lengths)
    gen = torch.Generator(device=args.device).manual_seed(1)
    dout_packed = torch.randn(packed["u"].shape, generator=gen, device=args.device).to(dtype)
    dout_padded = pad(dout_packed, lengths)  # zero on the padding: only real tokens count
    result = {
        "lengths": lengths,
        "tokens": tokens,
        "padded_tokens": padded_tokens,
        "padding_fraction": 1 - tokens / padded_tokens,
    }
    for name, inputs, dout in (("packed", packed, dout_packed), ("padded", padded, dout_padded)):
        result[name] = guarded(bench_layout, inputs, dout, tokens, args.device, args.quick)
    for key in ("fwd_ms", "fwd_bwd_ms"):
        if key in result["packed"] and key in result["padded"]:
            result[f"packed_speedup_{key.removesuffix('_ms')}"] = (
                result["padded"][key] / result["packed"][key]
            )
    result["agreement"] = guarded(
        lambda: compare(
            forward_backward(packed, dout_packed), forward_backward(padded, dout_padded), lengths
        )
    )
    return result


def print_table(result: dict, config: dict) -> None:
    print(
        f"\n{config['seqs']} sequences, {result['tokens']} tokens (padded: "
        f"{result['padded_tokens']}, {100 * result['padding_fraction']:.0f}% padding), dim "
        f"{config['dim']}, dstate {config['dstate']}, {config['dtype']}"
    )
    print("layout    fwd ms   fwd_bwd ms   fwd Mtok/s  fwd_bwd Mtok/s  peak MB")
    for name in ("packed", "padded"):
        r = result[name]
        if "error" in r:
            print(f"{name:8} {r['error'][:100]}")
            continue
        print(
            f"{name:8} {r['fwd_ms']:7.3f} {r['fwd_bwd_ms']:11.3f} "
            f"{r['fwd_tokens_per_s'] * 1e-6:12.1f} {r['fwd_bwd_tokens_per_s'] * 1e-6:15.1f} "
            f"{r.get('fwd_bwd_peak_MB', math.nan):8.0f}"
        )
    agreement = result["agreement"]
    if "error" in agreement:
        print("packed vs padded:", agreement["error"][:300])
    else:
        print("packed vs padded on real tokens (max abs diff / rel err):")
        print("  " + ", ".join(f"{k} {v['max_abs_diff']:.2e}/{v['rel_err']:.1e}"
                               for k, v in agreement.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--seqs", type=int, default=None, help="64 (4 with --quick)")
    parser.add_argument("--shortest", type=int, default=None, help="64 (4 with --quick)")
    parser.add_argument("--longest", type=int, default=None, help="8192 (64 with --quick)")
    parser.add_argument("--dim", type=int, default=None, help="2048 (16 with --quick)")
    parser.add_argument("--dstate", type=int, default=16)
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--total-multiple", type=int, default=1,
        help="lengthen the last sequence so that the total is a multiple of this (8: the bf16 "
        "kernels then load whole tiles, see ALIGN in kernels/scan.py)",
    )  # fmt: skip
    args = parser.parse_args()
    defaults = {"seqs": (64, 4), "shortest": (64, 4), "longest": (8192, 64), "dim": (2048, 16)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    config = {k: getattr(args, k) for k in ("seqs", "shortest", "longest", "dim", "dstate",
                                            "dtype", "seed")}  # fmt: skip
    results = {
        **environment(args.device),
        "config": config,
        "method": "do_bench median (warmup 25 ms, rep 400 ms); fwd under no_grad; fwd_bwd: "
        "forward with every float input a leaf, then torch.autograd.grad from a random dout "
        "(zero on the padding)",
    }
    t0 = time.perf_counter()
    results.update(guarded(run, args))
    results["seconds"] = time.perf_counter() - t0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "varlen.json").write_text(json.dumps(results, indent=1))
    if "error" in results:
        print(results["error"], results["traceback"])
    else:
        print_table(results, config)


if __name__ == "__main__":
    main()
