"""Run the selective scan every way a model ships, and check each against float64.

    python -m selective_scan.apps.demo                  # CPU, or CUDA when a GPU is present
    python -m selective_scan.apps.demo --device cpu --seqlen 1024 --out /tmp/scan

A Mamba-style layer (A, D and delta_bias as parameters; u, delta, B, C and z as inputs) runs on
random inputs in eager mode, under ``torch.compile(fullgraph=True)``, as a ``torch.export``
program saved to disk and loaded back, and as an AOTInductor package compiled, saved and loaded
back. Each result is compared with ``selective_scan_ref`` run in float64 on the same values; the
eager backward is checked the same way. Prints one table row per mode and where the files went;
exits 1 if any error exceeds its bound. ``--modes`` runs a subset (e.g. without ``aoti`` where
loading AOTInductor libraries is broken, as on one torch 2.11 CUDA image).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import selective_scan_fn, selective_scan_ref
from . import device_from

# Bounds on the relative error ||actual - reference|| / ||reference|| (the worst over every
# output or gradient) by input dtype. Float32 runs measure about 1e-6; the low-precision bounds
# cover the rounding of the outputs (half an ulp: 2^-9 bf16, 2^-12 fp16).
BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class ScanLayer(torch.nn.Module):
    """The scan as a Mamba block calls it: A (through A_log), D and delta_bias are parameters.

    forward(u, delta, B, C, z) with u, delta, z: (batch, dim, seqlen) and B, C: (batch, dstate,
    seqlen) returns (out (batch, dim, seqlen), last_state (batch, dim, dstate)).
    """

    def __init__(self, dim: int, dstate: int, generator: torch.Generator):
        super().__init__()
        # Distributions of the project's anchor measurements: A = -(0.5 U(0,1) + 0.1), etc.
        A = -(0.5 * torch.rand(dim, dstate, generator=generator) + 0.1)
        self.A_log = torch.nn.Parameter(torch.log(-A))
        self.D = torch.nn.Parameter(torch.randn(dim, generator=generator))
        self.delta_bias = torch.nn.Parameter(0.5 * torch.rand(dim, generator=generator))

    def forward(self, u: Tensor, delta: Tensor, B: Tensor, C: Tensor, z: Tensor):
        A = -torch.exp(self.A_log)
        return selective_scan_fn(
            u, delta, A, B, C, self.D, z, self.delta_bias,
            delta_softplus=True, return_last_state=True,
        )  # fmt: skip


def make_inputs(
    batch: int, dim: int, dstate: int, seqlen: int, dtype: torch.dtype, generator: torch.Generator
) -> tuple[Tensor, ...]:
    """Fresh random (u, delta, B, C, z) on the CPU: u, B, C, z ~ N(0,1), delta ~ 0.5 U(0,1)."""
    return (
        torch.randn(batch, dim, seqlen, generator=generator).to(dtype),
        (0.5 * torch.rand(batch, dim, seqlen, generator=generator)).to(dtype),
        torch.randn(batch, dstate, seqlen, generator=generator).to(dtype),
        torch.randn(batch, dstate, seqlen, generator=generator).to(dtype),
        torch.randn(batch, dim, seqlen, generator=generator).to(dtype),
    )


def reference(layer: ScanLayer, inputs: Sequence[Tensor], grad_out: Sequence[Tensor] | None):
    """(out, last_state) of the float64 reference on the same values and, with grad_out, the
    gradients of sum(out * grad_out[0]) + sum(last_state * grad_out[1]) w.r.t. the inputs and
    the parameters, in the order (u, delta, B, C, z, A_log, D, delta_bias)."""
    params = [p.detach().double().cpu().requires_grad_() for p in layer.parameters()]
    args = [t.detach().double().cpu().requires_grad_() for t in inputs]
    A_log, D, delta_bias = params
    u, delta, B, C, z = args
    out, last = selective_scan_ref(
        u, delta, -torch.exp(A_log), B, C, D, z, delta_bias,
        delta_softplus=True, return_last_state=True,
    )  # fmt: skip
    if grad_out is None:
        return (out.detach(), last.detach()), None
    loss = (out * grad_out[0].double().cpu()).sum() + (last * grad_out[1].double().cpu()).sum()
    return (out.detach(), last.detach()), torch.autograd.grad(loss, args + params)


def rel_err(actual: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    """Worst ||a - e|| / ||e|| over pairs of tensors, in float64; a non-finite value gives inf."""
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        a = a.detach().double().cpu()
        if not torch.isfinite(a).all():
            return float("inf")
        worst = max(worst, ((a - e).norm() / e.norm().clamp_min(1e-300)).item())
    return worst


def time_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms over ``repeats`` calls, after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@dataclass
class Row:
    """One line of the report: how the op ran, what it cost and how far it was off."""

    mode: str
    build_s: float  # compile / export / package time (0 for eager)
    ms: float  # median time per call
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound


MODES = ("eager", "backward", "compile", "export", "aoti")


def second_seqlen(seqlen: int) -> int:
    """The other length the exported program and the package are checked at."""
    return max(2, seqlen // 2 + 1)


def run_demo(
    batch: int = 2,
    dim: int = 768,
    dstate: int = 16,
    seqlen: int = 512,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    out_dir: str | Path = "artifacts",
    repeats: int = 5,
    seed: int = 0,
    modes: Sequence[str] = MODES,
) -> tuple[list[Row], dict[str, Path]]:
    """Run and check each of ``modes`` (a subset of MODES); returns the rows and the paths of
    the files written."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    layer = ScanLayer(dim, dstate, gen).to(dev)
    inputs = tuple(t.to(dev) for t in make_inputs(batch, dim, dstate, seqlen, dtype, gen))
    grad_out = (
        torch.randn(batch, dim, seqlen, generator=gen).to(device=dev, dtype=dtype),
        torch.randn(batch, dim, dstate, generator=gen).to(dev),
    )
    expected, expected_grads = reference(layer, inputs, grad_out if "backward" in modes else None)
    # The exported program and the package have a dynamic seqlen: also checked at another one.
    other_seqlen = second_seqlen(seqlen)
    other = tuple(t.to(dev) for t in make_inputs(batch, dim, dstate, other_seqlen, dtype, gen))
    other_expected = reference(layer, other, None)[0] if {"export", "aoti"} & set(modes) else None
    bound = BOUNDS[dtype]
    rows, paths = [], {}

    def check(mode: str, build_s: float, fn: Callable, dynamic: bool = False) -> None:
        """Time fn on the inputs and record its error; with dynamic, the worst error over both
        sequence lengths."""
        with torch.no_grad():
            ms = time_call(lambda: fn(*inputs), repeats, dev)
            error = rel_err(fn(*inputs), expected)
            if dynamic:
                error = max(error, rel_err(fn(*other), other_expected))
        rows.append(Row(mode, build_s, ms, error, bound))

    def forward_backward():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out, last = layer(*leaves)
        loss = (out * grad_out[0]).sum() + (last * grad_out[1]).sum()
        return torch.autograd.grad(loss, leaves + list(layer.parameters()))

    if "eager" in modes:
        check("eager", 0.0, layer)
    if "backward" in modes:
        ms = time_call(forward_backward, repeats, dev)
        error = rel_err(forward_backward(), expected_grads)
        rows.append(Row("eager fwd+bwd", 0.0, ms, error, bound))
    if "compile" in modes:
        start = time.perf_counter()
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            compiled(*inputs)  # compiles
        check("torch.compile", time.perf_counter() - start, compiled)
    if "export" in modes or "aoti" in modes:
        # seqlen is dynamic from 2 up (sizes 0 and 1 would specialize): one file serves every
        # length. The files are loaded back before running, as a deployment would.
        seq = torch.export.Dim("seqlen", min=2)
        dynamic = {name: {2: seq} for name in ("u", "delta", "B", "C", "z")}
        start = time.perf_counter()
        exported = torch.export.export(layer, inputs, dynamic_shapes=dynamic)
        export_s = time.perf_counter() - start
    if "export" in modes:
        paths["torch.export"] = out_dir / "scan_exported.pt2"
        start = time.perf_counter()
        torch.export.save(exported, paths["torch.export"])
        loaded = torch.export.load(paths["torch.export"]).module()
        check("torch.export", export_s + time.perf_counter() - start, loaded, dynamic=True)
    if "aoti" in modes:
        paths["AOTInductor"] = out_dir / "scan_aoti.pt2"
        start = time.perf_counter()
        torch._inductor.aoti_compile_and_package(exported, package_path=str(paths["AOTInductor"]))
        package = torch._inductor.aoti_load_package(str(paths["AOTInductor"]))
        check("AOTInductor", time.perf_counter() - start, package, dynamic=True)
    return rows, paths


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        f"{'mode':<15} {'build s':>8} {'ms/call':>9} {'rel. error':>11} {'bound':>7}  ok",
        "-" * 58,
    ]
    for r in rows:
        build = f"{r.build_s:8.1f}" if r.build_s else f"{'-':>8}"
        lines.append(
            f"{r.mode:<15} {build} {r.ms:9.2f} {r.error:11.2e} {r.bound:7.0e}  "
            f"{'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 when every check passes)."""
    parser = argparse.ArgumentParser(
        prog="python -m selective_scan.apps.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--dstate", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512, help="at least 2 (dynamic in export)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default="artifacts", help="where the .pt2 files are written")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (backward: eager forward + backward)",
    )
    args = parser.parse_args(argv)
    if args.seqlen < 2:
        parser.error("--seqlen must be at least 2 (export makes it dynamic from 2 up)")
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")

    # Noise from torch's own internals, not about this package: the notice that disabling the
    # caches also disables dynamo's profile-guided sizes, and a deprecation inside export.load.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Torch 2.13's CPU build may compute the first float32 exp of a process inexactly on the
    # second thread; a tiny single-threaded exp first avoids it (see the project's notes).
    torch.exp(torch.zeros(1))
    device = device_from(args.device)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(
        f"selective_scan demo: batch {args.batch}, dim {args.dim}, dstate {args.dstate}, "
        f"seqlen {args.seqlen}, {args.dtype}, variable B/C, D, z, delta_bias, softplus "
        f"on {device}{threads}; torch {torch.__version__}",
        flush=True,
    )
    # Compile caches are keyed without the op's fake implementation: build from scratch.
    with torch._inductor.config.patch(force_disable_caches=True):
        rows, paths = run_demo(
            args.batch, args.dim, args.dstate, args.seqlen, str(device),
            getattr(torch, args.dtype), args.out, args.repeats, args.seed, modes,
        )  # fmt: skip
    print(format_table(rows))
    print("rel. error: ||result - float64 reference|| / ||reference||, worst over the outputs")
    print("(out, last_state), or over every gradient for fwd+bwd. Export and AOTInductor have a")
    lengths = f"seqlen {args.seqlen} and {second_seqlen(args.seqlen)}"
    print(f"dynamic seqlen and are checked at {lengths}.")
    for mode, path in paths.items():
        print(f"{mode} file: {path.resolve()}")
    return exit_status(rows)


def exit_status(rows: list[Row]) -> int:
    """Report the modes whose error is above its bound on stderr (1), or that all passed (0)."""
    failed = [r.mode for r in rows if not r.ok]
    if failed:
        print(f"FAILED: error above bound in {', '.join(failed)}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
