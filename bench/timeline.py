"""When each program of the forward scan kernel starts, ends its PRE pass and ends its tile loop
(GPU): a per-program timeline of one launch, and where the time of a launch of few warps goes.

    python bench/timeline.py [--shape S6] [--dims 5120,4224]

The forward kernel has no timing hooks (they would cost every launch registers and
instructions), so this script compiles an instrumented copy of its source: the GPU's
nanosecond clock (%globaltimer) and cycle counter (%clock64) read at the program's start, before
the tile loop and after it, and the SM and warp slot it ran on (%smid, %warpid), stored per
program. It captures the arguments of one eager forward at the shape's inputs (with each of
`--dims` channels instead, as a shape of its own) and launches the copy with them, warm and
after flushing L2 as do_bench does, 7 times each; it prints the last run's percentiles and the
loop's time by how many warps shared the program's SM and scheduler (warp slot mod 4).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes
from report import edited_module

from selective_scan.kernels import scan, scan_fwd
from selective_scan.kernels.launch import recording

FIELDS = ("g0", "g1", "g2", "c1 - c0", "c2 - c1", "sm", "slot")  # stored per program, in order
PROBES = {  # anchor in scan_fwd.py -> lines inserted before it
    "    blk, seq, num_seqs = block_and_sequence(dim, BLOCK)\n": (
        "    one = tl.full([1], 0, tl.int32) + tl.program_id(0)\n"
        "    g0 = _special64(one, 'mov.u64 $0, %globaltimer;')\n"
        "    c0 = _special64(one, 'mov.u64 $0, %clock64;')\n"
    ),
    "    dt_total = tl.zeros([BD, 1, T], ACC)\n": (
        "    g1 = _special64(one, 'mov.u64 $0, %globaltimer;')\n"
        "    c1 = _special64(one, 'mov.u64 $0, %clock64;')\n"
    ),
    "    if LOCAL:\n        store_states(hloc_ptr": (
        "    g2 = _special64(one, 'mov.u64 $0, %globaltimer;')\n"
        "    c2 = _special64(one, 'mov.u64 $0, %clock64;')\n"
        "    sm = _special32(one, 'mov.u32 $0, %smid;').to(tl.int64)\n"
        "    slot = _special32(one, 'mov.u32 $0, %warpid;').to(tl.int64)\n"
        "    row = tim_ptr + tl.program_id(0) * 8 + tl.arange(0, 1)\n"
        + "".join(f"    tl.store(row + {k}, {f})\n" for k, f in enumerate(FIELDS))
    ),
}
SPECIAL = '''

@triton.jit
def _special64(x, code: tl.constexpr):
    """A special register's value (x gives the result its shape; not pure: read in place)."""
    return tl.inline_asm_elementwise(code, "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _special32(x, code: tl.constexpr):
    return tl.inline_asm_elementwise(code, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)

'''


def instrumented_kernel():
    """The forward kernel's source with the probes, compiled from a module file of its own
    (Triton reads a kernel's source from its file)."""
    head = "\n\n@triton.jit\ndef _scan_fwd_kernel("
    edits = {
        head: SPECIAL + head[2:],
        "    ALIGN: tl.constexpr,\n):": "    ALIGN: tl.constexpr, tim_ptr,\n):",
    } | {anchor: lines + anchor for anchor, lines in PROBES.items()}
    return edited_module(scan_fwd, edits.items(), "scan_fwd_timed")._scan_fwd_kernel


def captured_launch(shape: str, dim: int | None) -> tuple:
    """(grid, kwargs) of the scan launch of one eager forward."""
    if dim is not None:  # the shape with dim channels
        batch, _, *rest = shapes.SHAPES[shape]
        shape = f"{shape}_D{dim}"
        shapes.SHAPES[shape] = (batch, dim, *rest)
    inputs = shapes.make_bench_inputs(shape, device="cuda")
    softplus = inputs.pop("delta_softplus")
    with recording(launch=True) as launches:
        scan.scan_fwd(**inputs, delta_softplus=softplus)
    torch.cuda.synchronize()
    grid, kwargs = [(g, kw) for k, g, kw, _ in launches if k is scan_fwd._scan_fwd_kernel][-1]
    kwargs.pop("maxnreg", None)  # a direct launcher's option
    return grid, kwargs


def percentiles(xs: list, ps=(0, 10, 50, 90, 100)) -> str:
    xs = sorted(xs)
    return " ".join(f"p{p}={xs[min(len(xs) - 1, int(p / 100 * len(xs)))]:.2f}" for p in ps)


def report(kernel, shape: str, dim: int | None) -> None:
    grid, kwargs = captured_launch(shape, dim)
    n = grid[0] * grid[1] * grid[2]
    tim = torch.zeros(n * 8, dtype=torch.int64, device="cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for mode in ("warm", "cold"):
        spans = []
        for _ in range(7):
            if mode == "cold":
                flush.zero_()
            kernel[grid](**kwargs, tim_ptr=tim)
            torch.cuda.synchronize()
            t = tim.view(n, 8)[:, : len(FIELDS)].cpu().double()
            t0 = t[:, 0].min()
            spans.append(((t[:, 2].max() - t0) / 1e3).item())
        print(f"{shape} dim={dim} programs={n} {mode}: first start to last loop end, us: "
              + " ".join(f"{s:.2f}" for s in spans))  # fmt: skip
        start, end = (t[:, 0] - t0) / 1e3, (t[:, 2] - t0) / 1e3
        pre, loop = (t[:, 1] - t[:, 0]) / 1e3, (t[:, 2] - t[:, 1]) / 1e3
        for name, v in (("start", start), ("pre", pre), ("loop", loop), ("end", end)):
            print(f"  {name} us {percentiles(v.tolist())}")
        for name, k in (("pre", 3), ("loop", 4)):
            print(f"  {name} kcycles {percentiles((t[:, k] / 1e3).tolist())}")
        sm, slot = t[:, 5].long().tolist(), t[:, 6].long().tolist()
        per_sm = collections.Counter(sm)
        per_scheduler = collections.Counter(zip(sm, (s % 4 for s in slot), strict=True))
        by_load = collections.defaultdict(list)
        for i, (s, w) in enumerate(zip(sm, slot, strict=True)):
            by_load[(per_sm[s], per_scheduler[(s, w % 4)])].append(i)
        for (on_sm, on_scheduler), idx in sorted(by_load.items()):
            print(f"  SM of {on_sm} warps, scheduler of {on_scheduler}: {len(idx)} programs, "
                  f"loop us {percentiles([loop[i].item() for i in idx], (0, 50, 100))}, "
                  f"end us {percentiles([end[i].item() for i in idx], (0, 50, 100))}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="S6")
    parser.add_argument("--dims", default="", help="comma-separated channel counts (default: all)")
    args = parser.parse_args()
    kernel = instrumented_kernel()
    for dim in [int(d) for d in args.dims.split(",") if d] or [None]:
        report(kernel, args.shape, dim)


if __name__ == "__main__":
    main()
