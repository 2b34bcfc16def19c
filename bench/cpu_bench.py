"""CPU benchmark of the chunked PyTorch scan against the pure-PyTorch scans people run today.

    python bench/cpu_bench.py [--shapes C1,C2] [--repeats 7] [--out bench/results/cpu.json]

For each shape (float32, variable B/C, D, z, delta_bias, softplus), forward and forward +
backward of:

* ``ours``: ``selective_scan_fn`` on CPU tensors (the ``selective_scan::scan_fwd/bwd`` ops,
  cpu.py's chunked scan with its analytic backward);
* ``ref``: ``selective_scan_ref``, the sequential loop in the style of mamba_ssm's reference
  (backward by autograd through the loop);
* ``mambapy``: mambapy 1.2.0's parallel scan (``mambapy.pscan.pscan``, a Blelloch scan over
  materialized (batch, seqlen, dim, dstate) tensors), wrapped the way its ``MambaBlock`` uses it
  on CPU: softplus(delta + bias), exp(delta A), delta B u, pscan, C h + D u, times silu(z). Its
  inputs are given in its own (batch, seqlen, dim) layout, so no transposes are timed for it.

Time is the median (and min) of ``--repeats`` calls after one warm-up call, with
torch.set_num_threads(os.cpu_count()). Writes a JSON file (CPU model, date, torch version,
threads, load average, per shape and method the times and the speedups of ours) and prints a
table. The load average, niceness and OMP_WAIT_POLICY are recorded because other processes
sharing the cores inflate the times, the multi-threaded ops most: with libgomp's default
spin-then-sleep barriers, one busy core can stall every parallel op by a scheduler tick.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from report import cpu_model

from selective_scan import cpu, selective_scan_fn, selective_scan_ref

try:
    from mambapy.pscan import pscan
except ImportError:  # the table then says n/a for mambapy
    pscan = None

# name: (batch, dim, dstate, seqlen); realistic CPU inference/fine-tuning sizes of Mamba layers
# (dim = 2 x d_model for the 130M (768) and 370M-790M (1536) models).
SHAPES = {
    "C1": (1, 768, 16, 256),
    "C2": (2, 768, 16, 512),
    "C3": (1, 1536, 16, 1024),
    "C4": (2, 1536, 16, 2048),
}
METHODS = ("ours", "ref", "mambapy")
ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(batch: int, dim: int, dstate: int, seqlen: int, seed: int = 0) -> dict:
    """The anchors' distributions (shared/anchors.md), float32: u, z, B, C ~ N(0,1);
    delta ~ 0.5 U(0,1); A = -(0.5 U(0,1) + 0.1); D ~ N(0,1); delta_bias ~ 0.5 U(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *s: torch.randn(s, generator=gen)  # noqa: E731
    uniform = lambda *s: torch.rand(s, generator=gen)  # noqa: E731
    return {
        "u": normal(batch, dim, seqlen),
        "delta": 0.5 * uniform(batch, dim, seqlen),
        "A": -(0.5 * uniform(dim, dstate) + 0.1),
        "B": normal(batch, dstate, seqlen),
        "C": normal(batch, dstate, seqlen),
        "D": normal(dim),
        "z": normal(batch, dim, seqlen),
        "delta_bias": 0.5 * uniform(dim),
    }


def mambapy_scan(x, delta, A, B, C, D, z, delta_bias):
    """mambapy's CPU selective scan in its own layout: x, delta, z (batch, seqlen, dim);
    B, C (batch, seqlen, dstate); A (dim, dstate); D, delta_bias (dim,). Returns y * silu(z)
    (batch, seqlen, dim). Mirrors MambaBlock.ssm + selective_scan of mambapy 1.2.0."""
    delta = F.softplus(delta + delta_bias)
    deltaA = torch.exp(delta.unsqueeze(-1) * A)  # (batch, seqlen, dim, dstate)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    hs = pscan(deltaA, BX)
    y = (hs @ C.unsqueeze(-1)).squeeze(3) + D * x
    return y * F.silu(z)


def mambapy_layout(inputs: dict) -> dict:
    """Our (batch, dim, seqlen) / (batch, dstate, seqlen) inputs in mambapy's layout."""
    seq_major = {k: inputs[k].transpose(1, 2).contiguous() for k in ("u", "delta", "B", "C", "z")}
    return {
        "x": seq_major["u"], "delta": seq_major["delta"], "A": inputs["A"],
        "B": seq_major["B"], "C": seq_major["C"], "D": inputs["D"], "z": seq_major["z"],
        "delta_bias": inputs["delta_bias"],
    }  # fmt: skip


def method_fn(method: str, inputs: dict) -> Callable[..., torch.Tensor]:
    """A function of the method's own keyword inputs returning its output."""
    if method == "mambapy":
        return lambda **kw: mambapy_scan(**kw)
    scan = selective_scan_fn if method == "ours" else selective_scan_ref
    return lambda **kw: scan(**kw, delta_softplus=True)


def timed(fn: Callable[[], object], repeats: int) -> dict:
    """{"median_ms", "min_ms"} of ``repeats`` calls of fn after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


def bench_method(method: str, inputs: dict, repeats: int) -> dict:
    """Forward (no grad) and forward + backward (every float input a leaf) of one method."""
    kwargs = mambapy_layout(inputs) if method == "mambapy" else inputs
    fn = method_fn(method, inputs)
    dout = torch.randn_like(kwargs["x" if method == "mambapy" else "u"])

    def forward():
        with torch.no_grad():
            fn(**kwargs)

    def forward_backward():
        leaves = {k: v.detach().requires_grad_() for k, v in kwargs.items()}
        fn(**leaves).backward(dout)

    return {"fwd": timed(forward, repeats), "fwd+bwd": timed(forward_backward, repeats)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls after warm-up")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count() or 1)
    torch.exp(torch.zeros(1))  # torch 2.13 CPU: the first exp of a process may be inexact
    methods = [m for m in METHODS if m != "mambapy" or pscan is not None]
    result = {
        "cpu": cpu_model(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "chunk": cpu.CHUNK,
        "dtype": "float32",
        "options": "variable B/C, D, z, delta_bias, delta_softplus",
        "timing": f"median and min of {args.repeats} calls after 1 warm-up call",
        "mambapy": "1.2.0 (mambapy.pscan.pscan)" if pscan is not None else "not installed",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "nice": os.nice(0),
        "loadavg_before": os.getloadavg(),
        "shapes": {},
    }
    for name in args.shapes.split(","):
        batch, dim, dstate, seqlen = SHAPES[name]
        inputs = make_inputs(batch, dim, dstate, seqlen)
        row = {"batch": batch, "dim": dim, "dstate": dstate, "seqlen": seqlen, "ms": {}}
        for method in methods:
            row["ms"][method] = bench_method(method, inputs, args.repeats)
            print(f"{name} {method}: {row['ms'][method]}", flush=True)
        ours = row["ms"]["ours"]
        row["speedup_of_ours"] = {
            method: {
                kind: round(row["ms"][method][kind]["median_ms"] / ours[kind]["median_ms"], 2)
                for kind in ("fwd", "fwd+bwd")
            }
            for method in methods
            if method != "ours"
        }
        result["shapes"][name] = row
    result["loadavg_after"] = os.getloadavg()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"wrote {out}")
    return result


def format_table(result: dict) -> str:
    """Markdown table of the medians (ms) and ours' speedups."""
    methods = list(next(iter(result["shapes"].values()))["ms"])
    head = ["shape (b, d, n, L)"]
    for kind in ("fwd", "fwd+bwd"):
        head += [f"{m} {kind}" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["shapes"].items():
        cells = [f"{name} ({row['batch']}, {row['dim']}, {row['dstate']}, {row['seqlen']})"]
        for kind in ("fwd", "fwd+bwd"):
            for m in methods:
                ms = row["ms"][m][kind]["median_ms"]
                speedup = row["speedup_of_ours"].get(m, {}).get(kind)
                cells.append(f"{ms:.1f}" + (f" ({speedup:.1f}x)" if speedup else ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("ms, median; (Nx) = that method's time / ours.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
